#!/usr/bin/env python3
"""mfsdp under a real SLURM (tests/slurm/cluster.sh: slurmctld + slurmd + munge on this machine),
submitted with the shipped batch script, scripts/slurm/train.sbatch, from the checkout.

  slurm_scenarios.py --src SRC --mfsdp BIN --fixture FX --work DIR [SCENARIO ...]

Every run trains the parity fixture's GPT on 4 ranks (strategy 3, checkpoint.resume: auto) and its
losses and gradient norms must equal, bit for bit, those of one uninterrupted `mpirun -np 4` run:
  srun          sbatch, 4 tasks through srun --mpi=pmix
  mpirun        sbatch with LAUNCHER=mpirun: mpirun inside the allocation
  usr1          scancel --signal=USR1 mid-run: the ranks save, the script requeues the job, the job
                starts again (SLURM_RESTART_COUNT 1) and resumes; it ends COMPLETED with Restarts=1
  batch_usr1    scancel --batch --signal=USR1 (the batch shell only, where SLURM's B:USR1 time-limit
                warning goes): the script passes it to the ranks; then as usr1
  early_usr1    scancel --batch --signal=USR1 as soon as the script has started srun, while the ranks
                are still loading LibTorch (before their handlers exist): the script holds the signal
                back until mfsdp reports "running", then as batch_usr1
  time_limit    a run longer than its --time=1 limit with the warning --signal=B:USR1@50: the
                warning comes before the limit (SLURM checks every few seconds, and the warning can
                come while the ranks still start: early_usr1), the job saves, requeues itself and
                resumes; then it is cancelled (exact resume is what the other scenarios check)
  requeue       scontrol requeue mid-run (SLURM's own requeue, after periodic saves): resumes
  preempt       the job in the low partition is preempted by a job in the high partition
                (PreemptMode=REQUEUE): requeued by SLURM, it resumes after the high job
  kill_rank     SIGKILL to one rank under srun --kill-on-bad-exit: the job fails, naming the task
Exit 1 when a scenario fails.
"""
import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

A = None
ENV = dict(os.environ)
failures = []
STEPS = 80


def sh(*cmd, check=True, **kw):
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, env=ENV, **kw)


def metrics(run_dir):
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            out[m["step"]] = (m["loss"], m.get("grad_norm"))  # a resumed run's later lines win
    return out


def job_field(job, field):
    p = sh("scontrol", "show", "job", str(job), check=False)
    m = re.search(rf"\b{field}=(\S+)", p.stdout)
    return m.group(1) if m else None


def wait_job(job, timeout):
    t0 = time.time()
    while time.time() - t0 < timeout:
        state = job_field(job, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(0.5)
    sh("scancel", str(job), check=False)
    return "HUNG"


def wait_steps(run_dir, n, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if len(open(os.path.join(run_dir, "metrics.jsonl")).readlines()) >= n:
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def submit(name, extra_sbatch=(), env=None, overrides=()):
    d = os.path.join(A.work, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    e = dict(ENV, **(env or {}))
    cmd = ["sbatch", "--parsable", "--ntasks-per-node=4", "--time=10", "-o", f"{d}/slurm-%j.out", *extra_sbatch,
           os.path.join(A.src, "scripts/slurm/train.sbatch"), os.path.join(A.fixture, "base.yaml"), *common(d), *overrides]
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=A.src)
    if p.returncode != 0:
        raise RuntimeError(f"sbatch failed: {p.stderr.strip()}")
    return int(p.stdout.strip().split(";")[0]), d


def common(d):
    return [f"run_dir={d}/run", f"training.max_steps={STEPS}", "distributed.zero_dp_strategy=3",
            f"checkpoint.dir={d}/ckpt", "checkpoint.resume=auto", "training.log_every=1000"]


def output(d):
    return "".join(open(p).read() for p in sorted(glob.glob(f"{d}/slurm-*.out")))


def check(name, cond, detail=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name}{': ' + detail if detail and not cond else ''}", flush=True)
    if not cond:
        failures.append(name)


def same_as_reference(name, d):
    try:
        got = metrics(f"{d}/run")
    except OSError as e:
        check(f"{name}: losses equal the uninterrupted run's", False, str(e))
        return
    bad = [s for s in REF if got.get(s) != REF[s]]
    check(f"{name}: losses and grad norms of all {len(REF)} steps equal the uninterrupted run's bit for bit",
          not bad and len(got) == len(REF), f"{len(bad)} steps differ, first {bad[:3]}; {len(got)} steps logged")


def scenario_srun():
    job, d = submit("srun")
    state = wait_job(job, 120)
    check("srun: the job completes", state == "COMPLETED", f"{state}\n{output(d)[-1500:]}")
    check("srun: ranks launched by srun --mpi=pmix", "srun --kill-on-bad-exit=1" in output(d) and "launcher" in output(d)
          and "srun" in output(d))
    same_as_reference("srun", d)


def scenario_mpirun():
    job, d = submit("mpirun", env={"LAUNCHER": "mpirun"})
    state = wait_job(job, 120)
    check("mpirun: mpirun inside the allocation completes", state == "COMPLETED", f"{state}\n{output(d)[-1500:]}")
    same_as_reference("mpirun", d)


def scenario_usr1():
    job, d = submit("usr1")
    ok = wait_steps(f"{d}/run", 20)
    sh("scancel", "--signal=USR1", str(job))
    state = wait_job(job, 180)
    out = output(d)
    check("usr1: saves, requeues itself and completes", ok and state == "COMPLETED" and job_field(job, "Restarts") == "1",
          f"{state}, restarts {job_field(job, 'Restarts')}\n{out[-2000:]}")
    check("usr1: the second start resumed from the signal's checkpoint",
          "requeueing job" in out and re.search(r"resumed from .*step_\d+ at step \d+", out) is not None, out[-2000:])
    same_as_reference("usr1", d)


def scenario_batch_usr1():
    job, d = submit("batch_usr1")
    ok = wait_steps(f"{d}/run", 30)
    sh("scancel", "--batch", "--signal=USR1", str(job))  # the batch shell only, as SLURM's B:USR1 warning
    state = wait_job(job, 180)
    out = output(d)
    check("batch_usr1: the script passes the shell's USR1 to the ranks, requeues, and the job completes",
          ok and state == "COMPLETED" and job_field(job, "Restarts") == "1" and "got SIGUSR1" in out,
          f"{state}, restarts {job_field(job, 'Restarts')}\n{out[-2000:]}")
    same_as_reference("batch_usr1", d)


def scenario_early_usr1():
    job, d = submit("early_usr1")
    t0 = time.time()
    while "mfsdp job" not in output(d) and time.time() - t0 < 60:
        time.sleep(0.05)
    sh("scancel", "--batch", "--signal=USR1", str(job))
    state = wait_job(job, 180)
    out = output(d)
    check("early_usr1: a USR1 while the ranks start is held back, passed on once they run; the job requeues and completes",
          state == "COMPLETED" and job_field(job, "Restarts") == "1" and "while the ranks start" in out
          and "the ranks run; passing SIGUSR1 on" in out, f"{state}, restarts {job_field(job, 'Restarts')}\n{out[-2000:]}")
    same_as_reference("early_usr1", d)


def scenario_time_limit():
    # A run longer than its one-minute limit: SLURM's warning (B:USR1@50) must come before the limit,
    # the job must save, requeue itself and resume; it is cancelled once the second start resumed.
    job, d = submit("time_limit", extra_sbatch=["--time=1", "--signal=B:USR1@50"], overrides=["training.max_steps=1000000"])
    t0 = time.time()
    resumed = False
    while time.time() - t0 < 150:
        out = output(d)
        if re.search(r"resumed from .*step_\d+ at step \d+", out):
            resumed = True
            break
        if job_field(job, "JobState") in ("TIMEOUT", "FAILED", "CANCELLED", "COMPLETED"):
            break
        time.sleep(0.5)
    state = job_field(job, "JobState")
    sh("scancel", str(job), check=False)
    wait_job(job, 60)
    out = output(d)
    m = re.search(r"stopped after step (\d+)", out)
    check("time_limit: the warning arrives before the limit; the job saves, requeues itself and resumes",
          resumed and m is not None and "got SIGUSR1" in out and "requeueing job" in out and state != "TIMEOUT",
          f"state {state}\n{out[-2000:]}")


def scenario_requeue():
    job, d = submit("requeue", overrides=["checkpoint.save_every=10"])
    ok = wait_steps(f"{d}/run", 25)
    sh("scontrol", "requeue", str(job))
    state = wait_job(job, 180)
    out = output(d)
    check("requeue: scontrol requeue restarts the job, which resumes and completes",
          ok and state == "COMPLETED" and int(job_field(job, "Restarts") or 0) >= 1 and "resumed from" in out,
          f"{state}\n{out[-2000:]}")
    same_as_reference("requeue", d)


def scenario_preempt():
    # The scheduler acts every sched_interval (2 s, cluster.sh): the low job must still be running
    # by then. A checkpoint every step slows its steps (numbers unchanged) so that its 80 steps
    # outlast that; with a save every 10 steps it finished first under load (2026-12-05).
    job, d = submit("preempt", overrides=["checkpoint.save_every=1"])
    ok = wait_steps(f"{d}/run", 3)
    hi = sh("sbatch", "--parsable", "-p", "high", "--ntasks-per-node=4", "-o", f"{d}/high-%j.out",
            "--wrap", "sleep 2; echo high priority done").stdout.strip()
    state_hi = wait_job(int(hi), 120)
    state = wait_job(job, 240)
    out = output(d)
    check("preempt: the high-partition job runs and the preempted job is requeued, resumes and completes",
          ok and state_hi == "COMPLETED" and state == "COMPLETED" and int(job_field(job, "Restarts") or 0) >= 1
          and "resumed from" in out, f"high {state_hi}, low {state}, restarts {job_field(job, 'Restarts')}\n{out[-2000:]}")
    same_as_reference("preempt", d)


def scenario_kill_rank():
    job, d = submit("kill_rank", overrides=["training.max_steps=100000"])
    ok = wait_steps(f"{d}/run", 10)
    victim = None
    for line in sh("ps", "-eo", "pid,args", check=False).stdout.splitlines():
        if f"run_dir={d}/run" in line and "mfsdp train" in line and "srun" not in line:
            pid = int(line.split()[0])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            rank = next((int(e.split(b"=")[1]) for e in env if e.startswith(b"SLURM_PROCID=")), None)
            if rank == 2:
                victim = pid
    if victim:
        os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    state = wait_job(job, 120)
    out = output(d)
    check("kill_rank: the job fails within 60 s of the kill", ok and victim and state == "FAILED" and time.time() - t0 < 60,
          f"victim {victim}, {state} after {time.time() - t0:.0f} s\n{out[-1500:]}")
    check("kill_rank: the output names the killed task (rank 2)", re.search(r"task 2: Killed", out) is not None, out[-1500:])


def reference(steps):
    # The uninterrupted run is cached between runs of this test, keyed to the binary and the
    # fixture's experiment: a rebuilt mfsdp (another summation order, say) writes a new one
    # instead of failing every scenario against the old binary's losses.
    d = os.path.join(A.work, f"reference_{steps}")
    h = hashlib.sha256()
    for f in (A.mfsdp, os.path.join(A.fixture, "base.yaml")):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    key = h.hexdigest()
    key_file = f"{d}/key"
    cached = os.path.exists(key_file) and open(key_file).read() == key and os.path.exists(f"{d}/run/metrics.jsonl")
    if not cached:
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        args = [f"run_dir={d}/run", f"training.max_steps={steps}", "distributed.zero_dp_strategy=3",
                "training.log_every=1000"]
        sh("mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "4", A.mfsdp, "train", "-c",
           os.path.join(A.fixture, "base.yaml"), *args)
        with open(key_file, "w") as fh:
            fh.write(key)
    return metrics(f"{d}/run")


SCENARIOS = {"srun": scenario_srun, "mpirun": scenario_mpirun, "usr1": scenario_usr1, "batch_usr1": scenario_batch_usr1,
             "early_usr1": scenario_early_usr1, "time_limit": scenario_time_limit,
             "requeue": scenario_requeue, "preempt": scenario_preempt, "kill_rank": scenario_kill_rank}


def main():
    global A, REF
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True)
    ap.add_argument("--mfsdp", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--work", required=True)
    # batch_usr1 takes the path time_limit takes (the batch shell's trap); by name only, to keep CI short.
    ap.add_argument("scenarios", nargs="*", default=[s for s in SCENARIOS if s != "batch_usr1"])
    A = ap.parse_args()
    os.makedirs(A.work, exist_ok=True)
    if os.geteuid() != 0:
        print("SKIPPED: slurmd must run as root to start jobs; run the tests as root for the SLURM scenarios")
        sys.exit(77)
    cluster = os.path.join(A.work, "cluster")
    up = subprocess.run([os.path.join(A.src, "tests/slurm/cluster.sh"), "start", cluster], capture_output=True, text=True)
    if up.returncode != 0:
        sys.exit(f"cannot start SLURM: {up.stderr.strip()}")
    ENV["SLURM_CONF"] = os.path.join(cluster, "slurm.conf")
    ENV["MFSDP"] = A.mfsdp
    ENV.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    ENV.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    ENV["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
    try:
        REF = reference(STEPS)
        for s in A.scenarios:
            t0 = time.time()
            try:
                SCENARIOS[s]()
            except Exception as e:  # a scenario that crashes is a failure, never a skip
                check(f"{s}: ran", False, repr(e))
            print(f"  ({s}: {time.time() - t0:.0f} s)", flush=True)
    finally:
        subprocess.run([os.path.join(A.src, "tests/slurm/cluster.sh"), "stop", cluster], capture_output=True)
    print("FAILED: " + ", ".join(failures) if failures else "all SLURM scenarios passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
