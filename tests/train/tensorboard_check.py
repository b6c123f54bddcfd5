#!/usr/bin/env python3
"""A run's TensorBoard events, read back by TensorBoard's own reader, against its metrics.jsonl.

    tensorboard_check.py RUN_DIR

Every metrics.jsonl step must appear in the events with each scalar equal to the JSON value at
float32 precision (TensorBoard stores simple_value as a 32-bit float: relative 1e-6), and the
events must hold no step that metrics.jsonl does not. Exits 1 naming the first difference.
"""
import glob
import json
import math
import sys

from tensorboard.backend.event_processing import event_accumulator

TAGS = {
    "train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm", "train/tokens_per_s": "tokens_per_s",
    "train/tflops_per_rank": "tflops_per_rank", "train/mfu": "mfu", "train/step_time_s": "step_time_s",
    "train/skipped_total": "skipped_total", "train/data_wait_s": "data_wait_s", "memory/peak_rss_mib": "peak_mem_mib",
    "memory/fsdp_peak_bytes": "mem_fsdp_peak", "memory/gathered_peak_bytes": "mem_gathered_peak",
    "valid/loss": "val_loss",
}


def main():
    run = sys.argv[1]
    files = glob.glob(f"{run}/tensorboard/events.out.tfevents.*")
    if not files:
        print(f"no event file in {run}/tensorboard")
        return 1
    acc = event_accumulator.EventAccumulator(f"{run}/tensorboard", size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    have = set(acc.Tags()["scalars"])
    rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    checked = 0
    for tag, key in TAGS.items():
        want = {r["step"]: r[key] for r in rows if r.get(key) is not None and math.isfinite(r[key])}
        if not want:
            continue
        if tag not in have:
            print(f"tag {tag} missing from the events (have {sorted(have)})")
            return 1
        got = {e.step: e.value for e in acc.Scalars(tag)}
        if set(got) != set(want):
            print(f"{tag}: steps {sorted(set(got) ^ set(want))[:10]} are in one of events / metrics.jsonl only")
            return 1
        for step, x in want.items():
            if abs(got[step] - x) > 1e-6 * max(abs(x), 1e-30):
                print(f"{tag} step {step}: events {got[step]!r}, metrics.jsonl {x!r}")
                return 1
            checked += 1
    print(f"{run}: {len(files)} event file(s), {checked} scalars over {len(rows)} steps equal to metrics.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
