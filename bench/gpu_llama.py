#!/usr/bin/env python3
"""The GPU benchmark (issue 13; run by scripts/gpu/check.sh on the GPU machine): a ~1B-parameter
Llama in bf16 with SDPA attention, one GPU, mfsdp against PyTorch eager in the same run.

    bench/gpu_llama.py --bin MFSDP --work DIR --results results_gpu.md [--metrics m.jsonl] [--steps 12]

1. Exports the model with scripts/export_model.py (bf16 weights in the file, SDPA core) and writes
   random tokens as an llm.c token file (the step's cost does not depend on the token values).
2. mfsdp: `mfsdp train` on one rank, training.device cuda (NCCL), compute bf16 with fp32 main
   weights (preserve_fp32_weights), AdamW, clipping 1.0, no_shard (one rank: nothing to shard) and
   optim_grads_params; the bf16 GEMM peak is measured by mfsdp itself at start-up.
3. PyTorch eager: the same model class (export_model.build, same arguments and seed) in this
   process, fp32 parameters under torch.autocast(bf16) (PyTorch's mixed precision: bf16 compute,
   fp32 weights), torch.optim.AdamW(fused=True), clip_grad_norm_, the same batch shape.
4. The bf16 GEMM peak (8192^3) measured here too; MFU = (6 N_dense + 6 L T d) x tokens/s / peak,
   mfsdp's own formula (README "Metrics"), for both rows.
Step times are medians over the steps after the first 4 (warm-up, the TorchScript profiling runs).
"""
import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import export_model  # noqa: E402


def model_args(a):
    return argparse.Namespace(arch="llama", layers=a.layers, d_model=a.d_model, heads=a.heads, kv_heads=a.kv_heads,
                              ffn_hidden=a.ffn, vocab=a.vocab, rope_theta=10000.0, tied=False, rope_buffer=False)


def flops_per_token(n_dense, a):
    return 6.0 * n_dense + 6.0 * a.layers * a.seq * a.d_model


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def gemm_peak(device):
    n = 8192 if device == "cuda" else 512
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(n, n, device=device, dtype=dt)
    y = torch.randn(n, n, device=device, dtype=dt)
    for _ in range(3):
        x @ y
    sync(device)
    iters, t = 0, time.time()
    while time.time() - t < 0.5:
        for _ in range(10):
            x @ y
        sync(device)
        iters += 10
    return 2.0 * n ** 3 * iters / (time.time() - t) / 1e12


def write_tokens(path, count, vocab, seed=0):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, count
    toks = np.random.default_rng(seed).integers(0, vocab, size=count, dtype=np.uint16)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(toks.tobytes())


# mfsdp's fused ops (RMSNorm's scaling, SwiGLU's gate, rotary: DESIGN.md section 11) switched off:
# the same graphs through ATen's ops, the A/B of those kernels.
ATEN_OPS = {"MFSDP_FAST_RMSNORM": "off", "MFSDP_FAST_SWIGLU": "off", "MFSDP_FAST_ROTARY": "off"}


def run_mfsdp(a, strategy, log, variant=""):
    run = f"{a.work}/run_s{strategy}{'_' + variant if variant else ''}"
    # variant "profile": steps 6-7 under PyTorch's profiler (README "Profiling"), a run of its own so
    # that the profiler's cost stays out of the timed rows.
    steps = 7 if variant == "profile" else a.steps
    profiling = "profiling: {enabled: true, start_step: 6, end_step: 7, trace: false, top: 40}\n" if variant == "profile" else ""
    cfg = f"""run_dir: {run}
model: {{path: {a.work}/llama1b.pt, compute_dtype: {"bf16" if a.device == "cuda" else "fp32"}}}
distributed: {{zero_dp_strategy: {strategy}, preserve_fp32_weights: true, backend: {"nccl" if a.device == "cuda" else "auto"}}}
data: {{train: {a.work}/tokens.bin, format: llmc}}
training: {{max_steps: {steps}, global_batch_size: {a.micro}, micro_batch_size: {a.micro}, seq_length: {a.seq},
           log_every: 1, clip_grad: 1.0, device: {a.device}}}
optimizer: {{name: adamw, lr: 1.0e-4, weight_decay: 0.01, betas: [0.9, 0.95]}}
lr_scheduler: {{name: constant, warmup_steps: 2}}
logging: {{progress: 'off'}}
""" + profiling
    yaml_path = f"{a.work}/s{strategy}{'_' + variant if variant else ''}.yaml"
    with open(yaml_path, "w") as f:
        f.write(cfg)
    cmd = ["mpirun", "--allow-run-as-root", "--bind-to", "none", "-np", "1", a.bin, "train", "-c", yaml_path]
    t = time.time()
    env = dict(os.environ, MFSDP_JIT_FUSER="off", **(ATEN_OPS if variant == "aten_ops" else {}))
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=a.timeout, env=env)
    except subprocess.TimeoutExpired as e:
        log.write(f"$ {' '.join(cmd)}\ntimed out after {a.timeout}s\n{e.stdout or ''}\n")
        return None
    log.write(f"$ {' '.join(cmd)}\n{p.stdout}[rc {p.returncode}, {time.time() - t:.1f}s]\n")
    if p.returncode != 0:
        return None
    rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    peak, kernels = None, ""
    for line in p.stdout.splitlines():
        if "MFU against a measured peak of" in line:
            peak = float(line.split("peak of")[1].split()[0])
        if "mfsdp's GPU kernels" in line or "mfsdp's CPU kernels" in line:
            kernels = line[line.index("mfsdp's"):]
    steady = rows[4:] or rows
    return {"step_s": statistics.median(r["step_time_s"] for r in steady),
            "mfu": statistics.median(r["mfu"] for r in steady), "mem": max(r.get("device_mem_peak", 0) for r in rows),
            "peak": peak, "loss": [r["loss"] for r in rows], "rows": rows, "kernels": kernels}


def run_eager(a):
    torch.manual_seed(1234)
    export_model.ATTENTION = "sdpa"
    dev = a.device
    model = export_model.build(model_args(a)).to(dev).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), fused=dev == "cuda")
    data = np.memmap(f"{a.work}/tokens.bin", dtype=np.uint16, mode="r", offset=1024)
    pos = torch.arange(a.seq, device=dev).unsqueeze(0).expand(a.micro, a.seq).contiguous()
    times = []
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(a.steps):
        w = np.stack([data[(step * a.micro + i) * a.seq:(step * a.micro + i) * a.seq + a.seq + 1]
                      for i in range(a.micro)]).astype(np.int64)
        batch = torch.from_numpy(w)
        batch = batch.pin_memory().to(dev, non_blocking=True) if dev == "cuda" else batch
        sync(dev)
        t = time.time()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev == "cuda"):
            logits = model(batch[:, :-1], pos)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = loss.item()  # mfsdp reads its loss every step too
        sync(dev)
        times.append(time.time() - t)
    del loss_v
    mem = torch.cuda.max_memory_allocated() if dev == "cuda" else 0
    del model, opt
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times[4:] or times), "mem": mem}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--metrics", default="")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=90)
    ap.add_argument("--profile", default="", help="also profile mfsdp s0's steps 6-7 (a run of its own); the summary into this file")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script (fp32, small --layers/--d-model)")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    log = sys.stdout
    t0 = time.time()
    exp = [sys.executable, os.path.join(ROOT, "scripts", "export_model.py"), "--arch", "llama", "--layers", str(a.layers),
           "--d-model", str(a.d_model), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--ffn-hidden", str(a.ffn),
           "--vocab", str(a.vocab), "--attention", "sdpa", "--dtype", "bf16" if a.device == "cuda" else "fp32",
           "--out", f"{a.work}/llama1b.pt"]
    subprocess.run(exp, check=True)
    write_tokens(f"{a.work}/tokens.bin", (a.steps + 2) * a.micro * (a.seq + 1) * 4, a.vocab)
    print(f"[bench] export + data {time.time() - t0:.0f}s", flush=True)
    m = export_model.build(model_args(a))
    n_all = sum(p.numel() for p in m.parameters())
    n_emb = sum(p.numel() for mod in m.modules() if isinstance(mod, torch.nn.Embedding) for p in mod.parameters())
    del m
    fpt = flops_per_token(n_all - n_emb, a)
    tokens = a.micro * a.seq
    peak = gemm_peak(a.device)
    print(f"[bench] {'bf16' if a.device == 'cuda' else 'fp32'} GEMM peak {peak:.3f} TFLOP/s", flush=True)
    res = {}
    for key, s, variant in (("mfsdp s0", 0, ""), ("mfsdp s3", 3, ""), ("mfsdp s0 aten", 0, "aten_ops")):
        res[key] = run_mfsdp(a, s, log, variant)
        print(f"[bench] {key}: {res[key] and res[key]['step_s']}", flush=True)
    res["eager"] = run_eager(a)
    print(f"[bench] eager: {res['eager']['step_s']}", flush=True)
    if a.profile:
        prof = run_mfsdp(a, 0, log, "profile")
        src = f"{a.work}/run_s0_profile/profile/rank0_steps6-7.txt"
        if prof and os.path.exists(src):
            shutil.copy(src, a.profile)
        print(f"[bench] profile of mfsdp s0, steps 6-7: {a.profile if prof and os.path.exists(src) else 'failed (bench.log)'}",
              flush=True)
    if a.metrics and res.get("mfsdp s0"):
        with open(a.metrics, "w") as f:
            for r in res["mfsdp s0"]["rows"]:
                f.write(json.dumps(r) + "\n")
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else "CPU (dry run: not a GPU figure)"
    with open(a.results, "w") as f:
        f.write(f"# GPU benchmark: ~1B Llama, bf16, one {gpu}\n\n")
        f.write(f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `bash scripts/gpu/check.sh RESULTS` "
                f"(bench/gpu_llama.py), torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if a.device == 'cuda' else '-'}.\n\n")
        f.write(f"Model: Llama, {a.layers} layers, d_model {a.d_model}, {a.heads} heads ({a.kv_heads} KV), MLP {a.ffn}, "
                f"vocab {a.vocab}: {n_all / 1e9:.3f} B parameters ({(n_all - n_emb) / 1e9:.3f} B outside embeddings); "
                f"SDPA attention; sequence {a.seq}, micro-batch {a.micro} ({tokens} tokens per step); AdamW, clip 1.0; "
                f"medians over steps 5-{a.steps}.\n\n")
        f.write(f"{'bf16 GEMM (8192^3)' if a.device == 'cuda' else 'fp32 GEMM (512^3)'} peak measured in this run: **{peak:.1f} TFLOP/s**; MFU = "
                f"{fpt / 1e9:.2f} GFLOP/token x tokens/s / peak.\n\n")
        f.write("| run | step (ms) | tokens/s | TFLOP/s | MFU | peak GPU memory (GiB) | step vs PyTorch eager |\n")
        f.write("|---|---:|---:|---:|---:|---:|---:|\n")
        eager = res["eager"]["step_s"]
        comm = "NCCL" if a.device == "cuda" else "CPU, MPI"
        eager_label = "PyTorch 2.11 eager, autocast bf16, fused AdamW" if a.device == "cuda" else "PyTorch 2.11 eager, fp32"
        for name, label in (("mfsdp s0", f"mfsdp, no_shard (1 rank, {comm})"),
                            ("mfsdp s3", f"mfsdp, optim_grads_params (1 rank, {comm})"),
                            ("mfsdp s0 aten", "mfsdp, no_shard, fused ops off (ATen's RMSNorm, SwiGLU, rotary)"),
                            ("eager", eager_label)):
            r = res.get(name)
            if not r:
                f.write(f"| {label} | failed (bench.log) | | | | | |\n")
                continue
            tps = tokens / r["step_s"]
            tf = fpt * tps / 1e12
            f.write(f"| {label} | {r['step_s'] * 1e3:.1f} | {tps:,.0f} | {tf:.0f} | {tf / peak:.1%} | "
                    f"{r['mem'] / 2 ** 30:.1f} | {r['step_s'] / eager:.2f}x |\n")
        for name in ("mfsdp s0", "mfsdp s3"):
            r = res.get(name)
            if r and r["peak"]:
                f.write(f"\n{name}: mfsdp's own measured peak {r['peak']:.1f} TFLOP/s, its logged MFU {r['mfu']:.1%}; "
                        f"losses {r['loss'][0]:.3f} -> {r['loss'][-1]:.3f}.")
        if res.get("mfsdp s0") and res["mfsdp s0"]["kernels"]:
            f.write(f"\n\nmfsdp s0's log: {res['mfsdp s0']['kernels']}")
        f.write("\n")
    print(open(a.results).read())
    return 0 if res.get("mfsdp s0") and res.get("mfsdp s3") else 1


if __name__ == "__main__":
    sys.exit(main())
