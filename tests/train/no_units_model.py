#!/usr/bin/env python3
"""A model with no repeated sibling modules (no FSDP unit can be found): no_units_model.py OUT.pt"""
import sys

import torch


class NoUnits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(264, 16)
        self.head = torch.nn.Linear(16, 264)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


torch.jit.script(NoUnits()).save(sys.argv[1])
