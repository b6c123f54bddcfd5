#!/usr/bin/env python3
"""A model whose blocks hold a parameter of their own beside their submodules (a per-channel rate
mixing the residual stream with the MLP's output, as Dory's lambda_1): own_param_model.py OUT.pt.
Its stored plan marks that parameter alone, "blocks.*.rate": sequence_parallel (a style on the
block would reach every parameter below it): under sequence parallelism each TP rank sees its part
of the sequence, so the rate's gradient is summed over TP."""
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
        self.rate = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, x):
        y = self.proj(torch.relu(self.fc(self.ln(x))))
        return x + self.rate * (y - x)


class OwnParamModel(nn.Module):
    def __init__(self, vocab=264, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


torch.manual_seed(0)
plan = {"emb": "vocab_parallel", "blocks.*.fc": "colwise", "blocks.*.proj": "rowwise", "blocks.*.ln": "sequence_parallel",
        "blocks.*.rate": "sequence_parallel", "ln_f": "sequence_parallel", "head": "colwise"}
torch.jit.save(torch.jit.script(OwnParamModel()), sys.argv[1], _extra_files={"mfsdp/tp_plan.json": json.dumps(plan)})
