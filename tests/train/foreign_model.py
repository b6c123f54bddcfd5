#!/usr/bin/env python3
"""A model written apart from scripts/export_model.py, as a user would write one, following only the
README's model contract: torchtitan-style names, a fused q/k/v projection with grouped-query
attention (unequal packed parts), no stored tensor-parallel plan (its plan lives in the test YAML).

    foreign_model.py OUT.pt [--hf | --pos-buffer]

--hf wraps it the Hugging Face way: the body under `model` (model.layers.N, model.norm) and the
output head `lm_head` at the root, so that the units and the final norm sit one level down.
--pos-buffer keeps the position table in a buffer (pos_table, 512 x 64 fp32 = 128 KiB: above the
size whose bytes a meta-device load leaves unread, so the load must read it back) instead of a
parameter, and writes the parameters beside OUT.pt as OUT.safetensors (for model.init_from).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv) * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.q_share = n_heads * self.head_dim  # fractions of the fused output, used as ratios only
        self.kv_share = n_kv * self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(x)
        # Part widths from the output width (a TP rank holds a slice of every part).
        total = self.q_share + 2 * self.kv_share
        nq = qkv.size(-1) * self.q_share // total
        nkv = qkv.size(-1) * self.kv_share // total
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        b, t = q.size(0), q.size(1)
        h, hkv = nq // self.head_dim, nkv // self.head_dim
        q = q.view(b, t, h, self.head_dim).transpose(1, 2)
        k = k.view(b, t, hkv, self.head_dim).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
        v = v.view(b, t, hkv, self.head_dim).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
        mask = torch.full((t, t), float("-inf")).triu(1)
        y = torch.softmax(q @ k.transpose(-2, -1) / float(self.head_dim) ** 0.5 + mask, dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(b, t, h * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 264, dim: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv: int = 2,
                 pos_buffer: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(128, dim)
        self.pos_buffer = pos_buffer
        self.register_buffer("pos_table", torch.randn(512, dim) if pos_buffer else torch.zeros(0), persistent=False)
        self.layers = nn.ModuleList([TransformerBlock(dim, n_heads, n_kv) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        h = h + (self.pos_table[position_ids] if self.pos_buffer else self.pos_embeddings(position_ids))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class HfCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = HfBody()
        self.lm_head = nn.Linear(64, 264, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens, position_ids))


class HfBody(nn.Module):
    def __init__(self):
        super().__init__()
        t = Transformer()
        self.embed_tokens, self.embed_positions, self.layers, self.norm = t.tok_embeddings, t.pos_embeddings, t.layers, t.norm

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens) + self.embed_positions(position_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


if __name__ == "__main__":
    torch.manual_seed(7)
    buf = "--pos-buffer" in sys.argv[2:]
    model = HfCausalLM() if "--hf" in sys.argv[2:] else Transformer(pos_buffer=buf)
    if buf:
        model.pos_embeddings = nn.Identity()  # not called: the buffer holds the positions
    for name, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, 0.0, 0.02)
    torch.jit.script(model).save(sys.argv[1])
    if buf:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in model.named_parameters()}, sys.argv[1].rsplit(".", 1)[0] + ".safetensors")
    print(f"wrote {sys.argv[1]}: {sum(p.numel() for p in model.parameters())} parameters")
