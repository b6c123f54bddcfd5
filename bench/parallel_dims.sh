#!/usr/bin/env bash
# Step time and per-rank memory of the parallel dimensions at 4 ranks, side by side in one run
# (this machine is shared: compare ratios): pure FSDP (dp_shard 4), tensor parallel (with and
# without sequence parallel), context parallel and their mixes, all with zero_dp_strategy 3 on the
# same model, data and global batch. Writes bench/results_parallel.md.
#   bench/parallel_dims.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-12}
MFSDP=${MFSDP:-build/bin/mfsdp}
OUT=bench/results_parallel.md
W=$(mktemp -d)
source bench/lib.sh
bench_text_data "$W" "$MFSDP"
.venv/bin/python scripts/export_model.py --arch gpt --layers 4 --d-model 256 --heads 4 --vocab 264 --max-seq 512 \
  --out "$W/gpt.pt" > /dev/null
common=(model.path=$W/gpt.pt data.train=$W/data data.valid_fraction=0 training.max_steps=$STEPS
        training.micro_batch_size=4 training.global_batch_size=16 training.seq_length=256 training.threads=1
        training.eval_every=0 training.log_every=1000 lr_scheduler.warmup_steps=0 distributed.zero_dp_strategy=3
        logging.peak_tflops=1)
run() {  # name overrides...
  local name=$1; shift
  mpirun --oversubscribe --allow-run-as-root -np 4 "$MFSDP" train "${common[@]}" run_dir=$W/$name "$@" \
    > "$W/$name.log" 2>&1 || { cat "$W/$name.log" >&2; exit 1; }
}
# median ms/step, rank 0 at step 2: weights, grads, optimizer (MiB), peak RSS (MiB), last loss
stats() {
  python3 - "$W/$1/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ms = 1000 * statistics.median(r["step_time_s"] for r in rows[3:])
r = rows[1]
mib = lambda b: b / 2**20
print(f"{ms:.0f} {mib(r['mem_weights']):.2f} {mib(r['mem_grads']):.2f} {mib(r['mem_optimizer']):.2f} "
      f"{max(x['peak_mem_mib'] for x in rows):.0f} {rows[-1]['loss']:.4f}")
PY
}
rows=()
base=""
for spec in "dp_shard 4:" \
            "tp 2 x dp_shard 2:distributed.tp_size=2" \
            "tp 2 + SP x dp_shard 2:distributed.tp_size=2 distributed.sequence_parallel=true" \
            "cp 2 x dp_shard 2:distributed.cp_size=2" \
            "cp 2 (p2p ring) x dp_shard 2:distributed.cp_size=2 distributed.cp_comm_type=p2p" \
            "tp 4:distributed.tp_size=4" \
            "cp 4:distributed.cp_size=4" \
            "cp 2 x tp 2 + SP:distributed.cp_size=2 distributed.tp_size=2 distributed.sequence_parallel=true"; do
  IFS=: read -r label args <<< "$spec"
  name=$(echo "$label" | tr -c 'a-z0-9' _)
  # shellcheck disable=SC2086
  run "$name" $args
  read -r ms w g o rss loss <<< "$(stats "$name")"
  [ -z "$base" ] && base=$ms
  rows+=("| $label | $ms | $(python3 -c "print(f'{$ms/$base:.2f}')") | $w | $g | $o | $rss | $loss |")
done
{
  echo "# Parallel dimensions at 4 ranks: step time and per-rank memory"
  echo
  echo "GPT 4 x 256 (4 heads, 3.4 M parameters), global batch 16 x 256 tokens in micro-batches of 4,"
  echo "zero_dp_strategy 3 over dp_shard x cp, AdamW, fp32, one thread per rank, 4 ranks on $(nproc) cores"
  echo "(oversubscribed: absolute times are not a cluster's; compare the ratios). Median of steps 4..$STEPS;"
  echo "memory is rank 0's at step 2 (MiB); the last loss is the same in every row (same computation)."
  echo
  echo "| mesh | ms/step | vs dp_shard 4 | weights | gradients | optimizer | peak RSS | loss step $STEPS |"
  echo "|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "Measured $(date -u +%Y-%m-%d). TP and CP trade compute per rank for communication inside every"
  echo "layer; on one CPU node they pay for it in time (more, smaller matmuls and blocking collectives"
  echo "on the critical path) and win memory per rank where the model or the sequence is the limit."
} > "$OUT"
cat "$OUT"
rm -rf "$W"
