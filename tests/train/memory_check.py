#!/usr/bin/env python3
"""Per-rank memory of a sharded run against the single-rank run of the same strategy.

    memory_check.py STRATEGY WORLD RUN_AT_1 RUN_AT_WORLD

What zero_dp_strategy promises (Megatron-FSDP): optimizer state divides by the world size for
strategies 1-3, gradients too for 2-3, weights too for 3, and the peak the engine holds drops;
no_shard divides nothing (optim keeps the full gradient buffer beside its shard). Ratios are read from step 2 of metrics.jsonl (rank 0's figures) and may
exceed 1/N only by padding (a bucket pads to a multiple of N elements).
"""
import json
import sys


def step2(run):
    with open(f"{run}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return rows[1]


def main():
    strategy, world = int(sys.argv[1]), int(sys.argv[2])
    one, many = step2(sys.argv[3]), step2(sys.argv[4])
    slack = 0.02  # padding: at most world-1 elements per bucket
    expect = {
        "mem_optimizer": strategy >= 1,
        "mem_grads": strategy >= 2,
        "mem_weights": strategy == 3,
    }
    failed = False
    for key, divides in expect.items():
        ratio = many[key] / one[key]
        ok = ratio <= 1 / world + slack if divides else ratio >= 0.5
        print(f"{key}: {one[key]} B at 1 rank, {many[key]} B at {world} ranks: ratio {ratio:.4f} "
              f"(expected {'<= %.4f' % (1 / world + slack) if divides else '>= 0.5 (not sharded)'}) {'OK' if ok else 'FAILED'}")
        failed |= not ok
    ratio = many["mem_fsdp_peak"] / one["mem_fsdp_peak"]
    ok = ratio < 0.9 if strategy >= 1 else ratio >= 0.99
    print(f"mem_fsdp_peak: {one['mem_fsdp_peak']} -> {many['mem_fsdp_peak']} B, ratio {ratio:.3f} {'OK' if ok else 'FAILED'}")
    failed |= not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
