#!/usr/bin/env python3
"""A step with non-finite gradients and check_for_nan_in_grad off is skipped, counted, logged.

    skip_check.py RUN_DIR --step S

RUN_DIR was trained with MFSDP_TEST_PLANT=nan_grad (step S's gradients are NaN): exactly step S
is marked skipped, skipped_total is 0 before S and 1 from S on, every loss is finite (the NaN never
reached the weights), and the learning rate does not advance over the skipped step.
"""
import argparse
import json
import math
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--step", type=int, required=True)
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(f"{a.run}/metrics.jsonl")]
    problems = []
    for r in rows:
        s = r["step"]
        if r.get("skipped", False) != (s == a.step):
            problems.append(f"step {s}: skipped={r.get('skipped', False)}")
        if r["skipped_total"] != (1 if s >= a.step else 0):
            problems.append(f"step {s}: skipped_total {r['skipped_total']}")
        if r["loss"] is None or not math.isfinite(r["loss"]):
            problems.append(f"step {s}: loss {r['loss']}")
    lr = {r["step"]: r["lr"] for r in rows}
    if lr.get(a.step + 1) != lr.get(a.step):
        problems.append(f"lr advanced over the skipped step: {lr.get(a.step)} -> {lr.get(a.step + 1)}")
    print("\n".join(problems) if problems else f"{len(rows)} steps: step {a.step} skipped and counted, losses finite")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
