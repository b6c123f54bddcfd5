#!/usr/bin/env python3
"""Small models for tensor-parallel edge cases, each with its stored plan:

    tp_edge_models.py KIND OUT.pt

  padding_idx         an embedding with a padding row (nn.Embedding(padding_idx=101): row 101, the
                      byte 'e' of the fixture's text, gets no gradient), split over the vocabulary;
                      scripted, F.embedding receives the index as an argument. Under TP it must
                      become the index of this rank's row, or none (tensor_parallel.cpp,
                      localise_padding_idx)
  padding_idx_traced  the same traced: aten::embedding holds the index as a constant
  padding_idx_freq    the same with scale_grad_by_freq, which TP must refuse
  own_param           blocks holding a parameter of their own beside their submodules (a per-channel
                      rate mixing the residual stream with the MLP's output, as Dory's lambda_1),
                      marked alone in the plan ("blocks.*.rate": sequence_parallel): under sequence
                      parallelism its gradient is summed over TP
  sometimes_unused    a layer outside the blocks (`extra`) that a micro-batch uses only when its
                      token sum is a multiple of 8 (a scripted branch): in about a third of the
                      steps no micro-batch uses it, and autograd gives it no gradient at all. Not a
                      TP case: under no_shard and optim_grads the engine copies each parameter's
                      first gradient of a step into the persistent buffer instead of zeroing it
                      first, and must zero a parameter that got none (fsdp_engine.cpp,
                      settle_unwritten); strategy 3 allocates a zeroed buffer per backward
"""
import json
import sys

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d, rate):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.rate = nn.Parameter(torch.full((d,), 0.5)) if rate else None

    def forward(self, x):
        y = self.proj(torch.relu(self.fc(self.ln(x))))
        if self.rate is None:
            return x + y
        return x + self.rate * (y - x)


class Model(nn.Module):
    def __init__(self, kind, vocab=264, d=32):
        super().__init__()
        own = kind == "own_param"
        self.emb = nn.Embedding(vocab, d) if own else nn.Embedding(
            vocab, d, padding_idx=101, scale_grad_by_freq=kind == "padding_idx_freq")
        self.blocks = nn.ModuleList([Block(d, own), Block(d, own)])
        self.ln_f = nn.LayerNorm(d) if own else nn.Identity()
        self.head = nn.Linear(d, vocab, bias=False)
        self.sometimes = kind == "sometimes_unused"
        self.extra = nn.Linear(d, d) if self.sometimes else nn.Identity()

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        if self.sometimes and int(tokens.sum()) % 8 == 0:
            x = x + self.extra(x)
        return self.head(self.ln_f(x))


def main():
    kind, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = Model(kind)
    plan = {"emb": "vocab_parallel", "blocks.*.fc": "colwise", "blocks.*.proj": "rowwise", "head": "colwise"}
    if kind == "own_param":
        plan.update({"blocks.*.ln": "sequence_parallel", "blocks.*.rate": "sequence_parallel", "ln_f": "sequence_parallel"})
    if kind == "padding_idx_traced":
        m = torch.jit.trace(model, (torch.zeros(1, 8, dtype=torch.long), torch.arange(8).unsqueeze(0)))
    else:
        m = torch.jit.script(model)
    torch.jit.save(m, out, _extra_files={"mfsdp/tp_plan.json": json.dumps(plan)})


if __name__ == "__main__":
    main()
