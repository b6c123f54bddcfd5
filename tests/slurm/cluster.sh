#!/usr/bin/env bash
# A real single-node SLURM cluster for the tests (Debian's slurmctld + slurmd + munge, no systemd),
# everything under one scratch directory:
#   cluster.sh start DIR     write slurm.conf, start munged, slurmctld, slurmd; wait until the node is idle
#   cluster.sh stop DIR      TERM the daemons (KILL after 10 s), remove nothing
# Then: export SLURM_CONF=DIR/slurm.conf; sbatch ... (partitions: debug (default, low priority,
# preemptible by requeue) and high (PriorityTier 10)). Facts behind the settings:
# ../shared/reference/slurm.md.
set -euo pipefail
cmd=${1:?usage: cluster.sh start|stop DIR}
dir=$(mkdir -p "${2:?usage: cluster.sh start|stop DIR}" && cd "$2" && pwd)
host=$(hostname -s)

stop() {
  # Jobs first: daemons stopped under running jobs leave their steps' tasks running, orphaned.
  if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
    local conf=$dir/slurm.conf jobs
    jobs=$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      SLURM_CONF=$conf scancel $jobs 2>/dev/null || true
      for _ in $(seq 60); do [ -z "$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
  fi
  for name in slurmd slurmctld munged; do
    [ -f "$dir/$name.pid" ] || continue
    pid=$(cat "$dir/$name.pid")
    kill -TERM "$pid" 2>/dev/null || true
  done
  for name in slurmd slurmctld munged; do
    [ -f "$dir/$name.pid" ] || continue
    pid=$(cat "$dir/$name.pid")
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$dir/$name.pid"
  done
  # Whatever still runs with this cluster's configuration (a job's task that outlived its step).
  for env in /proc/[0-9]*/environ; do
    p=${env#/proc/}
    p=${p%/environ}
    [ "$p" = $$ ] || [ "$p" = "$PPID" ] && continue
    if tr '\0' '\n' < "$env" 2>/dev/null | grep -qx "SLURM_CONF=$dir/slurm.conf"; then
      kill -KILL "$p" 2>/dev/null || true
    fi
  done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "cluster.sh: unknown command $cmd" >&2; exit 2; }
for b in munged mungekey slurmctld slurmd sbatch sinfo; do
  command -v "$b" >/dev/null || { echo "cluster.sh: $b not found (Debian packages slurmctld slurmd slurm-client munge)" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "cluster.sh: slurmd must run as root (it starts jobs as their users)" >&2; exit 2; }
stop
mkdir -p "$dir/spool/ctld" "$dir/spool/d" "$dir/munge" "$dir/log"
chmod 700 "$dir/munge"
[ -f "$dir/munge/munge.key" ] || { head -c 1024 /dev/urandom > "$dir/munge/munge.key"; chmod 400 "$dir/munge/munge.key"; }
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" --pid-file="$dir/munged.pid" \
       --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munge.seed"
cat > "$dir/slurm.conf" <<CONF
ClusterName=mfsdptest
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long before it may start again (120 s by default); 10 s
# -> 5 s took 7 s off each of the five requeue scenarios (measured). The credentials are used within it.
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
StateSaveLocation=$dir/spool/ctld
SlurmdSpoolDir=$dir/spool/d
SlurmctldPidFile=$dir/slurmctld.pid.conf
SlurmdPidFile=$dir/slurmd.pid.conf
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=$((6817 + RANDOM % 500 * 2))
SlurmdPort=$((7817 + RANDOM % 500 * 2))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
MailProg=/bin/true
ReturnToService=2
SchedulerParameters=sched_interval=2,bf_interval=2
KillWait=5
MinJobAge=3600
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
NodeName=$host NodeAddr=127.0.0.1 CPUs=4 Sockets=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO PreemptMode=REQUEUE GraceTime=0
PartitionName=high Nodes=$host MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=10 PreemptMode=OFF
CONF
export SLURM_CONF=$dir/slurm.conf
setsid slurmctld -D -f "$SLURM_CONF" > "$dir/log/slurmctld.out" 2>&1 < /dev/null & echo $! > "$dir/slurmctld.pid"
setsid slurmd -D -f "$SLURM_CONF" > "$dir/log/slurmd.out" 2>&1 < /dev/null & echo $! > "$dir/slurmd.pid"
for _ in $(seq 150); do
  for name in slurmctld slurmd; do
    kill -0 "$(cat "$dir/$name.pid")" 2>/dev/null || { echo "cluster.sh: $name died:" >&2; tail -5 "$dir/log/$name.log" "$dir/log/$name.out" >&2; stop; exit 1; }
  done
  if timeout 3 sinfo -h -o %T 2>/dev/null | grep -qx idle; then
    echo "cluster.sh: SLURM up (SLURM_CONF=$SLURM_CONF)"
    exit 0
  fi
  sleep 0.2
done
echo "cluster.sh: the node did not become idle in 30 s" >&2
tail -5 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2
stop
exit 1
