#!/usr/bin/env python3
"""Two hosts on one machine (tests/multihost/hosts.sh: network namespaces joined by a veth pair,
their own hostnames), Open MPI over TCP between them, launched through a namespace agent in place
of ssh (tests/multihost/netns_agent.sh).

  multihost_scenarios.py --src SRC --mfsdp BIN --fixture FX --work DIR [SCENARIO ...]

  train       2 hosts x 2 ranks, tp 2 x dp_shard 2, strategy 3: the placement table shows host0 and
              host1 with local ranks 0/2 and 1/2, each TP group inside one host, and the losses of
              all 30 steps equal the one-host mpirun -np 4 run's bit for bit
  cut_link    the link goes down mid-run (distributed.timeout_s 8): every rank stops, the job ends
              non-zero within timeout + 60 s, with the watchdog's line naming the collective and
              the ranks it waits for; nothing hangs
  private_dir host1 sees its own checkpoint.dir (a tmpfs): the job stops at start with an error
              naming ranks 2,3 on host1, and nothing is written
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

A = None
failures = []


def check(name, cond, detail=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name}{': ' + detail if detail and not cond else ''}", flush=True)
    if not cond:
        failures.append(name)


def hosts(*args, **kw):
    return subprocess.run([os.path.join(A.src, "tests/multihost/hosts.sh"), *args], capture_output=True, text=True, **kw)


def mpirun_2hosts(args, env=None, timeout=300):
    hostfile = os.path.join(A.work, "hostfile")
    open(hostfile, "w").write("10.77.0.1 slots=2\n10.77.0.2 slots=2\n")
    cmd = [os.path.join(A.src, "tests/multihost/hosts.sh"), "run", "0", "mpirun", "--allow-run-as-root", "--hostfile",
           hostfile, "-np", "4", "--mca", "plm_rsh_agent", os.path.join(A.src, "tests/multihost/netns_agent.sh"),
           "--mca", "btl", "tcp,vader,self", "--mca", "btl_tcp_if_include", "10.77.0.0/24", "--mca",
           "oob_tcp_if_include", "10.77.0.0/24",
           # Open MPI's runtime notices a dead link to a daemon only through TCP keepalive, after 8
           # minutes by default: 5 s idle, then 3 probes 2 s apart.
           "--mca", "oob_tcp_keepalive_time", "5", "--mca", "oob_tcp_keepalive_intvl", "2",
           "--mca", "oob_tcp_keepalive_probes", "3", A.mfsdp, "train", "-c", os.path.join(A.fixture, "base.yaml"), *args]
    log = open(os.path.join(A.work, "mpirun.log"), "w+")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, **(env or {})))
    p.log = log
    return p


def finish(p, timeout):
    """Waits for mpirun; the output comes from a file (the ranks in the other namespace may hold a
    pipe open after mpirun is gone). Returns (output, hung)."""
    try:
        p.wait(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        hung = True
    p.log.seek(0)
    return p.log.read(), hung


def metrics(run_dir):
    out = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        m = json.loads(line)
        out[m["step"]] = (m["loss"], m.get("grad_norm"))
    return out


COMMON = ["distributed.tp_size=2", "distributed.zero_dp_strategy=3", "training.max_steps=30", "training.log_every=1000"]


def scenario_train():
    ref = os.path.join(A.work, "one_host")
    shutil.rmtree(ref, ignore_errors=True)
    subprocess.run(["mpirun", "--oversubscribe", "--allow-run-as-root", "-np", "4", A.mfsdp, "train", "-c",
                    os.path.join(A.fixture, "base.yaml"), f"run_dir={ref}", *COMMON], check=True, capture_output=True)
    d = os.path.join(A.work, "two_hosts")
    shutil.rmtree(d, ignore_errors=True)
    p = mpirun_2hosts([f"run_dir={d}", *COMMON])
    out, _ = finish(p, 300)
    check("train: 2 hosts x 2 ranks train", p.returncode == 0, out[-2000:])
    rows = re.findall(r"^\s+(\d) (host\d)\s+(\d)/(\d)\s+cpu\s+\d+\s+\((\d),(\d),(\d),(\d)\)", out, re.M)
    table = {int(r): (h, int(lr), int(ln), (int(a), int(b), int(c)), int(tp)) for r, h, lr, ln, a, b, c, tp in rows}
    check("train: the placement table shows both hosts and the local ranks",
          len(table) == 4 and [table[r][0] for r in range(4)] == ["host0", "host0", "host1", "host1"]
          and [table[r][1:3] for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)], str(table))
    groups = {}
    for r, (h, _, _, coords, _) in table.items():
        groups.setdefault(coords, set()).add(h)
    check("train: every TP group lies inside one host", groups and all(len(h) == 1 for h in groups.values()), str(groups))
    if p.returncode == 0:
        got, want = metrics(d), metrics(ref)
        check("train: losses and grad norms of all 30 steps equal the one-host run's bit for bit", got == want,
              f"{sum(got.get(s) != want[s] for s in want)} steps differ")


def scenario_cut_link():
    d = os.path.join(A.work, "cut")
    shutil.rmtree(d, ignore_errors=True)
    p = mpirun_2hosts([f"run_dir={d}", "distributed.tp_size=2", "distributed.zero_dp_strategy=3",
                       "training.max_steps=1000000", "distributed.timeout_s=8", "training.log_every=1000"])
    t0 = time.time()
    ok = False
    while time.time() - t0 < 120:
        try:
            if len(open(os.path.join(d, "metrics.jsonl")).readlines()) >= 10:
                ok = True
                break
        except OSError:
            pass
        time.sleep(0.2)
    hosts("cut")
    t_cut = time.time()
    out, hung = finish(p, 8 + 60)
    elapsed = time.time() - t_cut
    hosts("mend")
    subprocess.run(["pkill", "-9", "-f", f"run_dir={d}"], capture_output=True)
    subprocess.run(["pkill", "-9", "-f", "orted.*10.77.0"], capture_output=True)
    check("cut_link: every rank stops within timeout_s + 60 s, the job ends non-zero",
          ok and not hung and p.returncode != 0, f"trained {ok}, hung {hung}, rc {p.returncode}, {elapsed:.0f} s\n{out[-2500:]}")
    check("cut_link: the watchdog names the collective that did not finish and the peer on the other host",
          # The stuck collective may be on a cross-host DP group ([0,2]) or on the world group (a
          # step-level agreement), whose member list also names the peer on this host: any form
          # that names a host1 peer from a host0 rank is the diagnosis wanted.
          re.search(r"has not finished after \d+ s .*waiting for rank\(s\) [^\n]*\b[23] on host1[^\n]*"
                    r"\(this rank is on host0\)", out)
          is not None, out[-2500:])
    print(f"  (stopped {elapsed:.1f} s after the cut)")


def scenario_private_dir():
    d = os.path.join(A.work, "private")
    shutil.rmtree(d, ignore_errors=True)
    ck = os.path.join(d, "ckpt")
    p = mpirun_2hosts([f"run_dir={d}/run", f"checkpoint.dir={ck}", *COMMON], env={"MFSDP_HOST1_PRIVATE_DIR": ck})
    out, _ = finish(p, 300)
    check("private_dir: the job stops at start naming the ranks and host that do not share checkpoint.dir",
          p.returncode != 0 and re.search(r"rank\(s\) 2,3 \(on host1\) do not see what rank 0 writes there", out) is not None,
          out[-2000:])
    check("private_dir: nothing trained or saved", not os.path.exists(os.path.join(d, "run", "metrics.jsonl"))
          and not any(n.startswith("step_") for n in (os.listdir(ck) if os.path.isdir(ck) else [])))


SCENARIOS = {"train": scenario_train, "cut_link": scenario_cut_link, "private_dir": scenario_private_dir}


def main():
    global A
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True)
    ap.add_argument("--mfsdp", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("scenarios", nargs="*", default=list(SCENARIOS))
    A = ap.parse_args()
    if os.geteuid() != 0:
        print("SKIPPED: network namespaces need root; run the tests as root for the multi-host scenarios")
        sys.exit(77)
    os.makedirs(A.work, exist_ok=True)
    up = hosts("up")
    if up.returncode != 0:
        sys.exit(f"cannot make the two hosts: {up.stderr.strip()}")
    try:
        for s in A.scenarios:
            t0 = time.time()
            try:
                SCENARIOS[s]()
            except Exception as e:
                check(f"{s}: ran", False, repr(e))
            print(f"  ({s}: {time.time() - t0:.0f} s)", flush=True)
    finally:
        hosts("down")
    print("FAILED: " + ", ".join(failures) if failures else "all multi-host scenarios passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
