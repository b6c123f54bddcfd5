#!/usr/bin/env bash
# mfsdp built with sanitizers, running the unit tests and a representative set of multi-rank tests.
#   scripts/sanitize.sh [address,undefined|thread] [CTEST_REGEX]
# address,undefined (default): AddressSanitizer + UndefinedBehaviorSanitizer, errors fatal, leaks
#   reported with tests/lsan.supp (MPI's and LibTorch's own allocations at exit only).
# thread: ThreadSanitizer over the threads mfsdp starts (MPI progress, watchdog, async checkpoint
#   writer, prepare-data's workers), with tests/tsan.supp (LibTorch's and Open MPI's own code only).
# Builds into build-asan/ or build-tsan/ (a full build: ~10 minutes on 2 cores) and runs
#   the unit tests, the communicator tests at 2 and 4 ranks, the FSDP and TP/CP engine tests,
#   prepare-data's checks, and training runs of every strategy (the fixture's runs).
set -euo pipefail
cd "$(dirname "$0")/.."
san=${1:-address,undefined}
case "$san" in
  address,undefined) B=${SAN_BUILD_DIR:-build-asan} ;;
  thread) B=${SAN_BUILD_DIR:-build-tsan} ;;
  *) echo "sanitize.sh: address,undefined or thread, got $san" >&2; exit 2 ;;
esac
regex=${2:-'^(test_|prepare_data_checks$|tokenizer_ids_bpe$|tokenizer_ids_other$|run_fsdp_fp32_s[0-3]_n[24]_ovon_dboff$|run_tp2_sp_s3_n4_db$|run_cp2$|ckpt_exact_s3$|checkpoint_async$|launch_kill$)'}
PY=$(cd .venv/bin && pwd)/python
TORCH_CMAKE=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$B/CMakeCache.txt" ]; then
  cmake -S . -B "$B" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMFSDP_SANITIZE="$san" \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" -DMFSDP_PYTHON="$PY" -DCMAKE_CUDA_COMPILER="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" \
    -DCUDAToolkit_ROOT="${CUDA_HOME:-/usr/local/cuda}" > "$B.cmake.log" 2>&1 || { tail -30 "$B.cmake.log" >&2; exit 1; }
fi
cmake --build "$B" -j "${JOBS:-2}"
here=$(pwd)
# Uninstrumented LibTorch and MPI: no ODR checks across them, and leaks only from our code.
# fast_unwind_on_malloc=0: allocations made inside Open MPI and LibTorch (built without frame
# pointers) are attributed to them, so that tests/lsan.supp can recognise them.
export ASAN_OPTIONS=detect_leaks=1:detect_odr_violation=0:abort_on_error=1:allocator_may_return_null=1:fast_unwind_on_malloc=0
export LSAN_OPTIONS=suppressions=$here/tests/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS="suppressions=$here/tests/tsan.supp halt_on_error=1 second_deadlock_stack=1"
# The host memory cache reuses freed blocks, which would hide a use-after-free from ASan: off.
export MFSDP_HOST_CACHE=off
cd "$B"
ctest -R "$regex" -j "${JOBS:-2}" --output-on-failure
