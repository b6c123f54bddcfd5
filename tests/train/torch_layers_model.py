#!/usr/bin/env python3
"""A GPT built from torch.nn's own layers, as a PyTorch tutorial writes one, apart from
scripts/export_model.py: nn.TransformerEncoderLayer blocks (pre-norm, GELU, batch first) with a
causal mask, so that attention is nn.MultiheadAttention: its projections and its
scaled_dot_product_attention call live in torch.nn.functional's multi_head_attention_forward, a
function of the saved file rather than a module's graph, and its dropout (attention, residual and
feed-forward, `--dropout P`) is the functional one (`dropout_p if training else 0`, F.dropout).

    torch_layers_model.py OUT.pt [--dim 64 --layers 2 --heads 4 --ffn 128 --vocab 264 --max-seq 64 --dropout 0]
"""
import argparse

import torch
import torch.nn as nn


class Trunk(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(dim, heads, ffn, dropout=dropout, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf"), device=x.device), diagonal=1)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return x


class Gpt(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(a.vocab, a.dim)
        self.pos = nn.Embedding(a.max_seq, a.dim)
        self.trunk = Trunk(a.dim, a.layers, a.heads, a.ffn, a.dropout)
        self.norm = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.trunk(self.tok(tokens) + self.pos(position_ids))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=264)
    ap.add_argument("--max-seq", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.0)
    a = ap.parse_args()
    torch.manual_seed(7)
    torch.jit.script(Gpt(a)).save(a.out)


if __name__ == "__main__":
    main()
