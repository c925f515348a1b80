"""The LLaMA-style reference model in PyTorch (`train --model llama`), torchtitan's
parameter names, its init and its tensor-parallel plans, for the interop checks
(scripts/interop_resume.py). The formulas are those of tests/data/llama_reference.json's
model_spec.

  tok_embeddings.weight                 [vocab, dim]                 N(0, 0.02^2)
  layers.{i}.attention_norm.weight      [dim]                        1
  layers.{i}.attention.wq.weight        [n_heads*hd, dim]            N(0, 0.02^2)
  layers.{i}.attention.wk.weight        [n_kv_heads*hd, dim]         N(0, 0.02^2)
  layers.{i}.attention.wv.weight        [n_kv_heads*hd, dim]         N(0, 0.02^2)
  layers.{i}.attention.wo.weight        [dim, n_heads*hd]            N(0, 0.02^2)
  layers.{i}.ffn_norm.weight            [dim]                        1
  layers.{i}.feed_forward.w1.weight     [ffn_hidden, dim]            N(0, 0.02^2)
  layers.{i}.feed_forward.w2.weight     [dim, ffn_hidden]            N(0, 0.02^2)
  layers.{i}.feed_forward.w3.weight     [ffn_hidden, dim]            N(0, 0.02^2)
  norm.weight                           [dim]                        1
  output.weight                         [vocab, dim]                 N(0, 0.02^2)

(hd = dim / n_heads.) RMSNorm eps 1e-5 with statistics in float32, RoPE theta 1e4 in the
"rotate_half" convention (dims j and j+hd/2 of a head rotate together), GQA by
repeat_interleave (query head h uses kv head h // (n_heads/n_kv_heads)), SwiGLU
w2(silu(w1 x) * w3 x), causal SDPA with scale 1/sqrt(hd), no biases, untied output head, no
positional table. Init (init_weights): torch.manual_seed(seed) after building the module, then
ones for names ending in "norm.weight" and normal_(0, 0.02) for every other weight, in
named_parameters() order.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------- model


@dataclass
class LlamaArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    max_seq_len: int = 32
    ffn_hidden: int = 192
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@functools.lru_cache(maxsize=None)
def rope_tables(seq: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq, head_dim], float32 ("rotate_half" layout).

    Computed with Python's math module (C libm, IEEE double), then rounded to float32:
      inv_freq[j] = 1.0 / theta ** (2*j / head_dim)        j = 0 .. head_dim/2 - 1
      ang[p][j]   = p * inv_freq[j]                         p = 0 .. seq-1
      cos[p][c]   = f32(cos(ang[p][c % (head_dim/2)]))       c = 0 .. head_dim-1
      sin[p][c]   = f32(sin(ang[p][c % (head_dim/2)]))
    i.e. columns c and c + head_dim/2 share the frequency inv_freq[c % (head_dim/2)].
    """
    half = head_dim // 2
    inv_freq = [1.0 / (theta ** (2 * j / head_dim)) for j in range(half)]
    ang = [[p * inv_freq[j] for j in range(half)] for p in range(seq)]
    cos = np.array([[math.cos(a) for a in row] for row in ang], dtype=np.float64)
    sin = np.array([[math.sin(a) for a in row] for row in ang], dtype=np.float64)
    cos = np.concatenate([cos, cos], axis=1).astype(np.float32)
    sin = np.concatenate([sin, sin], axis=1).astype(np.float32)
    return torch.from_numpy(cos), torch.from_numpy(sin)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, s, heads, head_dim]; computed in float32, result cast back to x's dtype."""
    xf = x.float()
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return (xf * c + rotate_half(xf) * s).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, s, n_kv, hd] -> [b, s, n_kv*n_rep, hd]; head h of the result is kv head h // n_rep
    (LLaMA's repeat_kv: expand on a new dim after the kv-head dim, then flatten)."""
    if n_rep == 1:
        return x
    return torch.repeat_interleave(x, n_rep, dim=2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        if a.dim % a.n_heads or a.n_heads % a.n_kv_heads:
            raise ValueError("dim % n_heads and n_heads % n_kv_heads must be 0")
        self.head_dim = a.head_dim
        self.n_rep = a.n_heads // a.n_kv_heads
        self.rope_theta = a.rope_theta
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hd = self.head_dim
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # plain tensors (TP: local columns)
        b, s = q.shape[0], q.shape[1]
        # -1: under TP each rank holds n_heads/tp query heads and n_kv_heads/tp kv heads
        q = q.view(b, s, -1, hd)
        k = k.view(b, s, -1, hd)
        v = v.view(b, s, -1, hd)
        cos, sin = rope_tables(s, hd, self.rope_theta)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k = repeat_kv(k, self.n_rep)
        v = repeat_kv(v, self.n_rep)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hd]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, s, -1)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a.dim, a.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(TransformerBlock(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError("sequence longer than max_seq_len")
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


def init_weights(model: Llama, seed: int) -> None:
    """torch.manual_seed(seed); then, in named_parameters() order, norm weights = 1 and every
    other weight (embedding, all linears) ~ N(0, 0.02^2) via nn.init.normal_."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=0.02)


# ----------------------------------------------------------------------------- parallelism


# parallelize_tp(model, tp_mesh, sp): torchtitan's LLaMA tensor-parallel plan on a 1-D tp mesh.
#   sp=False: tok_embeddings RowwiseParallel (Replicate in and out), attention.wq/wk/wv and
#     feed_forward.w1/w3 ColwiseParallel, attention.wo and feed_forward.w2 RowwiseParallel,
#     output ColwiseParallel with the logits gathered to Replicate; norms stay replicated.
#   sp=True: the same plus sequence parallelism (SequenceParallel norms, activations Shard(1)
#     between blocks, PrepareModuleInput all-gathers the sequence before attention / feed_forward).
# Each tp rank then runs n_heads/tp query heads and n_kv_heads/tp kv heads (Attention views its
# local projection output with -1 heads), so tp must divide n_heads, n_kv_heads, ffn_hidden, vocab.
def parallelize_tp(model: Llama, tp_mesh, sp: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = tp_mesh.size()
    a = model.args
    if a.n_heads % tp or a.n_kv_heads % tp or a.ffn_hidden % tp or a.vocab_size % tp:
        raise ValueError(f"tp={tp} must divide n_heads, n_kv_heads, ffn_hidden and vocab")
    if not sp:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        })
        for layer in model.layers:
            parallelize_module(layer, tp_mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            })
        return
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
