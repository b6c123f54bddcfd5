#!/usr/bin/env python3
"""GPTs whose attention is written out, softmax(q k^T) v, as two well-known codebases write it,
apart from scripts/export_model.py (mfsdp takes these through its attention kernel:
model/eager_attention.cpp):

- mingpt (scripted): minGPT's / nanoGPT's non-flash CausalSelfAttention: `(q @ k.transpose(-2, -1))
  * (1.0 / math.sqrt(k.size(-1)))`, masked_fill of a registered tril buffer with -inf, F.softmax, an
  nn.Dropout module on the probabilities (`--dropout P`), biases, exact GELU.
- meta (traced): Meta's reference Llama: grouped-query attention with repeat_kv on [B, T, H, D]
  before the transpose, `torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(head_dim)`, an additive
  -inf mask built in the forward with triu, `F.softmax(scores.float(), dim=-1).type_as(xq)`,
  RMSNorm and SwiGLU, no biases.

    written_attention_model.py OUT.pt --style mingpt|meta [--dim 64 --layers 2 --heads 4
        --kv-heads 2 --vocab 264 --max-seq 64 --dropout 0]
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MinGptAttention(nn.Module):
    def __init__(self, dim: int, heads: int, max_seq: int, dropout: float):
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.attn_dropout = nn.Dropout(dropout)
        self.n_head = heads
        self.register_buffer("bias", torch.tril(torch.ones(max_seq, max_seq)).view(1, 1, max_seq, max_seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MinGptBlock(nn.Module):
    def __init__(self, dim: int, heads: int, max_seq: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = MinGptAttention(dim, heads, max_seq, dropout)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(
        bs, slen, n_kv_heads * n_rep, head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MetaAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = heads, kv_heads
        self.n_rep = heads // kv_heads
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        return self.wo(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class MetaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = MetaAttention(dim, heads, kv_heads)
        self.ffn_norm = RMSNorm(dim)
        hidden = 4 * dim * 2 // 3
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), mask)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class MinGpt(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(a.vocab, a.dim)
        self.pos = nn.Embedding(a.max_seq, a.dim)
        self.h = nn.ModuleList([MinGptBlock(a.dim, a.heads, a.max_seq, a.dropout) for _ in range(a.layers)])
        self.norm = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(position_ids)
        for block in self.h:
            x = block(x)
        return self.head(self.norm(x))


class MetaLlama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(a.vocab, a.dim)
        self.pos = nn.Embedding(a.max_seq, a.dim)
        self.layers = nn.ModuleList([MetaBlock(a.dim, a.heads, a.kv_heads) for _ in range(a.layers)])
        self.norm = RMSNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(position_ids)
        t = tokens.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), diagonal=1)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(self.norm(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--style", choices=["mingpt", "meta"], required=True)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=264)
    ap.add_argument("--max-seq", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.0)
    a = ap.parse_args()
    torch.manual_seed(11)
    if a.style == "mingpt":
        torch.jit.script(MinGpt(a)).save(a.out)
    else:
        model = MetaLlama(a)
        model.train()  # traced in training mode, as a user exporting for training does
        tokens = torch.randint(0, a.vocab, (2, 16))
        pos = torch.arange(16).unsqueeze(0).expand(2, 16)
        torch.jit.trace(model, (tokens, pos), check_trace=False).save(a.out)


if __name__ == "__main__":
    main()
