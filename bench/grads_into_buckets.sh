#!/usr/bin/env bash
# Weight gradients written into the buckets by the linear layers' products (model/linear.h, the
# default) against autograd's gradients copied in (MFSDP_GRAD_INTO_BUCKETS=off): the same
# bench/train_step.sh step (GPT and Llama, 4 x 256, micro-batch 8 x 128 tokens, AdamW), one process
# and one thread, fp32 and bf16 (fp32 main weights, bf16 gradients: with grad_reduce_in_fp32 the
# gradients stay autograd's, converted by the copy), in alternating processes. Median
# step time of steps 6-STEPS and the process's peak RSS. Writes bench/results_grads_into_buckets.md.
# Needs the demo's data (scripts/demo.sh prepares it).
#   bench/grads_into_buckets.sh [ROUNDS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
STEPS=${2:-30}
MFSDP=${MFSDP:-build/bin/mfsdp}
OUT=${OUT:-bench/results_grads_into_buckets.md}
DATA=runs/demo/data/kjv
[ -f "$DATA.idx" ] || { echo "run scripts/demo.sh first (it prepares $DATA)"; exit 1; }
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
source bench/lib.sh
bench_step_models "$W"
bench_step_common "$DATA" "$STEPS"
common=("${STEP_COMMON[@]}" training.global_batch_size=8 distributed.zero_dp_strategy=no_shard)
BF16=(model.compute_dtype=bf16 distributed.preserve_fp32_weights=true)
variants=(fp32)
grep -qE "avx512_bf16|amx_bf16" /proc/cpuinfo && variants+=(bf16)
run() {  # name knob args... -> "median_ms peak_rss_mib"
  local name=$1 knob=$2; shift 2
  MFSDP_GRAD_INTO_BUCKETS=$knob "$MFSDP" train "${common[@]}" run_dir="$W/$name" "$@" > "$W/$name.log" 2>&1 ||
    { cat "$W/$name.log" >&2; exit 1; }
  python3 - "$W/$name/metrics.jsonl" "$W/$name.log" <<'PYEOF'
import json, re, statistics, sys
t = [json.loads(l)["step_time_s"] for l in open(sys.argv[1])][5:]
rss = re.findall(r"peak mem (\d+) MiB", open(sys.argv[2]).read())
print(f"{1000 * statistics.median(t):.1f} {rss[-1] if rss else '-'}")
PYEOF
}
rows=()
for arch in gpt llama; do
  for v in "${variants[@]}"; do
    extra=(model.path=$W/$arch.pt)
    [ "$v" = bf16 ] && extra+=("${BF16[@]}")
    for r in $(seq "$ROUNDS"); do
      on=$(run ${arch}_${v}_on_$r on "${extra[@]}")
      off=$(run ${arch}_${v}_off_$r off "${extra[@]}")
      read -r t_on m_on <<< "$on"
      read -r t_off m_off <<< "$off"
      ratio=$(python3 -c "print(f'{$t_on / $t_off:.3f}')")
      rows+=("| $arch $v | $r | $t_on ms, $m_on MiB | $t_off ms, $m_off MiB | $ratio |")
      echo "${rows[-1]}"
    done
  done
done
line=$(grep -o "; gradients:[^;]*" "$W/gpt_${variants[-1]}_on_1.log" | head -1)
{
  echo "# Weight gradients into the buckets by the products, against autograd's copied in"
  echo
  echo "Written by bench/grads_into_buckets.sh $ROUNDS $STEPS on $(date -u +%Y-%m-%d) ($(nproc) cores: $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)), commit $(git rev-parse --short HEAD)."
  echo "One process, one thread, median step time of steps 6-$STEPS and the process's peak RSS; the two ways alternate."
  echo "bf16: fp32 main weights, bf16 gradients; the start-up line of its run: \`${line#; }\`."
  echo
  echo "| run | round | into the buckets | MFSDP_GRAD_INTO_BUCKETS=off | ratio |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > "$OUT"
echo "wrote $OUT"
