#!/usr/bin/env python3
"""The embedding and the output head as units of their own lower the engine's peak under strategy 3.

    outer_units_check.py RUN_AUTO RUN_LAYERS --layers L --micro-batches K --head-bytes B

RUN_AUTO trains with the automatic units (L layers, the embedding table and the untied head),
RUN_LAYERS the same model with the layers alone as units (the embedding and head then sit with the
parameters outside units, gathered for the whole step). Checked from their metrics.jsonl:
  - unit_gathers, every step: (2 x (L + 2) - 1) x K with the automatic units (each unit gathered
    for its forward and again for its backward, every micro-batch, but the last of the forward, the
    head, which stays gathered for its backward), (2 x L - 1) x K with the layers alone;
  - the highest mem_fsdp_peak (gathered weights and full-size gradients the engine held) of the
    automatic units is below that of the layers alone by at least B, the bytes of the head's weight
    (the layers-only run holds the embedding and head, weights and full gradients, for the whole
    backward; the automatic units hold one of them at a time).
"""
import argparse
import json
import sys


def metrics(run):
    with open(f"{run}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("auto")
    ap.add_argument("layers_only")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--micro-batches", type=int, required=True)
    ap.add_argument("--head-bytes", type=int, required=True)
    a = ap.parse_args()
    auto, layers = metrics(a.auto), metrics(a.layers_only)
    ok = len(auto) == len(layers) > 0
    want_auto, want_layers = (2 * (a.layers + 2) - 1) * a.micro_batches, (2 * a.layers - 1) * a.micro_batches
    for x, y in zip(auto, layers):
        if x["unit_gathers"] != want_auto or y["unit_gathers"] != want_layers:
            print(f"step {x['step']}: unit gathers {x['unit_gathers']} (automatic units) and {y['unit_gathers']} "
                  f"(layers only); expected {want_auto} and {want_layers}")
            ok = False
    peak_auto, peak_layers = max(x["mem_fsdp_peak"] for x in auto), max(y["mem_fsdp_peak"] for y in layers)
    if peak_layers - peak_auto < a.head_bytes:
        print(f"engine peak {peak_auto} B with the automatic units, not {a.head_bytes} B (a head) below "
              f"{peak_layers} B with the layers alone")
        ok = False
    print(f"{len(auto)} steps: unit gathers {want_auto} / {want_layers} per step expected; highest engine peak "
          f"{peak_auto} B (automatic units) against {peak_layers} B (layers alone): {'OK' if ok else 'FAILED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
