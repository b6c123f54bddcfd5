#!/usr/bin/env python3
"""A model-contract TorchScript whose block runs twice per forward with another constant each time
(a scale of 2, then 3): torch.jit.trace records the second call as the block's forward1, a graph
other than forward, which mfsdp cannot point at forward (graph_rewrite.h, unify_traced_repeats).
As an FSDP unit it must be refused, naming the call (tests/hf/hf_tests.cmake).

    make_repeat_model.py OUT.pt"""
import sys

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x + scale * torch.tanh(self.fc(x))


class Looped(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(264, 16)
        self.block = Block()
        self.head = nn.Linear(16, 264)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        return self.head(self.block(self.block(x, 2.0), 3.0))


torch.manual_seed(0)
tokens = torch.randint(0, 264, (2, 8))
traced = torch.jit.trace(Looped(), (tokens, torch.arange(8).expand(2, 8)))
assert "forward1" in str(traced.graph), "the trace did not record a second method"
traced.save(sys.argv[1])
