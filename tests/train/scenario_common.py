"""What the scenario scripts share: their command line and a way to fail with a reason."""
import argparse
import os
import random
import sys
import time


def fail(msg):
    print("FAILED:", msg)
    sys.exit(1)


def scenario_main(namespace, prefix, extra_args=()):
    """Parses SCENARIO --bin --fx --mpirun [--src] [--trials], runs namespace['scenario_' + SCENARIO]."""
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--bin", required=True)
    ap.add_argument("--fx", required=True)
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--src", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    ap.add_argument("--trials", type=int, default=3)  # CI; more by hand: --trials 50
    args = ap.parse_args()
    args.work = f"{args.fx}/{prefix}_{args.scenario}"
    os.makedirs(args.work, exist_ok=True)
    random.seed(int(time.time()))
    namespace["A"] = args
    namespace[f"scenario_{args.scenario}"]()
    print(f"{args.scenario}: OK")
