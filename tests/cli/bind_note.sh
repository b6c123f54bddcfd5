#!/usr/bin/env bash
# bind_note.sh "MPIRUN..." MFSDP BASE_YAML WORKDIR: with `training.threads: auto`, a rank that mpirun
# bound to fewer cores than the job's share of the node per rank says so at start-up, naming the
# flags that give it the rest (lib/train/trainer.cpp); unbound, or with threads set, it says nothing.
# Which answer is right depends on this machine's cores (one core: no note even when bound); both
# are checked, none skipped.
set -euo pipefail
read -r -a mpirun <<< "$1"
mfsdp=$2 base=$3 work=$4
rm -rf "$work"
mkdir -p "$work"
cores=$(nproc)  # what the test (and so mpirun's daemon) may run on
run() {  # name mpirun-flags... -- overrides...: the run's output
  local name=$1; shift
  local flags=()
  while [ "$1" != -- ]; do flags+=("$1"); shift; done
  shift
  "${mpirun[@]}" -np 1 "${flags[@]}" "$mfsdp" train -c "$base" run_dir="$work/$name" training.max_steps=1 "$@" \
    > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; echo "bind_note.sh: run $name failed" >&2; exit 1; }
  grep -E "^note: mpirun bound|^mfsdp train:" "$work/$name.log" || true
}
fail() { echo "bind_note.sh: $*" >&2; exit 1; }
bound=$(run bound --bind-to core -- training.threads=auto)
unbound=$(run unbound --bind-to none -- training.threads=auto)
fixed=$(run fixed --bind-to core -- training.threads=1)
printf 'cores %s\nbound:   %s\nunbound: %s\nfixed:   %s\n' "$cores" "$bound" "$unbound" "$fixed"
if [ "$cores" -ge 2 ]; then
  [[ "$bound" == *"note: mpirun bound rank 0 to 1 of the $cores cores this job has on the node (1 rank(s) here): 1 thread(s) per rank; for $cores use mpirun --bind-to none or --map-by slot:PE=$cores"* ]] ||
    fail "bound to one of $cores cores: expected the note"
  [[ "$unbound" == *" $cores threads per rank"* ]] || fail "unbound: expected $cores threads"
else
  [[ "$bound" != *"note:"* ]] || fail "one core: no note expected"
fi
[[ "$unbound" != *"note:"* ]] || fail "unbound: no note expected"
[[ "$fixed" != *"note:"* ]] || fail "training.threads=1: no note expected"
echo "bind_note.sh: as expected for $cores core(s)"
