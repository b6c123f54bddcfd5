#!/usr/bin/env python3
"""A run's memory must stop growing: peak RSS (metrics.jsonl, rank 0) may rise while allocators
warm up, but not between step FROM and the last step by more than MAX_MIB.

    leak_check.py RUN_DIR [--from 15] [--max-growth-mib 16]

(An autograd node that held its own output leaked ~33 MiB per step in the context-parallel
attention; this is the check that would have caught it.)
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--from", dest="start", type=int, default=15)
    ap.add_argument("--max-growth-mib", type=float, default=16)
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(f"{a.run}/metrics.jsonl")]
    if len(rows) <= a.start:
        sys.exit(f"{a.run}: only {len(rows)} steps, need more than {a.start}")
    first, last = rows[a.start - 1]["peak_mem_mib"], rows[-1]["peak_mem_mib"]
    growth = last - first
    print(f"{a.run}: peak RSS {first:.0f} MiB at step {a.start}, {last:.0f} MiB at step {rows[-1]['step']}: "
          f"growth {growth:.0f} MiB (allowed {a.max_growth_mib:g})")
    sys.exit(0 if growth <= a.max_growth_mib else 1)


if __name__ == "__main__":
    main()
