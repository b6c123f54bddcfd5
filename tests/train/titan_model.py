#!/usr/bin/env python3
"""A Llama written the way torchtitan writes one, apart from scripts/export_model.py: the rotary
table a complex64 buffer (freqs_cis, applied through view_as_complex), torch.nn.RMSNorm
(aten::rms_norm, not the rsqrt chain mfsdp's kernel matches), grouped-query attention through
repeat_interleave and F.scaled_dot_product_attention(is_causal=True), and PyTorch's default
initialisation (an N(0, 1) embedding table: values whose bf16 rounding is large against a step).

    titan_model.py OUT.pt [--dim 64 --layers 2 --heads 4 --kv-heads 2 --hidden 176 --vocab 264 --max-seq 64]
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotary_table(head_dim: int, max_seq: int, theta: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_seq).float(), inv)
    return torch.polar(torch.ones_like(angles), angles)  # [max_seq, head_dim / 2] complex64


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, head_dim]: pairs of features turned by the position's angles, in fp32."""
    pairs = torch.view_as_complex(x.float().reshape(x.size(0), x.size(1), x.size(2), -1, 2))
    turned = pairs * table[: x.size(1)].view(1, x.size(1), 1, pairs.size(3))
    return torch.view_as_real(turned).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)
        q = rotate(self.wq(x).view(b, t, -1, self.head_dim), table)
        k = rotate(self.wk(x).view(b, t, -1, self.head_dim), table)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        group = q.size(2) // k.size(2)
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attention = Attention(dim, heads, kv_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int, max_seq: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([TransformerBlock(dim, heads, kv_heads, hidden) for _ in range(layers)])
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", rotary_table(dim // heads, max_seq))

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    for name, default in (("dim", 64), ("layers", 2), ("heads", 4), ("kv-heads", 2), ("hidden", 176), ("vocab", 264),
                          ("max-seq", 64)):
        ap.add_argument("--" + name, type=int, default=default)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = Transformer(a.vocab, a.dim, a.layers, a.heads, a.kv_heads, a.hidden, a.max_seq)
    torch.jit.script(model).save(a.out)


if __name__ == "__main__":
    main()
