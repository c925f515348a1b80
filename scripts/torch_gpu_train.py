#!/usr/bin/env python3
"""PyTorch's step time on one GPU for the model `train` trains, for the speed
comparison in scripts/gpu-check.sh: the same GPT-style Transformer (pre-norm
blocks, exact GELU MLP with biases, causal attention, untied head), AdamW
(lr 1e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1), eager mode, TF32 off,
`--bf16` as autocast to bfloat16 with f32 parameters and an f32 loss.

    python3 scripts/torch_gpu_train.py --dim 256 --n-layers 4 --n-heads 8 \
        --vocab 4096 --seq 128 --batch 8 --steps 12 [--bf16]

Prints one JSON line: median step seconds (steps after the first two) and the
losses.
"""
import argparse, json, statistics, time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, d))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class Transformer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(a.vocab, a.dim)
        self.pos = nn.Embedding(a.seq, a.dim)
        self.layers = nn.ModuleList(Block(a.dim, a.n_heads) for _ in range(a.n_layers))
        self.norm = nn.LayerNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


def main():
    p = argparse.ArgumentParser()
    for name, default in [("dim", 256), ("n-layers", 4), ("n-heads", 8), ("vocab", 4096), ("seq", 128), ("batch", 8), ("steps", 12)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = Transformer(a).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator(device="cuda").manual_seed(1234)
    times, losses = [], []
    for _ in range(a.steps):
        rows = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device="cuda", generator=g)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.bf16):
            logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), rows[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"median_step_s": statistics.median(times[2:]), "losses": losses, "params": params,
                      "peak_allocated_bytes": torch.cuda.max_memory_allocated()}))


if __name__ == "__main__":
    main()
