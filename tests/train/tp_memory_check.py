#!/usr/bin/env python3
"""Per-rank parameter bytes under tensor parallelism, against the model file itself.

    tp_memory_check.py MODEL.pt RUN_TP1 RUN_TP2

Both runs use zero_dp_strategy no_shard with one data-parallel rank, so the engine's weight bytes
are exactly the elements the rank holds (fp32). From the model and the plan stored in it (read
here with PyTorch, independently of mfsdp), the split parameters must take half their bytes at
tp=2 and the replicated ones all of theirs.
"""
import fnmatch
import json
import sys
import zipfile

import torch


def main():
    model_path, run1, run2 = sys.argv[1:4]
    with zipfile.ZipFile(model_path) as z:
        name = next(n for n in z.namelist() if n.endswith("extra/mfsdp/tp_plan.json"))
        plan = list(json.loads(z.read(name)).items())
    model = torch.jit.load(model_path)
    split, seen = 0, set()
    for path, mod in model.named_modules():
        style = next((s for g, s in plan if path and fnmatch.fnmatchcase(path, g)), None)
        if style is None:
            continue
        kind = style.split(":")[0]
        names = {"colwise": ["weight", "bias"], "colwise_rep": ["weight", "bias"], "rowwise": ["weight"],
                 "vocab_parallel": ["weight"]}.get(kind, [])
        for n, p in mod.named_parameters(recurse=False):
            if n in names and p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                split += p.numel()
    total = sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())

    def weights(run):
        with open(f"{run}/metrics.jsonl") as f:
            return json.loads(f.readline())["mem_weights"]

    w1, w2 = weights(run1), weights(run2)
    expect1, expect2 = 4 * total, 4 * (total - split // 2)
    print(f"{total} elements, {split} split by the plan: tp=1 holds {w1} B (expected {expect1}), "
          f"tp=2 holds {w2} B (expected {expect2}); split parameters per rank: "
          f"{(w2 - 4 * (total - split)) / (4 * split):.3f} of tp=1")
    sys.exit(0 if (w1, w2) == (expect1, expect2) else 1)


if __name__ == "__main__":
    main()
