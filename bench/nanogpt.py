#!/usr/bin/python3
"""A nanoGPT-shaped model, as its users write it, for the side-by-side benchmarks of bench/dropout.sh.

Written for the benchmark (not scripts/export_model.py's GPT): nanoGPT's layout and habits, which
mfsdp must take as a user's file comes: exact GELU, biases, a tied output head, embedding dropout,
attention dropout given to scaled_dot_product_attention as `p if self.training else 0`, and residual
dropout through nn.Dropout (a function call in the saved script). The attention core is a module of
its own, as mfsdp's contract asks (README, "Exporting a model"). `--attention written` makes that
core nanoGPT's fallback for a torch without flash attention, softmax(q k^T) v written out with a
tril buffer, F.softmax and an nn.Dropout on the probabilities (bench/dropout.sh ATTENTION=written).

    nanogpt.py export --out F [--layers 6 --d-model 384 --heads 6 --vocab 264 --block 256 --dropout 0.2]
                              [--attention sdpa|written]
    nanogpt.py step --data PREFIX --micro 8 --seq 256 --steps 15 --threads 1 [same model flags] [--bf16] [--compile]
The second trains the same model (same seed, so the same initial weights) in PyTorch eager with
AdamW on the same windows as bench/pytorch_step.py and prints "median_ms X" (steps 6 on).
"""
import argparse
import math
import statistics
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class CoreAttention(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                              is_causal=True)


class WrittenOutAttention(nn.Module):
    """nanoGPT's attention where torch has no flash attention (its `if not self.flash` branch)."""

    def __init__(self, dropout: float, block: int):
        super().__init__()
        self.attn_dropout = nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.size(2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        return att @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float, block: int, written_out: bool):
        super().__init__()
        self.n_head = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.core = WrittenOutAttention(dropout, block) if written_out else CoreAttention(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = self.core(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, d: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float, block: int, written_out: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, dropout, block, written_out)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, d: int, layers: int, heads: int, dropout: float, written_out: bool):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(d, heads, dropout, block, written_out) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(tokens) + self.wpe(position_ids))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(a) -> GPT:
    torch.manual_seed(1234)
    return GPT(a.vocab, a.block, a.d_model, a.layers, a.heads, a.dropout, a.attention == "written")


def step_times(a) -> float:
    torch.set_num_threads(a.threads)
    model = build(a)
    model.train()
    if a.compile:  # the model's forward and backward through Inductor, the optimizer eager
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    data = np.memmap(a.data + ".bin", dtype=np.uint16, mode="r")
    pos = torch.arange(a.seq).unsqueeze(0).expand(a.micro, a.seq)
    times = []
    for step in range(a.steps):
        w = np.stack([data[(step * a.micro + i) * a.seq:(step * a.micro + i) * a.seq + a.seq + 1]
                      for i in range(a.micro)]).astype(np.int64)
        w = torch.from_numpy(w)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            logits = model(w[:, :-1], pos)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[5:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["export", "step"])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=264)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--attention", choices=["sdpa", "written"], default="sdpa",
                    help="sdpa: F.scaled_dot_product_attention; written: nanoGPT's fallback, softmax(q k^T) v written out")
    ap.add_argument("--out")
    ap.add_argument("--data")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (Inductor)")
    a = ap.parse_args()
    if a.mode == "export":
        torch.jit.script(build(a)).save(a.out)
    else:
        print(f"median_ms {step_times(a):.1f}")


if __name__ == "__main__":
    main()
