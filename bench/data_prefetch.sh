#!/usr/bin/env bash
# The batch prefetch thread (data.prefetch_steps) against reading on the main thread
# (data.prefetch_steps=0): per-step time waited for the batches (metrics.jsonl data_wait_s) and
# step time, in one run, runs interleaved (A B A B) on this shared machine. Writes
# bench/results_prefetch.md.
#   bench/data_prefetch.sh [STEPS]
# The step is made short against its data on purpose: a 2-layer GPT (d 128), sequences of 1024
# tokens, 4 micro-batches of 8 per rank, a blend of three datasets, 1 thread per rank. Rows: 1 rank,
# and 2 ranks data-parallel.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-30}
MFSDP=${MFSDP:-build/bin/mfsdp}
OUT=bench/results_prefetch.md
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
source bench/lib.sh
bench_text_data "$W" "$MFSDP"
.venv/bin/python scripts/export_model.py --arch gpt --layers 2 --d-model 128 --heads 4 --vocab 264 --max-seq 1024 \
  --out "$W/gpt.pt" > /dev/null
run() {  # name np prefetch
  local name=$1 np=$2 pf=$3
  mpirun --oversubscribe --allow-run-as-root -np "$np" "$MFSDP" train model.path="$W/gpt.pt" \
    "data.train=[0.5, $W/data, 0.3, $W/data, 0.2, $W/data]" data.valid_fraction=0 data.prefetch_steps="$pf" \
    training.max_steps="$STEPS" training.micro_batch_size=8 training.global_batch_size=$((32 * np)) \
    training.seq_length=1024 training.threads=1 training.eval_every=0 training.log_every=1000 \
    lr_scheduler.warmup_steps=0 logging.peak_tflops=1 run_dir="$W/$name" > "$W/$name.log" 2>&1 ||
    { cat "$W/$name.log" >&2; exit 1; }
}
# "median step ms, mean data wait ms" over steps 3.. (step 1 reads its batches before any overlap)
stats() {
  python3 - "$W/$1/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][2:]
print(f"{1000 * statistics.median(r['step_time_s'] for r in rows):.1f} "
      f"{1000 * statistics.mean(r['data_wait_s'] for r in rows):.3f}")
PY
}
lines=()
for np in 1 2; do
  for rep in 1 2; do
    run "main_${np}_$rep" "$np" 0
    run "thread_${np}_$rep" "$np" 2
  done
  read -r m1 w1 < <(stats "main_${np}_1")
  read -r m2 w2 < <(stats "main_${np}_2")
  read -r t1 u1 < <(stats "thread_${np}_1")
  read -r t2 u2 < <(stats "thread_${np}_2")
  main_ms=$(echo "scale=1; ($m1 + $m2) / 2" | bc)
  thread_ms=$(echo "scale=1; ($t1 + $t2) / 2" | bc)
  main_wait=$(echo "scale=3; ($w1 + $w2) / 2" | bc)
  thread_wait=$(echo "scale=3; ($u1 + $u2) / 2" | bc)
  lines+=("| $np | $main_ms | $main_wait | $thread_ms | $thread_wait | $(echo "scale=3; $thread_ms / $main_ms" | bc) |")
done
{
  echo "# Batch prefetch thread"
  echo
  echo "Measured $(date -u +%Y-%m-%d) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')),"
  echo "commit $(git rev-parse --short HEAD), \`bench/data_prefetch.sh $STEPS\`: a 2-layer GPT (d 128), 4 micro-batches"
  echo "of 8 x 1024 tokens per rank from a blend of three datasets, 1 thread per rank, $STEPS steps; medians of"
  echo "step time and means of \`data_wait_s\` over steps 3-$STEPS, each the average of two runs interleaved"
  echo "with the other setting's."
  echo
  echo "| ranks | step (ms), main thread reads | wait for batches (ms/step) | step (ms), prefetch thread | wait for batches (ms/step) | step ratio |"
  echo "|---|---|---|---|---|---|"
  printf '%s\n' "${lines[@]}"
} > "$OUT"
cat "$OUT"
