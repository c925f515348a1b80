"""The GPT-style reference Transformer in PyTorch: the model `train` trains, for
the interop checks (scripts/interop_resume.py). Pre-norm blocks, causal attention,
exact GELU MLP with biases, learned positions, untied head; no dropout.

Parameter names (the state-dict keys, as Tessera names them):

  tok_embeddings.weight                 [vocab, dim]       N(0, 1)
  pos_embeddings.weight                 [max_seq, dim]     N(0, 1)
  layers.{i}.attention_norm.weight      [dim]              1
  layers.{i}.attention_norm.bias        [dim]              0
  layers.{i}.attention.wq.weight        [dim, dim]         U(-1/sqrt(dim), 1/sqrt(dim))
  layers.{i}.attention.wk.weight        [dim, dim]         same
  layers.{i}.attention.wv.weight        [dim, dim]         same
  layers.{i}.attention.wo.weight        [dim, dim]         same
  layers.{i}.ffn_norm.weight            [dim]              1
  layers.{i}.ffn_norm.bias              [dim]              0
  layers.{i}.feed_forward.w1.weight     [4*dim, dim]       U(-1/sqrt(dim), 1/sqrt(dim))
  layers.{i}.feed_forward.w1.bias       [4*dim]            U(-1/sqrt(dim), 1/sqrt(dim))
  layers.{i}.feed_forward.w2.weight     [dim, 4*dim]       U(-1/sqrt(4*dim), 1/sqrt(4*dim))
  layers.{i}.feed_forward.w2.bias       [dim]              U(-1/sqrt(4*dim), 1/sqrt(4*dim))
  norm.weight                           [dim]              1
  norm.bias                             [dim]              0
  output.weight                         [vocab, dim]       U(-1/sqrt(dim), 1/sqrt(dim))

(Linear weights are stored [out_features, in_features]; y = x @ W^T + b.  The
uniform bounds are what nn.Linear's default kaiming_uniform_(a=sqrt(5)) reduces to.)

Numerics the Rust side must match:
  * LayerNorm: eps = 1e-5, biased variance (divide by dim), elementwise affine.
  * GELU: exact erf form, 0.5*x*(1+erf(x/sqrt(2)))  (nn.GELU(approximate='none')).
  * Attention: scores = (q @ k^T) * (1/sqrt(head_dim)), causal mask (key j > query i
    gets -inf), softmax over keys, then @ v.  Heads are split as
    q.view(B, T, n_heads, head_dim).transpose(1, 2), i.e. head h owns feature
    columns [h*head_dim, (h+1)*head_dim) of wq/wk/wv outputs; merged back by
    transpose(1, 2).reshape(B, T, dim) before wo.
  * Block: h = x + wo(attn(LN1(x)));  out = h + w2(gelu(w1(LN2(h)))).
  * Embedding: h0 = tok_emb[tokens] + pos_emb[arange(T)].
  * Head: logits = output(norm(h_L)), returned as float32.
  * No weight tying between tok_embeddings and output.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 256
    max_seq_len: int = 32
    dim: int = 64
    n_heads: int = 4


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.dim % args.n_heads:
            raise ValueError("dim must be divisible by n_heads")
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def _heads(self, t: torch.Tensor, b: int, s: int) -> torch.Tensor:
        # (b, s, dim) -> (b, n_heads, s, head_dim)
        return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self._heads(self.wq(x), b, s)
        k = self._heads(self.wk(x), b, s)
        v = self._heads(self.wv(x), b, s)
        # default scale is 1/sqrt(head_dim); causal mask; no dropout
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, s, -1)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)      # with bias, as upstream
        self.gelu = nn.GELU()                     # erf variant (approximate='none')
        self.w2 = nn.Linear(hidden_dim, dim)      # with bias, as upstream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)   # eps=1e-5
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)         # eps=1e-5
        self.feed_forward = FeedForward(args.dim, 4 * args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, s = tokens.shape
        if s > self.model_args.max_seq_len:
            raise ValueError("sequence longer than max_seq_len")
        pos = torch.arange(s, device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


def param_table(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


if __name__ == "__main__":
    m = Transformer(ModelArgs())
    for n, shp in param_table(m):
        print(f"{n:40s} {shp}")
    print("total params", sum(p.numel() for p in m.parameters()))
