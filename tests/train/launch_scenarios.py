#!/usr/bin/env python3
"""Launch and failure scenarios, run as users run mfsdp.

    launch_scenarios.py SCENARIO --bin MFSDP --fx FIXTURE_DIR --mpirun "mpirun ..." --src SOURCE_DIR

kill:      one of four ranks gets SIGKILL at a random moment (10 runs): the job must exit non-zero
           within distributed.timeout_s plus a margin, naming the killed rank.
mismatch:  a planted collective mismatch (MFSDP_TEST_MISMATCH) is caught by the watchdog on every
           rank and explained by `mfsdp diagnose`.
slurm:     a start as srun makes it, simulated by SLURM's environment variables.
sbatch:    scripts/slurm/train.sbatch passes bash -n and prints its launch command in dry-run mode
           (the real SLURM runs it in tests/slurm/slurm_scenarios.py).
sigint:    Ctrl-C (SIGINT) to a rank ends the job with one line naming it.
"""
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


def cmd(np_, run_dir, *overrides):
    return shlex.split(A.mpirun) + ["-np", str(np_), A.bin, "train", "-c", f"{A.fx}/base.yaml", f"run_dir={run_dir}",
                                    *overrides]


def rank_pids(run_dir):
    """pid -> rank of the running ranks of this run (Open MPI puts the rank in the environment)."""
    out = {}
    for pid in subprocess.run(["pgrep", "-f", f"mfsdp train .*run_dir={run_dir}"], capture_output=True,
                              text=True).stdout.split():
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                out[int(pid)] = int(kv.split(b"=")[1])
    return out


def wait_training(run_dir, p, limit_s=120):
    """Whether the job logged its first step within limit_s (a deadline: sanitizer builds start slowly)."""
    for _ in range(int(limit_s / 0.05)):
        if p.poll() is not None:
            return False
        if os.path.exists(f"{run_dir}/metrics.jsonl") and os.path.getsize(f"{run_dir}/metrics.jsonl") > 0:
            return True
        time.sleep(0.05)
    return False


def scenario_kill():
    timeout_s = 20
    for trial in range(A.trials):
        rd = f"{A.work}/kill_{trial}"
        shutil.rmtree(rd, ignore_errors=True)
        p = subprocess.Popen(cmd(4, rd, "training.max_steps=100000", "distributed.zero_dp_strategy=3",
                                 f"distributed.timeout_s={timeout_s}"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        if not wait_training(rd, p):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            print(p.communicate()[0][-2000:])
            fail(f"trial {trial}: the run did not start training")
        time.sleep(random.uniform(0.0, 1.5))
        pids = rank_pids(rd)
        if len(pids) != 4:
            fail(f"trial {trial}: found ranks {pids}")
        victim_pid = random.choice(list(pids))
        victim = pids[victim_pid]
        os.kill(victim_pid, signal.SIGKILL)
        t0 = time.time()
        try:
            out, _ = p.communicate(timeout=timeout_s + 30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            fail(f"trial {trial}: the job still runs {timeout_s + 30} s after rank {victim} was killed")
        took = time.time() - t0
        named = f"rank {victim}" in out
        print(f"trial {trial}: killed rank {victim}; job ended with status {p.returncode} after {took:.1f} s; "
              f"rank named: {named}")
        if p.returncode == 0 or not named:
            print(out[-2000:])
            fail(f"trial {trial}: exit status {p.returncode}, rank {victim} named: {named}")
        leftover = rank_pids(rd)
        if leftover:
            fail(f"trial {trial}: ranks still alive: {leftover}")


def scenario_mismatch():
    rd = f"{A.work}/mismatch"
    shutil.rmtree(rd, ignore_errors=True)
    env = dict(os.environ, MFSDP_TEST_MISMATCH="2:3")
    t0 = time.time()
    p = subprocess.run(shlex.split(A.mpirun) + ["-x", "MFSDP_TEST_MISMATCH"] + cmd(4, rd, "distributed.timeout_s=3")[
        len(shlex.split(A.mpirun)):], capture_output=True, text=True, env=env, timeout=120)
    out = p.stdout + p.stderr
    print(f"exit status {p.returncode} after {time.time() - t0:.1f} s")
    if p.returncode == 0 or "watchdog" not in out:
        print(out[-2000:])
        fail("the watchdog did not stop the mismatched job")
    d = subprocess.run([A.bin, "diagnose", rd], capture_output=True, text=True)
    print(d.stdout)
    if d.returncode != 0 or "rank(s) 2 is in all_gather" not in d.stdout or "planted" not in d.stdout:
        fail("diagnose did not single out rank 2's all_gather")


def scenario_slurm():
    rd = f"{A.work}/slurm"
    shutil.rmtree(rd, ignore_errors=True)
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0",
               SLURM_NODEID="0", SLURM_CPUS_PER_TASK="2", SLURM_JOB_NODELIST="vm", SLURM_STEP_NUM_TASKS="1")
    p = subprocess.run([A.bin, "train", "-c", f"{A.fx}/base.yaml", f"run_dir={rd}", "training.max_steps=3",
                        "training.threads=auto"], capture_output=True, text=True, env=env, timeout=120)
    out = p.stdout + p.stderr
    print(out[:1500])
    if p.returncode != 0:
        fail(f"exit status {p.returncode} under SLURM's environment")
    placement = [l for l in out.splitlines() if l.strip().startswith("0 ")]
    if not placement or "slurm" not in placement[0] or " 2 " not in placement[0]:
        fail("the placement table does not show the SLURM launch with 2 threads (SLURM_CPUS_PER_TASK)")
    v = subprocess.run([A.bin, "validate", "-q", "-c", f"{A.fx}/base.yaml"], capture_output=True, text=True,
                       env=dict(os.environ, SLURM_NTASKS="4"))
    if "world size 4" not in v.stdout:
        fail("validate did not take the world size from SLURM_NTASKS: " + v.stdout + v.stderr)


def scenario_sbatch():
    script = f"{A.src}/scripts/slurm/train.sbatch"
    if subprocess.run(["bash", "-n", script]).returncode != 0:
        fail("bash -n")
    for launcher, env, expect in (
            ("srun", {}, "srun --kill-on-bad-exit=1"),
            ("mpirun", {"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "2"},
             "mpirun -np 8 --map-by ppr:4:node:PE=2")):
        e = dict(os.environ, DRY_RUN="1", LAUNCHER=launcher, MFSDP=A.bin, **env)
        p = subprocess.run(["bash", script, "configs/default.yaml", "training.max_steps=5"], capture_output=True,
                           text=True, env=e)
        print(p.stdout.strip())
        if p.returncode != 0 or expect not in p.stdout or "-c configs/default.yaml training.max_steps=5" not in p.stdout:
            fail(f"dry run with LAUNCHER={launcher}")


def scenario_sigint():
    rd = f"{A.work}/sigint"
    shutil.rmtree(rd, ignore_errors=True)
    p = subprocess.Popen(cmd(2, rd, "training.max_steps=100000"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    if not wait_training(rd, p):
        fail("the run did not start training")
    pids = rank_pids(rd)
    victim_pid = random.choice(list(pids))
    os.kill(victim_pid, signal.SIGINT)
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        fail("SIGINT did not end the job")
    line = f"rank {pids[victim_pid]}: interrupted (SIGINT)"
    print(f"exit status {p.returncode}; '{line}' printed: {line in out}")
    if p.returncode == 0 or line not in out or "Traceback" in out:
        print(out[-2000:])
        fail("SIGINT did not end the job with one line naming the rank")


if __name__ == "__main__":
    scenario_main(globals(), "launch")
