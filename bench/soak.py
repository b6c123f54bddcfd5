#!/usr/bin/env python3
"""Soak: a long run at 4 ranks with async saves, killed at random and resumed, against the same run
uninterrupted (issue 16; DESIGN.md section 6 on checkpoints, section 9 on failures).

    bench/soak.py [--steps 2000] [--np 4] [--save-every 50] [--kill-every 4 12] [--out bench/results_soak.md]

Needs the test fixture (cmake --build build && cd build && ctest -R train_fixture). Runs
  1. the reference: STEPS steps, zero_dp_strategy 3, checkpoint.async, a save every SAVE_EVERY
     steps, every rank's RSS sampled twice a second;
  2. the soak: the same command, SIGKILLed (one random rank, or every rank at once) after a random
     2..12 s, then started again with checkpoint.resume auto, until it reaches STEPS.
Checks, each a failure with a reason (exit 1):
  - every step's loss and grad norm the soak logged, before and after each kill, equal the
    reference's bit for bit (the floats as metrics.jsonl writes them);
  - a killed job ends: mpirun exits within 60 s of the kill, no rank left running;
  - each restart resumes from the newest complete checkpoint (`latest`, verified by mfsdp inspect);
  - at the end the checkpoint directory holds `latest` and complete step directories only (no
    .tmp or .replaced directory), and no file is left in the runs' own TMPDIR or in /dev/shm
    but Open MPI's session data (listed separately);
  - RSS flat: the least-squares slope of each rank's RSS over steps 10%..100% of the reference,
    in MiB per 1000 steps, below --max-slope (default 2).
Writes the measurements to --out (markdown), with the date and the command.
"""
import argparse
import datetime
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def fail(msg):
    print(f"soak: FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def ranks_of(run_dir):
    """PIDs of the mfsdp ranks of the job writing into run_dir."""
    out = subprocess.run(["pgrep", "-f", f"mfsdp train .*run_dir={run_dir}( |$)"], capture_output=True, text=True)
    pids = []
    for tok in out.stdout.split():
        try:
            with open(f"/proc/{tok}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0].decode()) == "mfsdp":
            pids.append(int(tok))
    return sorted(pids)


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def steps_logged(run_dir):
    try:
        with open(f"{run_dir}/metrics.jsonl", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def records(run_dir):
    out = []
    with open(f"{run_dir}/metrics.jsonl") as f:
        for line in f:
            m = json.loads(line)
            if "loss" in m and "step" in m:
                out.append(m)
    return out


def listing(path):
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


def slope(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--kill-every", type=float, nargs=2, default=(2.0, 12.0), metavar=("MIN_S", "MAX_S"))
    ap.add_argument("--max-slope", type=float, default=2.0, help="MiB per 1000 steps")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin", default=f"{ROOT}/build/bin/mfsdp")
    ap.add_argument("--fx", default=f"{ROOT}/build/tests/fixture")
    ap.add_argument("--work", default="/tmp/mfsdp_soak")
    ap.add_argument("--out", default=f"{HERE}/results_soak.md")
    a = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress lines as they happen, also into a file
    rng = random.Random(a.seed)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    # The runs' temporary files (Open MPI's session directory among them) go to a directory of
    # their own, which must hold nothing but Open MPI's session data at the end.
    tmpdir = f"{a.work}/tmp"
    os.makedirs(tmpdir)
    env["TMPDIR"] = tmpdir
    shm_before = listing("/dev/shm")

    def command(run_dir, ckpt):
        return ["mpirun", "--oversubscribe", "-np", str(a.np), a.bin, "train", "-c", f"{a.fx}/base.yaml",
                f"run_dir={run_dir}", "distributed.zero_dp_strategy=3", f"training.max_steps={a.steps}",
                f"checkpoint.dir={ckpt}", f"checkpoint.save_every={a.save_every}", "checkpoint.async=true",
                "checkpoint.keep_last=2", "checkpoint.resume=auto", "training.log_every=10"]

    # 1. The reference, RSS sampled.
    ref_dir, ref_ck = f"{a.work}/ref", f"{a.work}/ref.ckpt"
    t0 = time.time()
    p = subprocess.Popen(command(ref_dir, ref_ck), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    samples = {}  # pid -> [(step, MiB)]
    while p.poll() is None:
        step = steps_logged(ref_dir)
        for pid in ranks_of(ref_dir):
            m = rss_mib(pid)
            if m is not None:
                samples.setdefault(pid, []).append((step, m))
        time.sleep(0.5)
    ref_out = p.stdout.read()
    if p.returncode != 0:
        print(ref_out[-3000:])
        fail(f"the reference run exited {p.returncode}")
    ref_secs = time.time() - t0
    ref = records(ref_dir)
    if len(ref) != a.steps:
        fail(f"the reference logged {len(ref)} steps, expected {a.steps}")
    by_step = {m["step"]: m for m in ref}
    rss_rows = []
    for rank, (pid, pts) in enumerate(sorted(samples.items())):
        pts = [(s, m) for s, m in pts if s >= a.steps // 10]
        if len(pts) < 10:
            fail(f"too few RSS samples of rank pid {pid} ({len(pts)})")
        sl = slope([s for s, _ in pts], [m for _, m in pts]) * 1000
        rss_rows.append((rank, pts[0][1], max(m for _, m in pts), pts[-1][1], sl, len(pts)))
    print(f"reference: {a.steps} steps in {ref_secs:.0f} s; RSS slopes (MiB/1000 steps): "
          + ", ".join(f"{r[4]:+.2f}" for r in rss_rows))

    # 2. The soak: killed and resumed until done.
    rd, ck = f"{a.work}/soak", f"{a.work}/soak.ckpt"
    kills, t0 = [], time.time()
    earlier = []  # records logged before each kill (a resumed run rewrites metrics.jsonl from its step)
    while True:
        latest = None
        if os.path.exists(f"{ck}/latest"):
            latest = open(f"{ck}/latest").read().strip()
            chk = subprocess.run([a.bin, "inspect", f"{ck}/{latest}"], capture_output=True, text=True)
            if chk.returncode != 0:
                print(chk.stdout + chk.stderr)
                fail(f"after kill {len(kills)}: latest ({latest}) is not a complete, verified checkpoint")
        p = subprocess.Popen(command(rd, ck), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                             start_new_session=True)
        delay = rng.uniform(*a.kill_every)
        deadline = time.time() + delay
        while time.time() < deadline and p.poll() is None:
            time.sleep(0.1)
        if p.poll() is not None:  # finished before the kill
            out = p.stdout.read()
            if p.returncode != 0:
                print(out[-3000:])
                fail(f"the soak run exited {p.returncode} without a kill")
            if latest and f"resumed from {ck}/{latest}" not in out:
                fail(f"the final run did not resume from {latest}")
            break
        pids = ranks_of(rd)
        if not pids:  # still starting: try again later
            continue
        mode = rng.choice(["one rank", "every rank"])
        victims = [rng.choice(pids)] if mode == "one rank" else pids
        step_at_kill = steps_logged(rd)
        for v in victims:
            try:
                os.kill(v, signal.SIGKILL)
            except ProcessLookupError:
                pass
        t_kill = time.time()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            fail(f"kill {len(kills) + 1} ({mode}, step ~{step_at_kill}): mpirun still running 60 s after the kill")
        ended = time.time() - t_kill
        out = p.stdout.read()
        time.sleep(0.5)
        left = ranks_of(rd)
        if left:
            for v in left:
                os.kill(v, signal.SIGKILL)
            fail(f"kill {len(kills) + 1}: ranks {left} still running after mpirun ended")
        trained = any(line.startswith(("step ", "checkpoint ")) for line in out.splitlines())
        if latest and trained and "resumed from" not in out:  # (a kill during start-up prints neither)
            print(out[-2000:])
            fail(f"kill {len(kills) + 1}: a complete checkpoint ({latest}) existed but the run did not resume")
        if os.path.exists(f"{rd}/metrics.jsonl"):
            earlier += records(rd)
        kills.append((mode, step_at_kill, latest, ended))
        print(f"kill {len(kills)}: {mode} at step ~{step_at_kill} (resumed from {latest}); job ended {ended:.1f} s later")
    soak_secs = time.time() - t0

    # Every record, before and after each kill, equals the reference's step.
    final = records(rd)
    got = earlier + final
    for m in got:
        r = by_step.get(m["step"])
        if r is None:
            fail(f"the soak logged step {m['step']}, which the reference did not")
        for key in ("loss", "grad_norm"):
            if key in r and m.get(key) != r[key]:
                fail(f"step {m['step']}: {key} {m.get(key)!r} after the kills, {r[key]!r} uninterrupted")
    if set(m["step"] for m in final) != set(by_step):
        fail(f"the soak's final log lacks steps {sorted(set(by_step) - set(m['step'] for m in final))[:10]}")

    # Nothing left behind.
    stray = sorted(n for n in listing(ck) if n != "latest" and not (n.startswith("step_") and os.path.exists(f"{ck}/{n}/index.json")))
    if stray:
        fail(f"{ck} holds {stray} after the soak")
    steps_kept = sorted(n for n in listing(ck) if n.startswith("step_"))
    new_tmp = sorted(listing(tmpdir))
    new_shm = sorted(listing("/dev/shm") - shm_before)
    mpi_own = [n for n in new_tmp + new_shm if n.startswith(("ompi.", "openmpi-sessions", "prterun", "pmix", "sm_segment", "vader_segment"))]
    ours = [n for n in new_tmp + new_shm if n not in mpi_own]
    if ours:
        fail(f"left in TMPDIR or /dev/shm: {ours}")

    rows = "\n".join(f"| {r} | {first:.1f} | {peak:.1f} | {last:.1f} | {sl:+.2f} | {n} |" for r, first, peak, last, sl, n in rss_rows)
    worst = max(abs(r[4]) for r in rss_rows)
    kill_rows = "\n".join(f"| {i + 1} | {mode} | {s} | {lat or '(none: fresh start)'} | {e:.1f} |"
                          for i, (mode, s, lat, e) in enumerate(kills))
    cmdline = "bench/soak.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    text = f"""# Soak: {a.steps} steps at {a.np} ranks, async saves every {a.save_every} steps, random SIGKILLs

Written by `{cmdline}` on {datetime.date.today().isoformat()} ({os.cpu_count()} cores).
Model: the test fixture's GPT (build/tests/fixture/base.yaml), zero_dp_strategy 3,
checkpoint.async true, keep_last 2, resume auto. The reference ran uninterrupted ({ref_secs:.0f} s);
the soak was killed {len(kills)} times (one random rank, or every rank at once, after 2..12 s of
each launch) and started again each time; in all {soak_secs:.0f} s.

Result: every loss and grad norm the soak logged ({len(got)} records: the final log's {len(final)} and
the {len(earlier)} logged before the kills, steps that ran again after them) equals the reference's bit for bit; each killed job ended by itself;
each restart resumed from `latest` (verified by `mfsdp inspect`); left at the end: `latest` and
{', '.join(steps_kept)}, nothing in the runs' TMPDIR or in /dev/shm{f' but Open MPI session data ({", ".join(mpi_own)})' if mpi_own else ''}.

## RSS of each rank in the reference (steps {a.steps // 10}..{a.steps}, sampled every 0.5 s)

| rank | first MiB | peak MiB | last MiB | slope MiB / 1000 steps | samples |
|---|---|---|---|---|---|
{rows}

Largest slope {worst:.2f} MiB per 1000 steps (limit {a.max_slope}).

## Kills

| # | killed | at step (logged) | resumed from | job ended after (s) |
|---|---|---|---|---|
{kill_rows}
"""
    with open(a.out, "w") as f:
        f.write(text)
    print(text)
    if worst > a.max_slope:
        fail(f"RSS grows by {worst:.2f} MiB per 1000 steps (limit {a.max_slope})")


if __name__ == "__main__":
    main()
