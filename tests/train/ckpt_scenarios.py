#!/usr/bin/env python3
"""Checkpoint scenarios, run as users run mfsdp. Each exits non-zero with a reason on failure.

    ckpt_scenarios.py SCENARIO --bin MFSDP --fx FIXTURE_DIR --mpirun "mpirun --oversubscribe ..."

Scenarios: exact, reshard, tp, cp, kill, corrupt, diskfull, export, preempt, async, retention, frozen.
"""
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time

from scenario_common import fail, scenario_main

A = None  # the parsed command line, set by scenario_main


def cmd(np_, run_dir, *overrides, limit_kib=None):
    # A file-size limit stands in for a full disk. It goes on the ranks only: mpirun's own PMIx
    # store stops working under it.
    rank = [A.bin] if not limit_kib else ["bash", "-c", f'ulimit -f {limit_kib}; exec "$@"', "_", A.bin]
    return shlex.split(A.mpirun) + ["-np", str(np_), *rank, "train", "-c", f"{A.fx}/base.yaml",
                                    f"run_dir={run_dir}", *overrides]


def run(np_, run_dir, *overrides, expect=0, limit_kib=None):
    p = subprocess.run(cmd(np_, run_dir, *overrides, limit_kib=limit_kib), capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    if p.returncode != expect:
        print(out[-3000:])
        fail(f"exit status {p.returncode}, expected {expect}: {' '.join(overrides)}")
    return out


def losses(run_dir, after=0):
    out = {}
    with open(f"{run_dir}/metrics.jsonl") as f:
        for line in f:
            m = json.loads(line)
            if m["step"] > after:
                out[m["step"]] = m["loss"]
    return out


def same(ref, other, after=0, rtol=0.0, what=""):
    a, b = losses(ref, after), losses(other, after)
    if sorted(a) != sorted(b):
        fail(f"{what}: steps {sorted(b)} differ from {sorted(a)}")
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    print(f"{what}: steps {min(a)}..{max(a)}, max relative difference {worst:.2e} (tolerance {rtol:g})")
    if worst > rtol:
        fail(f"{what}: losses differ by {worst:.2e}")


def fresh(path):
    shutil.rmtree(path, ignore_errors=True)
    return path


def reference(name, np_, strategy, steps=20, every=5, extra=()):
    """An uninterrupted run that saves every `every` steps into W/name.ckpt."""
    rd, ck = fresh(f"{A.work}/{name}"), fresh(f"{A.work}/{name}.ckpt")
    run(np_, rd, f"distributed.zero_dp_strategy={strategy}", f"checkpoint.dir={ck}", f"checkpoint.save_every={every}",
        "checkpoint.keep_last=0", f"training.max_steps={steps}", *extra)
    return rd, ck


def scenario_exact():
    for strategy, np_ in ((3, 2), (1, 4), (0, 2)):
        rd, ck = reference(f"exact_s{strategy}", np_, strategy)
        r2 = fresh(f"{A.work}/exact_s{strategy}_resumed")
        out = run(np_, r2, f"distributed.zero_dp_strategy={strategy}", f"checkpoint.resume={ck}/step_00000010")
        if "resumed from" not in out:
            fail("no 'resumed from' line")
        same(rd, r2, after=10, rtol=0.0, what=f"resume at step 10, strategy {strategy}, {np_} ranks (bit-exact)")


def scenario_reshard():
    # 4 ranks strategy 3 -> 2 ranks strategy 1 -> 1 rank no_shard, and bucketing changed on the way.
    rd, ck = reference("reshard_a", 4, 3)
    b, bck = fresh(f"{A.work}/reshard_b"), fresh(f"{A.work}/reshard_b.ckpt")
    run(2, b, "distributed.zero_dp_strategy=1", f"checkpoint.resume={ck}/step_00000005", f"checkpoint.dir={bck}",
        "checkpoint.save_every=5", "distributed.disable_bucketing=true")
    c = fresh(f"{A.work}/reshard_c")
    run(1, c, "distributed.zero_dp_strategy=0", f"checkpoint.resume={bck}/step_00000010")
    same(rd, b, after=5, rtol=1e-5, what="4 ranks strategy 3 -> 2 ranks strategy 1 (unbucketed)")
    same(rd, c, after=10, rtol=1e-5, what="-> 1 rank no_shard")


def scenario_kill():
    ref, _ = reference("kill_ref", 2, 3, steps=150, every=3)
    for trial in range(A.trials):
        rd, ck = fresh(f"{A.work}/kill_{trial}"), fresh(f"{A.work}/kill_{trial}.ckpt")
        args = cmd(2, rd, "distributed.zero_dp_strategy=3", f"checkpoint.dir={ck}", "checkpoint.save_every=3",
                   "checkpoint.keep_last=2", "training.max_steps=150")
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(random.uniform(1.0, 3.0))
        subprocess.run(["pkill", "-9", "-f", f"run_dir={rd}"])  # every rank, mid-step or mid-save
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        latest = None
        if os.path.exists(f"{ck}/latest"):
            latest = open(f"{ck}/latest").read().strip()
            chk = subprocess.run([A.bin, "inspect", f"{ck}/{latest}"], capture_output=True, text=True)
            if chk.returncode != 0:
                print(chk.stdout)
                fail(f"trial {trial}: latest ({latest}) is not a complete, verified checkpoint")
        out = run(2, rd, "distributed.zero_dp_strategy=3", f"checkpoint.dir={ck}", "checkpoint.save_every=3",
                  "checkpoint.keep_last=2", "training.max_steps=150")
        resumed = "resumed from" in out
        print(f"trial {trial}: killed with latest={latest}; {'resumed' if resumed else 'started fresh'}")
        if latest and not resumed:
            fail(f"trial {trial}: a complete checkpoint existed but the run did not resume")
        same(ref, rd, rtol=0.0, what=f"trial {trial}: all 150 steps vs the uninterrupted run")


def scenario_corrupt():
    rd, ck = reference("corrupt", 2, 3, steps=10)
    for what, damage, message in (
            ("flipped byte", "flip", "checksum mismatch"),
            ("truncated file", "truncate", "truncated or replaced"),
            ("missing file", "delete", "missing from the checkpoint")):
        bad = fresh(f"{A.work}/corrupt_{damage}")
        shutil.copytree(f"{ck}/step_00000010", bad)
        victim = f"{bad}/rank_00001.safetensors"
        if damage == "flip":
            with open(victim, "r+b") as f:
                size = os.path.getsize(victim)
                pos = random.randrange(size // 2, size)
                f.seek(pos)
                byte = f.read(1)
                f.seek(pos)
                f.write(bytes([byte[0] ^ 0x40]))
        elif damage == "truncate":
            os.truncate(victim, os.path.getsize(victim) - 100)
        else:
            os.remove(victim)
        out = run(2, f"{A.work}/corrupt_run", "distributed.zero_dp_strategy=3", f"checkpoint.resume={bad}", expect=2)
        if message not in out or "rank_00001.safetensors" not in out:
            print(out[-2000:])
            fail(f"{what}: the error does not say '{message}' naming the file")
        chk = subprocess.run([A.bin, "inspect", bad], capture_output=True, text=True)
        if chk.returncode == 0:
            fail(f"{what}: inspect did not report it")
        print(f"{what}: detected before training ({message})")
    # A damaged index.json: each is one clear error naming the key, from resume, inspect and export
    # alike (never an internal error or a read past a tensor's end).
    def mangle_end(j):
        name = sorted(j["params"])[0]
        p = j["params"][name]
        n = 1
        for d in p["shape"]:
            n *= d
        p["pieces"][0]["end"] = n + 1
        return f'params["{name}"].pieces[0].end'

    def mangle_file(j):
        name = sorted(j["params"])[1]
        j["params"][name]["pieces"][0]["file"] = "../rank_00001.safetensors"
        return f'params["{name}"].pieces[0].file'

    def mangle_step(j):
        j["trainer"]["step"] = 10.5
        return "trainer.step"

    def mangle_pieces(j):
        name = sorted(j["params"])[2]
        del j["params"][name]["pieces"]
        return f'params["{name}"].pieces'

    for i, mangle in enumerate((mangle_end, mangle_file, mangle_step, mangle_pieces)):
        bad = fresh(f"{A.work}/corrupt_index_{i}")
        shutil.copytree(f"{ck}/step_00000010", bad)
        with open(f"{bad}/index.json") as f:
            j = json.load(f)
        key = mangle(j)
        with open(f"{bad}/index.json", "w") as f:
            json.dump(j, f)
        checks = [("inspect", [A.bin, "inspect", bad]),
                  ("export", [A.bin, "export", "--checkpoint", bad, "--out", f"{bad}.safetensors"])]
        if i == 0:
            checks.append(("resume", cmd(2, f"{A.work}/corrupt_run", "distributed.zero_dp_strategy=3",
                                         f"checkpoint.resume={bad}")))
        for what, argv in checks:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            out = p.stdout + p.stderr
            if p.returncode != 2 or f"{bad}/index.json: corrupt checkpoint index: {key}" not in out or "internal" in out:
                print(out[-2000:])
                fail(f"{mangle.__name__}: {what} exited {p.returncode} without naming {key}")
            if os.path.exists(f"{bad}.safetensors"):
                fail(f"{mangle.__name__}: export left {bad}.safetensors behind")
        print(f"index.json with a bad {key}: one error naming it ({', '.join(c[0] for c in checks)})")
    out = run(1, f"{A.work}/corrupt_run", f"model.path={A.fx}/gpt_untied.pt", f"checkpoint.resume={ck}/step_00000010",
              expect=2)
    if "belongs to another model" not in out:
        fail("an index from another model was not rejected")
    print("a checkpoint of another model: rejected")


def scenario_diskfull():
    rd, ck = fresh(f"{A.work}/full"), fresh(f"{A.work}/full.ckpt")
    common = ("distributed.zero_dp_strategy=3", f"checkpoint.dir={ck}", "checkpoint.save_every=2")
    run(2, rd, *common, "training.max_steps=4")
    out = run(2, rd, *common, "training.max_steps=6", expect=2, limit_kib=400)
    if "not written (the previous one is untouched)" not in out:
        print(out[-2000:])
        fail("a failed save did not say so")
    left = sorted(os.listdir(ck))
    if left != ["latest", "step_00000002", "step_00000004"] or open(f"{ck}/latest").read().strip() != "step_00000004":
        fail(f"after the failed save the checkpoint directory holds {left}")
    if subprocess.run([A.bin, "inspect", f"{ck}/step_00000004"], capture_output=True).returncode != 0:
        fail("the previous checkpoint was damaged")
    print(f"full disk during save: error reported, {left} left, previous checkpoint verified")


def scenario_export():
    rd, ck = reference("export", 2, 3, steps=10)
    check_export(f"{ck}/step_00000010", "export")


def check_export(step_dir, name):
    """Exports a checkpoint both ways and checks the safetensors in PyTorch against the TorchScript."""
    st, ts = f"{A.work}/{name}.safetensors", f"{A.work}/{name}.pt"
    for fmt, out in (("safetensors", st), ("torchscript", ts)):
        p = subprocess.run([A.bin, "export", "--checkpoint", step_dir, "--out", out, "--format", fmt],
                           capture_output=True, text=True)
        if p.returncode != 0:
            print(p.stdout + p.stderr)
            fail(f"export --format {fmt} failed")
    check = f"""
import json, struct, sys, torch
sys.path.insert(0, {A.src!r} + "/scripts")
import export_model
raw = open({st!r}, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
state = {{}}
for name, e in header.items():
    if name == "__metadata__":
        continue
    b, end = e["data_offsets"]
    assert e["dtype"] == "F32", e
    state[name] = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + end]), dtype=torch.float32).view(e["shape"])
args = export_model.argparse.Namespace(arch="gpt", layers=2, d_model=64, heads=4, kv_heads=0, ffn_hidden=0, vocab=264,
                                       max_seq=64, rope_theta=10000.0, untied=False, tied=False, nested=False,
                                       rope_buffer=False)
torch.manual_seed(0)
model = export_model.build(args).eval()
model.load_state_dict(state, strict=True)
ts = torch.jit.load({ts!r}).eval()
tokens = torch.randint(0, 264, (2, 32)); pos = torch.arange(32).unsqueeze(0).expand(2, 32)
a, b = model(tokens, pos), ts(tokens, pos)
err = (a - b).abs().max().item()
init = torch.jit.load({A.fx!r} + "/gpt.pt").eval()(tokens, pos)
moved = (a - init).abs().max().item()
print(f"PyTorch module with the exported safetensors vs the exported TorchScript: max |logit diff| {{err:.2e}}; "
      f"vs the untrained model {{moved:.2e}}")
sys.exit(0 if err < 1e-5 and moved > 1e-3 else 1)
"""
    p = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    print(p.stdout + p.stderr[-2000:])
    if p.returncode != 0:
        fail("exported weights do not reproduce the model's logits in PyTorch")


def layout_round_trip(name, layout, label, np_c, args_c, label_c):
    """A 4-rank strategy-3 run with `layout` saves every 5 steps; resuming it in the same layout is
    bit-exact; it reshards to one rank without it (no_shard) and that, saved again, to `args_c`."""
    rd, ck = reference(f"{name}_a", 4, 3, extra=layout)
    r2 = fresh(f"{A.work}/{name}_a_resumed")
    run(4, r2, "distributed.zero_dp_strategy=3", *layout, f"checkpoint.resume={ck}/step_00000010")
    same(rd, r2, after=10, rtol=0.0, what=f"{label}, strategy 3: resume at step 10 (bit-exact)")
    b, bck = fresh(f"{A.work}/{name}_b"), fresh(f"{A.work}/{name}_b.ckpt")
    run(1, b, "distributed.zero_dp_strategy=0", f"checkpoint.resume={ck}/step_00000005", f"checkpoint.dir={bck}",
        "checkpoint.save_every=5")
    same(rd, b, after=5, rtol=1e-5, what=f"{label} -> 1 rank, no_shard")
    c = fresh(f"{A.work}/{name}_c")
    run(np_c, c, *args_c, f"checkpoint.resume={bck}/step_00000010")
    same(rd, c, after=10, rtol=1e-5, what=f"-> {label_c}")
    return ck


def scenario_tp():
    # Tensor-parallel slices are saved with their split; other layouts assemble and re-slice them.
    ck = layout_round_trip("tp", ("distributed.tp_size=2",), "tp 2 x dp_shard 2", 2,
                           ("distributed.zero_dp_strategy=1", "distributed.tp_size=2", "distributed.sequence_parallel=true"),
                           "tp 2 with sequence parallel, strategy 1")
    check_export(f"{ck}/step_00000020", "tp_export")


def scenario_cp():
    # Parameters are sharded over dp_shard x cp: CP changes only the layout of the shards.
    layout_round_trip("cp", ("distributed.cp_size=2",), "cp 2 x dp_shard 2", 4,
                      ("distributed.zero_dp_strategy=2", "distributed.cp_size=2", "distributed.tp_size=2"),
                      "cp 2 x tp 2, strategy 2")


def scenario_preempt():
    ref, _ = reference("preempt_ref", 2, 3, steps=400, every=1000)
    rd, ck = fresh(f"{A.work}/preempt"), fresh(f"{A.work}/preempt.ckpt")
    args = cmd(2, rd, "distributed.zero_dp_strategy=3", f"checkpoint.dir={ck}", "training.max_steps=400")
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(600):  # until it is training
        time.sleep(0.05)
        if os.path.exists(f"{rd}/metrics.jsonl") and os.path.getsize(f"{rd}/metrics.jsonl") > 0:
            break
    pids = subprocess.run(["pgrep", "-f", f"mfsdp train .*run_dir={rd}"], capture_output=True, text=True).stdout.split()
    if not pids:
        fail("no rank to signal (the run ended too early?)")
    os.kill(int(random.choice(pids)), signal.SIGUSR1)  # SLURM's warning, to one rank
    out, _ = p.communicate(timeout=120)
    if p.returncode != 0 or "stopped after step" not in out:
        print(out[-2000:])
        fail(f"preemption: exit status {p.returncode}")
    stopped = [l for l in out.splitlines() if "stopped after step" in l][0]
    run(2, rd, "distributed.zero_dp_strategy=3", f"checkpoint.dir={ck}", "training.max_steps=400")
    print(stopped.strip())
    same(ref, rd, rtol=0.0, what="preempted and resumed run vs uninterrupted")


def scenario_retention():
    # keep_last: only the newest N complete directories stay; save_final: false writes no final one.
    rd, ck = fresh(f"{A.work}/keep"), fresh(f"{A.work}/keep.ckpt")
    run(2, rd, "distributed.zero_dp_strategy=3", f"checkpoint.dir={ck}", "checkpoint.save_every=2",
        "checkpoint.keep_last=2", "training.max_steps=10")
    left = sorted(os.listdir(ck))
    if left != ["latest", "step_00000008", "step_00000010"]:
        fail(f"keep_last=2 left {left}")
    rd2, ck2 = fresh(f"{A.work}/nofinal"), fresh(f"{A.work}/nofinal.ckpt")
    run(1, rd2, f"checkpoint.dir={ck2}", "checkpoint.save_every=4", "checkpoint.save_final=false",
        "checkpoint.keep_last=0", "training.max_steps=10")
    left2 = sorted(os.listdir(ck2))
    if left2 != ["latest", "step_00000004", "step_00000008"]:
        fail(f"save_final=false left {left2}")
    print(f"keep_last=2: {left}; save_final=false: {left2}")
    # resume: none starts fresh even beside complete checkpoints; auto takes the latest.
    out = run(2, fresh(f"{A.work}/none"), "distributed.zero_dp_strategy=3", f"checkpoint.dir={ck}",
              "checkpoint.resume=none", "checkpoint.keep_last=2", "training.max_steps=10")
    if "resumed from" in out:
        fail("checkpoint.resume=none resumed")
    out = run(2, fresh(f"{A.work}/auto"), "distributed.zero_dp_strategy=3", f"checkpoint.dir={ck}",
              "checkpoint.keep_last=2", "training.max_steps=12")
    if "resumed from" not in out or "step_00000010" not in out:
        fail("checkpoint.resume=auto did not take the latest checkpoint")
    print("resume=none started fresh; resume=auto took step_00000010")


def scenario_async():
    rd, ck = fresh(f"{A.work}/async"), fresh(f"{A.work}/async.ckpt")
    run(2, rd, "distributed.zero_dp_strategy=3", f"checkpoint.dir={ck}", "checkpoint.save_every=5",
        "checkpoint.async=true", "checkpoint.keep_last=0")
    for step in (5, 10, 15, 20):
        if subprocess.run([A.bin, "inspect", f"{ck}/step_{step:08d}"], capture_output=True).returncode != 0:
            fail(f"async checkpoint step {step} incomplete")
    r2 = fresh(f"{A.work}/async_resumed")
    run(2, r2, "distributed.zero_dp_strategy=3", f"checkpoint.resume={ck}/step_00000010")
    same(rd, r2, after=10, rtol=0.0, what="resume from an asynchronously written checkpoint")


def scenario_frozen():
    """model.frozen: checkpoints hold the frozen weights but no optimizer state for them; resuming is
    bit-exact in the same layout and within 1e-5 resharded; unfreezing at a resume gives the newly
    trainable parameters fresh optimizer state (said in the log)."""
    frozen = 'model.frozen=["wte.weight", "wpe.weight", "blocks.0.*", "*ln_*"]'
    rd, ck = reference("frozen_a", 4, 3, extra=(frozen,))
    index = json.load(open(f"{ck}/step_00000010/index.json"))
    marked = sorted(n for n, p in index["params"].items() if p.get("frozen"))
    if "wte.weight" not in marked or "blocks.1.attn.c_attn.weight" in marked or "blocks.1.ln_1.weight" not in marked:
        fail(f"index.json marks {marked} frozen")
    keys = set()
    for f in index["files"]:
        with open(f"{ck}/step_00000010/{f}", "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            keys |= set(json.loads(fh.read(n)))
    if not any(k.startswith("main/wte.weight") for k in keys) or any(k.startswith("exp_avg/wte.weight") for k in keys):
        fail(f"frozen wte.weight: expected weights and no optimizer state in the files, keys {sorted(keys)[:8]}")
    if not any(k.startswith("exp_avg/blocks.1.attn.c_attn.weight") for k in keys):
        fail("trainable blocks.1.attn.c_attn.weight has no optimizer state in the checkpoint")
    print(f"checkpoint: {len(marked)} frozen parameters marked, weights saved, no optimizer state for them")
    r2 = fresh(f"{A.work}/frozen_same")
    run(4, r2, "distributed.zero_dp_strategy=3", f"checkpoint.resume={ck}/step_00000010", frozen)
    same(rd, r2, after=10, rtol=0.0, what="frozen, resume at step 10, 4 ranks strategy 3 (bit-exact)")
    r3 = fresh(f"{A.work}/frozen_reshard")
    run(2, r3, "distributed.zero_dp_strategy=1", f"checkpoint.resume={ck}/step_00000005", frozen)
    same(rd, r3, after=5, rtol=1e-5, what="frozen, 4 ranks strategy 3 -> 2 ranks strategy 1")
    r4, ck4 = fresh(f"{A.work}/frozen_unfrozen"), fresh(f"{A.work}/frozen_unfrozen.ckpt")
    out = run(2, r4, "distributed.zero_dp_strategy=2", f"checkpoint.resume={ck}/step_00000010", f"checkpoint.dir={ck4}",
              "checkpoint.save_final=true")
    if "parameters frozen when the checkpoint was saved train now, with fresh optimizer state" not in out:
        print(out[-2000:])
        fail("unfreezing at a resume did not say that the optimizer state starts fresh")
    a, b = losses(rd, 10), losses(r4, 10)
    if max(abs(a[s] - b[s]) for s in a) == 0:
        fail("unfrozen parameters did not change the losses")
    print("unfrozen at step 10: fresh optimizer state announced, losses leave the frozen run's")


if __name__ == "__main__":
    scenario_main(globals(), "ckpt")
