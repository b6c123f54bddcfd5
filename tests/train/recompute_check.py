#!/usr/bin/env python3
"""Activation checkpointing under strategy 3 gathers each unit once in backward and holds no more.

    recompute_check.py MODEL.pt RUN_WITHOUT RUN_WITH --micro-batches K [--unkept RUN_UNKEPT]

Both runs train MODEL (strategy 3) identically but for activation_checkpointing. Checked from
their metrics.jsonl at every step:
  - unit_gathers (all-gathers of unit weights issued in the step): with checkpointing 2 x units x K,
    one gather per unit for forward, one for recompute and backward together; without it one fewer
    per micro-batch, (2 x units - 1) x K, as the forward's last unit stays gathered for its
    backward (its forward is recomputed inside checkpointing, so there it is freed and gathered
    again);
  - mem_gathered_peak (the most gathered unit-weight bytes held in the step) with checkpointing
    equals that without it, every step: the recompute keeps no other unit (one more would be a
    unit's bytes, 199936 B for gpt4). mem_fsdp_peak, which adds the gradients in flight, moves
    with when the progress thread finishes a reduction (CI once measured 0.58 of a unit between
    two identical schedules on a loaded machine), so it is printed, not compared.
With --unkept, RUN_UNKEPT is RUN_WITHOUT again under MFSDP_KEEP_LAST_UNIT=off (every unit freed after
its forward): 2 x units x K gathers, and the same mem_gathered_peak as RUN_WITHOUT, every step (keeping
the last unit for its backward costs no peak).
"""
import argparse
import json
import sys

import torch


def metrics(run):
    with open(f"{run}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("without")
    ap.add_argument("with_ac")
    ap.add_argument("--micro-batches", type=int, required=True)
    ap.add_argument("--unkept")
    a = ap.parse_args()
    m = torch.jit.load(a.model)
    units = [n for n, _ in m.named_children() if n == "blocks"]
    blocks = list(m.blocks.children()) if units else []
    if not blocks:
        sys.exit(f"{a.model}: no blocks")
    unit_bytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    want = 2 * len(blocks) * a.micro_batches
    want_plain = want - a.micro_batches
    plain, ac = metrics(a.without), metrics(a.with_ac)
    ok = len(plain) == len(ac) > 0
    for p, c in zip(plain, ac):
        if p["unit_gathers"] != want_plain or c["unit_gathers"] != want:
            print(f"step {p['step']}: unit gathers {p['unit_gathers']} without, {c['unit_gathers']} with "
                  f"checkpointing; expected {want_plain} and {want} ((2 x {len(blocks)} units - 1) x "
                  f"{a.micro_batches} micro-batches, and 2 x {len(blocks)} x {a.micro_batches})")
            ok = False
    for p, c in zip(plain, ac):
        if c["mem_gathered_peak"] != p["mem_gathered_peak"] or p["mem_gathered_peak"] <= 0:
            print(f"step {p['step']}: gathered weights peak {c['mem_gathered_peak']} B with checkpointing, "
                  f"{p['mem_gathered_peak']} B without (unit {unit_bytes} B)")
            ok = False
    if a.unkept:
        unkept = metrics(a.unkept)
        ok = ok and len(unkept) == len(plain)
        for p, u in zip(plain, unkept):
            if u["unit_gathers"] != want or u["mem_gathered_peak"] != p["mem_gathered_peak"]:
                print(f"step {p['step']}: every unit freed after its forward: {u['unit_gathers']} unit gathers "
                      f"(expected {want}), gathered weights peak {u['mem_gathered_peak']} B against "
                      f"{p['mem_gathered_peak']} B with the last unit kept")
                ok = False
    peak_plain, peak_ac = max(p["mem_fsdp_peak"] for p in plain), max(c["mem_fsdp_peak"] for c in ac)
    print(f"{len(ac)} steps: {want_plain} / {want} unit gathers per step expected; gathered weights peak "
          f"{ac[-1]['mem_gathered_peak']} B with, {plain[-1]['mem_gathered_peak']} B without checkpointing "
          f"(unit {unit_bytes} B); engine peak with gradients in flight {peak_ac} / {peak_plain} B: "
          f"{'OK' if ok else 'FAILED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
