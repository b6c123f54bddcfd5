#!/usr/bin/env bash
# mkl_dispatch.sh MFSDP BASE_YAML WORKDIR: the start-up line says how MKL chose its kernels, and it
# says what this CPU must give (lib/train/system.cpp): on Intel's CPUs MKL's own choice, unremarked;
# on another vendor's CPU with AVX-512, kernels by instruction set (mfsdp answers MKL's vendor
# check), and its generic ones under MFSDP_MKL_DISPATCH=vendor; on one without, MKL's own choice;
# without MKL, nothing about it. Both
# answers are checked on every machine: which line is right depends on the machine, not skipped.
set -euo pipefail
mfsdp=$1 base=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
vendor=$(awk -F': *' '/^vendor_id/ { print $2; exit }' /proc/cpuinfo 2>/dev/null || true)
avx512=yes
for f in avx512f avx512cd avx512bw avx512dq avx512vl; do grep -qw $f /proc/cpuinfo 2>/dev/null || avx512=no; done
line() {  # the "mfsdp train:" line of a one-step run with MFSDP_MKL_DISPATCH=$1
  MFSDP_MKL_DISPATCH=$1 "$mfsdp" train -c "$base" run_dir="$work/run_$1" training.max_steps=1 > "$work/log_$1" 2>&1 ||
    { cat "$work/log_$1"; echo "mkl_dispatch.sh: the run with MFSDP_MKL_DISPATCH=$1 failed" >&2; exit 1; }
  grep "^mfsdp train:" "$work/log_$1" || { echo "mkl_dispatch.sh: no start-up line" >&2; exit 1; }
}
isa=$(line isa)
own=$(line vendor)
echo "vendor_id $vendor, AVX-512 (F CD BW DQ VL) $avx512"
printf 'isa:    %s\nvendor: %s\n' "$isa" "$own"
fail() { echo "mkl_dispatch.sh: $*" >&2; exit 1; }
if [[ "$isa" != *" MKL"* ]]; then
  [[ "$isa" != *"kernels by"* && "$isa" != *"generic kernels"* ]] || fail "no MKL, yet the line speaks of its kernels"
elif [ "$vendor" = GenuineIntel ]; then
  [[ "$isa" == *", MKL, CPU kernels"* && "$own" == *", MKL, CPU kernels"* ]] || fail "Intel CPU: expected MKL unremarked"
elif [ "$avx512" = yes ]; then
  [[ "$isa" == *"MKL (kernels by instruction set on this $vendor CPU; MFSDP_MKL_DISPATCH=vendor: MKL's own choice)"* ]] ||
    fail "$vendor CPU with AVX-512: expected MKL's kernels by instruction set"
  [[ "$own" == *"MKL (its generic kernels on this $vendor CPU (MFSDP_MKL_DISPATCH=vendor))"* ]] ||
    fail "$vendor CPU, MFSDP_MKL_DISPATCH=vendor: expected MKL's generic kernels"
else
  [[ "$isa" == *"MKL (its own choice on this $vendor CPU without AVX-512)"* ]] ||
    fail "$vendor CPU without AVX-512: expected MKL's own choice"
fi
echo "mkl_dispatch.sh: as expected for this CPU"
