#!/usr/bin/env python3
"""Compare the per-step losses of runs (metrics.jsonl) against a reference run.

    compare_metrics.py REF_RUN_DIR RUN_DIR... [--rtol 1e-5] [--key loss] [--steps N]
    compare_metrics.py RUN_DIR --falls-below X     # the last loss must be below X
    compare_metrics.py REF RUN --expect-differ --rtol 1e-5   # a test that the comparison can fail

Exits 1 with the worst step named when a run differs by more than rtol (relative) at any step,
has a different number of steps, or is missing. With --expect-differ the verdict is inverted for
the comparison alone: exit 0 only when every run was read, has the reference's steps, and differs
by more than rtol; a missing file or any other error still fails (exit 2), so a crash never
passes for the expected difference.
"""
import argparse
import json
import math
import sys


def losses(run_dir, key, after=0):
    out = {}
    with open(f"{run_dir}/metrics.jsonl") as f:
        for line in f:
            m = json.loads(line)
            if m.get(key) is not None and m["step"] > after:
                out[m["step"]] = m[key]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--key", default="loss")
    ap.add_argument("--steps", type=int, default=0, help="expected number of steps (0: any)")
    ap.add_argument("--falls-below", type=float, default=None)
    ap.add_argument("--after", type=int, default=0, help="compare only steps after this one (resumed runs)")
    ap.add_argument("--expect-differ", action="store_true",
                    help="pass only when every run differs by more than rtol (and was read completely)")
    a = ap.parse_args()
    try:
        sys.exit(compare(a))
    except SystemExit:
        raise
    except Exception as e:  # a missing or malformed file: never the expected difference
        print(f"compare_metrics.py: error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)


def compare(a):
    ref = losses(a.runs[0], a.key, a.after)
    if not ref:
        print(f"{a.runs[0]}: no '{a.key}' values", file=sys.stderr)
        return 2
    if a.steps and len(ref) != a.steps - a.after:
        print(f"{a.runs[0]}: {len(ref)} steps, expected {a.steps}", file=sys.stderr)
        return 2
    if a.falls_below is not None:
        last = ref[max(ref)]
        first = ref[min(ref)]
        print(f"{a.runs[0]}: {a.key} {first:.4f} at step {min(ref)} -> {last:.4f} at step {max(ref)}")
        if not last < a.falls_below:
            sys.exit(f"{a.runs[0]}: final {a.key} {last:.4f} is not below {a.falls_below}")
    failed = False
    differs = []
    for run in a.runs[1:]:
        other = losses(run, a.key, a.after)
        if sorted(other) != sorted(ref):
            print(f"{run}: steps {sorted(other)[:3]}... differ from the reference's {sorted(ref)[:3]}...")
            if a.expect_differ:
                return 2  # not comparable: not the difference the test looks for
            failed = True
            continue
        worst, worst_step = 0.0, None
        for s in ref:
            r, o = ref[s], other[s]
            rel = abs(o - r) / max(abs(r), 1e-12) if math.isfinite(o) else math.inf
            if rel > worst:
                worst, worst_step = rel, s
        ok = worst <= a.rtol
        print(f"{run}: {len(ref)} steps, max relative {a.key} difference {worst:.2e}"
              f"{f' at step {worst_step}' if worst_step else ''} ({'OK' if ok else 'FAILED'}, tolerance {a.rtol:g})")
        failed |= not ok
        differs.append(not ok)
    if a.expect_differ:
        verdict = bool(differs) and all(differs)
        print(f"expected a difference beyond {a.rtol:g}: {'found' if verdict else 'NOT found'}")
        return 0 if verdict else 1
    return 1 if failed else 0


if __name__ == "__main__":
    main()
