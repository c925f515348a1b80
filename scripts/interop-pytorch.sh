#!/usr/bin/env bash
# Checkpoints across frameworks, checked with PyTorch (PYTHON names a Python
# with PyTorch 2.15, safetensors and transformers; CI runs this when
# TESSERA_INTEROP=1):
#
#   PYTHON=~/peers-venv/bin/python scripts/interop-pytorch.sh
#
# - Tessera -> PyTorch: `train` saves a sharded checkpoint on 2 ranks (FSDP)
#   and on 4 (FSDP over TP 2 x 2) and the consolidated weights; PyTorch's
#   distributed checkpoint reads every weight of each onto 2 and 3 gloo ranks
#   (HuggingFaceStorageReader) bit for bit.
# - The LLaMA model for Hugging Face (`train --save-hf`): transformers'
#   LlamaForCausalLM loads every weight bit for bit and gives Tessera's loss.
# - Round trips PyTorch -> Tessera -> PyTorch and Tessera -> PyTorch ->
#   Tessera, resharding onto 3 ranks on Tessera's side (reshard_checkpoint).
# - PyTorch -> Tessera: the checkpoint PyTorch wrote on 2 ranks
#   (scripts/sharded_safetensors_fixture.py) is written again now and loaded
#   by the checkpoint tests' fixture check.
# - Training continues across frameworks (scripts/interop_resume.py): for the
#   tiny GPT and LLaMA models, FSDP on 2 ranks and FSDP over TP on 2 x 2,
#   PyTorch resumes from Tessera's checkpoint after step 4 and Tessera resumes
#   from PyTorch's; each continued run's losses within 1e-6 of the other
#   framework's own run (Tessera's resume, PyTorch's uninterrupted run).
# Exits non-zero on any mismatch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:?set PYTHON to a Python with PyTorch 2.15}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cargo build --release --example train
for run in "fsdp2:--world-size 2" "fsdp_tp_2x2:--world-size 4 --tp 2"; do
    name=${run%%:*}
    # shellcheck disable=SC2086
    target/release/examples/train ${run#*:} --steps 2 --checkpoint-dir "$work/$name" --checkpoint-every 2 \
        --save-full "$work/$name.safetensors" >/dev/null
    for world in 2 3; do
        "$PY" scripts/interop_pytorch.py "$work/$name/step_000002" "$work/$name.safetensors" "$world"
    done
done
# The LLaMA export: Hugging Face's LlamaForCausalLM (transformers) loads
# `train --save-hf` and gives Tessera's loss on the same rows.
target/release/examples/train --model llama --n-kv-heads 2 --ffn-hidden 192 \
    --init tests/data/llama_tiny_init.safetensors --tokens tests/data/tiny_tokens_G16.safetensors \
    --world-size 2 --batch 8 --steps 1 --lr 0 --save-full "$work/llama.safetensors" --save-hf "$work/llama_hf" \
    --losses-out "$work/llama_losses.json" >/dev/null
"$PY" scripts/interop_hf.py "$work/llama_hf" "$work/llama.safetensors" tests/data/tiny_tokens_G16.safetensors \
    "$work/llama_losses.json"
# Round trips, tensors bit for bit at every stop. PyTorch -> Tessera ->
# PyTorch: PyTorch's checkpoint (the fixture) resharded by Tessera onto 3 ranks
# and saved, read back by PyTorch on 2. Tessera -> PyTorch -> Tessera:
# Tessera's FSDP checkpoint read by PyTorch on 2 ranks and saved as sharded
# safetensors, resharded by Tessera onto 3 and saved, read by PyTorch again.
cargo build --release --example reshard_checkpoint
reshard=target/release/examples/reshard_checkpoint
fixture=tests/data/sharded_safetensors
"$reshard" "$fixture/shards" "$work/rt_tessera" --world-size 3
"$PY" scripts/interop_pytorch.py "$work/rt_tessera" "$fixture/full/full.safetensors" 2
"$PY" scripts/interop_pytorch.py "$work/fsdp2/step_000002" "$work/fsdp2.safetensors" 2 "$work/rt_pytorch"
"$reshard" "$work/rt_pytorch" "$work/rt_back" --world-size 3
"$PY" scripts/interop_pytorch.py "$work/rt_back" "$work/fsdp2.safetensors" 2
"$PY" scripts/sharded_safetensors_fixture.py "$work/fixture"
for f in "$work"/fixture/shards/*.safetensors; do
    cmp <("$PY" -c 'import sys; from safetensors.torch import load_file; t=load_file(sys.argv[1]); print(sorted((k, v.dtype, tuple(v.shape), v.float().sum().item()) for k, v in t.items()))' "$f") \
        <("$PY" -c 'import sys; from safetensors.torch import load_file; t=load_file(sys.argv[1]); print(sorted((k, v.dtype, tuple(v.shape), v.float().sum().item()) for k, v in t.items()))' "tests/data/sharded_safetensors/shards/$(basename "$f")")
done
# Training continues across frameworks, steps 5 to 8 after a checkpoint of
# step 4, both ways; each side's step-4 checkpoint also makes the round trip
# through the other framework.
echo "continued run                         steps  max |dloss| vs the other's own run"
for model in gpt llama; do
    for mode in fsdp fsdp_tp; do
        flags=(--init tests/data/tiny_init.safetensors --tokens tests/data/tiny_tokens_G16.safetensors --batch 4)
        [ "$model" = llama ] && flags=(--model llama --n-kv-heads 2 --ffn-hidden 192
            --init tests/data/llama_tiny_init.safetensors --tokens tests/data/tiny_tokens_G16.safetensors --batch 4)
        if [ "$mode" = fsdp ]; then flags+=(--world-size 2); else flags+=(--world-size 4 --tp 2); fi
        d="$work/resume_${model}_$mode"
        mkdir -p "$d"
        target/release/examples/train "${flags[@]}" --steps 8 --checkpoint-dir "$d/tessera" --checkpoint-every 4 \
            --losses-out "$d/tessera_whole.json" >/dev/null
        target/release/examples/train "${flags[@]}" --steps 8 --resume "$d/tessera/step_000004" \
            --losses-out "$d/tessera_resumed.json" >/dev/null
        "$PY" scripts/interop_resume.py --model "$model" --mode "$mode" --steps 8 --resume "$d/tessera/step_000004" \
            --first 4 --losses-out "$d/pytorch_from_tessera.json"
        "$PY" scripts/interop_resume.py --model "$model" --mode "$mode" --steps 8 --save "$d/pytorch" --save-after 4 \
            --losses-out "$d/pytorch_whole.json"
        target/release/examples/train "${flags[@]}" --steps 8 --resume "$d/pytorch" --resume-step 4 \
            --losses-out "$d/tessera_from_pytorch.json" >/dev/null
        # Round trips of the whole state (parameters and AdamW's moments and
        # steps), bit for bit: Tessera -> PyTorch -> Tessera (resharded onto 3
        # ranks), and PyTorch (its FSDP ranks' checkpoint) -> Tessera (onto 3
        # ranks) -> PyTorch.
        "$PY" scripts/interop_roundtrip.py resave "$d/tessera/step_000004" "$d/rt_pytorch"
        "$reshard" "$d/rt_pytorch" "$d/rt_tessera" --world-size 3 >/dev/null
        "$PY" scripts/interop_roundtrip.py compare "$d/tessera/step_000004" "$d/rt_tessera"
        "$reshard" "$d/pytorch" "$d/pt_tessera" --world-size 3 >/dev/null
        "$PY" scripts/interop_roundtrip.py resave "$d/pt_tessera" "$d/pt_back"
        "$PY" scripts/interop_roundtrip.py compare "$d/pytorch" "$d/pt_back"
        "$PY" - "$d" "$model" "$mode" <<'PYEOF'
import json, os, sys
d, model, mode = sys.argv[1:]
load = lambda n: json.load(open(os.path.join(d, n)))["loss"]
tw, tr, pt, pw, tp = (load(n + ".json") for n in
                      ["tessera_whole", "tessera_resumed", "pytorch_from_tessera", "pytorch_whole", "tessera_from_pytorch"])
bad = 0
for what, got, want in [(f"Tessera -> PyTorch {model} {mode}", pt, tr), (f"PyTorch -> Tessera {model} {mode}", tp, pw[4:])]:
    worst = max(abs(a - b) for a, b in zip(got, want)) if len(got) == len(want) == 4 else float("inf")
    ok = worst <= 1e-6
    bad += not ok
    print(f"{what:<37} 5-8    {worst:.2e} {'ok' if ok else 'FAILED'}")
if tr != tw[4:]:
    print(f"Tessera's own resume {model} {mode} differs from its uninterrupted run: FAILED"); bad += 1
sys.exit(1 if bad else 0)
PYEOF
    done
done
echo "interop with PyTorch: ok"
