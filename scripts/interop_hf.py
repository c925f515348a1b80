#!/usr/bin/env python3
"""Hugging Face's LlamaForCausalLM loads Tessera's LLaMA export.

    $PY scripts/interop_hf.py HF_DIR FULL.safetensors TOKENS.safetensors LOSSES.json

HF_DIR is what `train --model llama --save-hf HF_DIR` wrote, FULL the same
weights under Tessera's names (`--save-full`), LOSSES the `--losses-out` of
that run, trained with `--lr 0` on the rows `tokens[0]` of TOKENS (so the
first step's loss is the exported model's). Checks that every weight arrives
bit for bit under its Hugging Face name and that the model's mean next-token
loss on those rows is Tessera's within 1e-5. Exits non-zero otherwise.
"""
import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

HF = {
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}


def hf_name(name):
    fixed = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    _, layer, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    return f"model.layers.{layer}.{HF[module]}.{leaf}"


def main():
    hf_dir, full_path, tokens_path, losses_path = sys.argv[1:5]
    model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    state = model.state_dict()
    full = load_file(full_path)
    bad = [n for n, v in full.items() if not torch.equal(state[hf_name(n)], v)]
    rows = load_file(tokens_path)["tokens"][0]
    with torch.no_grad():
        logits = model(rows[:, :-1]).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()
    ours = json.load(open(losses_path))["loss"][0]
    ok = not bad and abs(loss - ours) <= 1e-5
    print(f"LlamaForCausalLM read {len(full) - len(bad)} of {len(full)} weights bit for bit; loss {loss:.7f}, "
          f"Tessera's {ours:.7f} (|diff| {abs(loss - ours):.1e}): {'ok' if ok else 'MISMATCH'}"
          + (f"; differ: {bad[:5]}" if bad else ""))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
