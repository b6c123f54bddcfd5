#!/usr/bin/env bash
# libFuzzer over mfsdp's parsers (fuzz/), with AddressSanitizer and UndefinedBehaviorSanitizer.
#   scripts/fuzz.sh [SECONDS] [TARGET ...]     # default 60 s per target, every target
#   FUZZ_RUNS=3000 scripts/fuzz.sh              # 3000 inputs per target from seed 1 (CI: deterministic)
#   FUZZ_OPT=-O0 scripts/fuzz.sh                # faster to build, slower to run (CI: -O0, 1000 inputs)
# Targets: config tokenizer_json tiktoken encode indexed_dataset safetensors checkpoint_index compressed.
# Builds with clang into build-fuzz/ (FUZZ_BUILD_DIR), replays every kept regression input
# (fuzz/regressions/TARGET/: inputs that once crashed, fixed since), then fuzzes each target from its
# seeds (fuzz/seeds/TARGET/, plus configs/*.yaml for config) into build-fuzz/corpus/TARGET/. A crash,
# leak, UB report, timeout (10 s per input) or out-of-memory (2 GiB) fails the script and leaves the
# input in build-fuzz/artifacts/. Needs scripts/setup.sh first (the torch wheel's fmt, pcre2, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
B=${FUZZ_BUILD_DIR:-build-fuzz}
all=(config tokenizer_json tiktoken encode indexed_dataset safetensors checkpoint_index compressed)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ not found (Debian package clang)" >&2; exit 2; }
opt=${FUZZ_OPT:--O1}
if [ ! -f "$B/CMakeCache.txt" ] || ! grep -qx -- "MFSDP_FUZZ_OPT:STRING=$opt" "$B/CMakeCache.txt"; then
  fmt_inc=$(.venv/bin/python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  CXX=clang++ cmake -S fuzz -B "$B" "${generator[@]}" -DMFSDP_FMT_INCLUDE="$fmt_inc" -DMFSDP_FUZZ_OPT="$opt" \
      > "$B.cmake.log" 2>&1 ||
    { cat "$B.cmake.log" >&2; exit 1; }
fi
cmake --build "$B" -j "${JOBS:-2}" > "$B/build.log" 2>&1 || { tail -30 "$B/build.log" >&2; exit 1; }
mkdir -p "$B/artifacts"
for t in "${targets[@]}"; do
  bin="$B/fuzz_$t"
  [ -x "$bin" ] || { echo "fuzz.sh: unknown target $t (${all[*]})" >&2; exit 2; }
  corpus="$B/corpus/$t"
  mkdir -p "$corpus"
  seeds=("fuzz/seeds/$t")
  if [ "$t" = config ]; then mkdir -p "$B/seeds_config"; cp configs/*.yaml "$B/seeds_config/"; seeds+=("$B/seeds_config"); fi
  if compgen -G "fuzz/regressions/$t/*" >/dev/null; then
    "$bin" -runs=0 fuzz/regressions/"$t"/* > "$B/$t.regressions.log" 2>&1 ||
      { tail -40 "$B/$t.regressions.log" >&2; echo "fuzz.sh: $t: a kept regression input fails again" >&2; exit 1; }
  fi
  start=$(date +%s)
  # FUZZ_RUNS=N: N inputs from seed 1 instead of SECONDS of time (deterministic, for CI).
  budget=(-max_total_time="$secs")
  [ -n "${FUZZ_RUNS:-}" ] && budget=(-runs="$FUZZ_RUNS" -seed=1)
  if ! "$bin" "${budget[@]}" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
        -artifact_prefix="$B/artifacts/$t-" "$corpus" "${seeds[@]}" > "$B/$t.log" 2>&1; then
    tail -40 "$B/$t.log" >&2
    echo "fuzz.sh: $t: FAILED; the input is in $B/artifacts/ (keep it in fuzz/regressions/$t/ once fixed)" >&2
    exit 1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$B/$t.log" | grep -o '[0-9]*$' || echo '?')
  cov=$(grep -o 'cov: [0-9]*' "$B/$t.log" | tail -1 | grep -o '[0-9]*' || echo '?')
  echo "fuzz.sh: $t: $runs inputs in $(( $(date +%s) - start )) s, coverage $cov edges, corpus $(ls "$corpus" | wc -l) files: no failure"
done
