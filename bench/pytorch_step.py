#!/usr/bin/python3
"""PyTorch's own step time for the model mfsdp trains, on the same data (the side-by-side
reference for bench/train_step.sh). One process, DDP (gloo) over --procs processes, or FSDP2
(fully_shard per block and at the root, gloo, --fsdp); eager or torch.compile (--compile: the
model's forward and backward through Inductor, the optimizer eager, as most users run it).

    .venv/bin/python bench/pytorch_step.py --arch gpt --data PREFIX --micro 8 --seq 128 --steps 25
Prints one line: "median_ms <x>" (median of the steps after the first 5: compilation happens in
the first step).
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import export_model  # noqa: E402


def windows(prefix, seq, count, offset):
    """seq+1-token windows from a Megatron .bin (uint16), consecutive, like an unshuffled sampler."""
    data = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
    out = np.stack([data[(offset + i) * seq:(offset + i) * seq + seq + 1] for i in range(count)]).astype(np.int64)
    return torch.from_numpy(out)


def worker(rank, a):
    torch.set_num_threads(a.threads)
    if a.procs > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=rank, world_size=a.procs)
    torch.manual_seed(1234)
    if a.jit:
        model = torch.jit.load(a.jit)  # the very file mfsdp trains
        model.train()
    elif a.hf:
        # The transformers model a file of scripts/export_hf.py was traced from, built in Python from
        # the config the file holds, with its initial weights (the oracle's loader): what an HF user
        # trains in PyTorch.
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "oracle"))
        import reference_trainer
        model = reference_trainer.load_reference_model(a.hf)[0]
        model.train()
    else:
        margs = export_model.argparse.Namespace(**{**vars(export_model_defaults()), "arch": a.arch,
                                                   **parse_kv(a.model_args)})
        model = export_model.build(margs)
    autocast = a.bf16
    if a.fsdp:
        # FSDP2 as torchtitan applies it: each block a unit, the root (embedding, head) the last;
        # bf16: parameters gathered in bf16, gradients reduced in fp32 (mfsdp's bf16 row).
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (a.procs,))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if a.bf16 \
            else MixedPrecisionPolicy()
        blocks = next(b for b in (getattr(model, "blocks", None), getattr(model, "layers", None),
                                  getattr(getattr(model, "model", None), "layers", None),
                                  getattr(getattr(model, "transformer", None), "h", None)) if b is not None)
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        autocast = False
    elif a.procs > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    if a.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    pos = torch.arange(a.seq).unsqueeze(0).expand(a.micro, a.seq)
    times = []
    for step in range(a.steps):
        ws = [windows(a.data, a.seq, a.micro, ((step * a.procs + rank) * a.accum + m) * a.micro) for m in range(a.accum)]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for m, w in enumerate(ws):
            # The usual accumulation loop: each micro-batch's mean loss over accum, DDP's all-reduce only
            # with the last micro-batch's backward (no_sync on the others).
            sync = a.procs > 1 and not a.fsdp and m < a.accum - 1
            with model.no_sync() if sync else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    logits = model(w[:, :-1], pos)
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                         w[:, 1:].reshape(-1))
                (loss / a.accum if a.accum > 1 else loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(f"median_ms {1000 * statistics.median(times[5:]):.1f}")
    if a.procs > 1:
        dist.destroy_process_group()


def export_model_defaults():
    ap = argparse.Namespace(arch="gpt", layers=4, d_model=256, heads=4, kv_heads=0, ffn_hidden=0, vocab=264,
                            max_seq=128, rope_theta=10000.0, untied=False, tied=False, nested=False,
                            rope_buffer=False)
    return ap


def parse_kv(s):
    out = {}
    for item in s.split():
        k, v = item.split("=")
        out[k] = int(v) if v.isdigit() else v
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    ap.add_argument("--model-args", default="")
    ap.add_argument("--data", required=True)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--accum", type=int, default=1,
                    help="micro-batches per step (gradient accumulation; DDP skips its all-reduce on all but the last)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (Inductor)")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) over --procs processes instead of DDP")
    ap.add_argument("--jit", help="train this TorchScript file instead of the eager model")
    ap.add_argument("--hf", help="train the transformers model of this scripts/export_hf.py file (Python, not its trace)")
    a = ap.parse_args()
    if a.procs > 1:
        mp.spawn(worker, args=(a,), nprocs=a.procs)
    else:
        worker(0, a)


if __name__ == "__main__":
    main()
