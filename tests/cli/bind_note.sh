#!/usr/bin/env bash
# bind_note.sh "MPIRUN..." MFSDP BASE_YAML WORKDIR: `training.threads: auto` under mpirun
# (lib/train/trainer.cpp). Under Open MPI's default binding, narrower than the job's share of the
# node per rank, a rank widens its affinity to that share and says so; under an explicit binding
# (--bind-to core) it keeps it and says how to widen it; unbound, or with threads set, it says
# nothing. Which answer is right depends on this machine's cores and on how many CPUs mpirun's core
# binding gives (one core, or one core's hardware threads being all the CPUs: no note even when
# bound); every case is checked, none skipped.
set -euo pipefail
read -r -a mpirun <<< "$1"
mfsdp=$2 base=$3 work=$4
rm -rf "$work"
mkdir -p "$work"
cores=$(nproc)  # what the test (and so mpirun's daemon) may run on
core_cpus=$("${mpirun[@]}" -np 1 --bind-to core nproc)  # CPUs of one bound core (its hardware threads)
# Physical cores among them (a core's hardware threads count once in threads: auto, as in PyTorch's default).
phys=$(for c in $(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)))'); do
         cat "/sys/devices/system/cpu/cpu$c/topology/core_cpus_list" 2>/dev/null ||
           cat "/sys/devices/system/cpu/cpu$c/topology/thread_siblings_list" 2>/dev/null || echo "cpu$c"
       done | sort -u | wc -l)
run() {  # name np mpirun-flags... -- overrides...: the run's notes and its threads line
  local name=$1 np=$2; shift 2
  local flags=()
  while [ "$1" != -- ]; do flags+=("$1"); shift; done
  shift
  "${mpirun[@]}" -np "$np" "${flags[@]}" "$mfsdp" train -c "$base" run_dir="$work/$name" training.max_steps=1 "$@" \
    > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; echo "bind_note.sh: run $name failed" >&2; exit 1; }
  grep -E "^note: (mpirun bound|Open MPI's default)|^threads: |^mfsdp train:" "$work/$name.log" || true
}
fail() { echo "bind_note.sh: $*" >&2; exit 1; }
default=$(run default 1 -- training.threads=auto)
bound=$(run bound 1 --bind-to core -- training.threads=auto)
unbound=$(run unbound 1 --bind-to none -- training.threads=auto)
fixed=$(run fixed 1 --bind-to core -- training.threads=1)
two=$(run two 2 -- training.threads=auto)
omp=$(OMP_NUM_THREADS=1 run omp 1 -- training.threads=auto)  # the environment's count, as PyTorch reads it
printf 'cores %s (physical %s), a bound core %s CPU(s)\ndefault: %s\nbound:   %s\nunbound: %s\nfixed:   %s\ntwo:     %s\nomp:     %s\n' \
  "$cores" "$phys" "$core_cpus" "$default" "$bound" "$unbound" "$fixed" "$two" "$omp"
if [ "$core_cpus" -lt "$cores" ]; then
  [[ "$default" == *"note: Open MPI's default binding put rank 0 on $core_cpus of the $cores cores this job has on the node (1 rank(s) here); with training.threads: auto it runs on its share, CPUs "* ]] ||
    fail "default binding to $core_cpus of $cores CPUs: expected the widening note"
  [[ "$default" == *" $phys threads per rank"* ]] || fail "default binding: expected $phys threads after widening"
  [[ "$bound" == *"note: mpirun bound rank 0 to $core_cpus of the $cores cores this job has on the node (1 rank(s) here): 1 thread(s) per rank; for $cores use mpirun --bind-to none or --map-by slot:PE=$cores"* ]] ||
    fail "--bind-to core, $core_cpus of $cores CPUs: expected the note"
  [[ "$bound" == *" 1 threads per rank"* ]] || fail "--bind-to core: expected the binding kept (1 thread, one core)"
else
  [[ "$default" != *"note:"* && "$bound" != *"note:"* ]] || fail "a core is every CPU here: no note expected"
fi
# Two ranks: each its half of the physical cores, or its bound core where that is no fewer.
half=$((phys / 2))
expect_two=$((half > 1 ? half : 1))
[[ "$two" == *" $expect_two threads per rank"* ]] || fail "two ranks: expected $expect_two threads per rank"
[[ "$unbound" == *" $phys threads per rank"* ]] || fail "unbound: expected $phys threads"
[[ "$unbound" != *"note:"* ]] || fail "unbound: no note expected"
[[ "$fixed" != *"note:"* ]] || fail "training.threads=1: no note expected"
[[ "$omp" == *"threads: 1 per rank from OMP_NUM_THREADS (training.threads: auto)"* && "$omp" == *" 1 threads per rank"* ]] ||
  fail "OMP_NUM_THREADS=1: expected 1 thread, said so"
echo "bind_note.sh: as expected for $cores CPU(s) on $phys core(s), $core_cpus per bound core"
