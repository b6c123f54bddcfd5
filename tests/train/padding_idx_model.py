#!/usr/bin/env python3
"""A model whose embedding has a padding row (nn.Embedding(padding_idx=101): row 101, the byte 'e'
of the fixture's text, gets no gradient), with a TP plan that splits the embedding over the
vocabulary: padding_idx_model.py OUT.pt [--trace]. Scripted, F.embedding receives the index as an
argument; traced, aten::embedding holds it as a constant. Under TP either must become the index of
this rank's row, or none (tensor_parallel.cpp, localise_padding_idx). With --freq the embedding scales
its gradient by the ids' frequency (scale_grad_by_freq), which TP must refuse."""
import json
import sys

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(torch.relu(self.fc(self.ln(x))))


class PaddedEmbeddingModel(nn.Module):
    def __init__(self, vocab=264, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=101, scale_grad_by_freq="--freq" in sys.argv)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


torch.manual_seed(0)
model = PaddedEmbeddingModel()
if "--trace" in sys.argv:
    tokens = torch.zeros(1, 8, dtype=torch.long)
    m = torch.jit.trace(model, (tokens, torch.arange(8).unsqueeze(0)))
else:
    m = torch.jit.script(model)
plan = {"emb": "vocab_parallel", "blocks.*.fc": "colwise", "blocks.*.proj": "rowwise", "head": "colwise"}
torch.jit.save(m, sys.argv[1], _extra_files={"mfsdp/tp_plan.json": json.dumps(plan)})
