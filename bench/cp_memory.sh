#!/usr/bin/env bash
# Context parallelism and activation memory: one long-sequence GPT run per cp size under a per-rank
# data-segment budget (ulimit -d: heap and private anonymous memory; the torch wheel's CUDA libraries
# alone map ~2.9 GB of address space, so ulimit -v no longer measures what the run allocates), all in
# one run. Writes bench/results_cp.md.
#   bench/cp_memory.sh [BUDGET_MIB] [STEPS]
# Rows: cp 1 with the model's own attention core (what runs without CP), cp 1 with mfsdp's blockwise
# attention (measurement knob MFSDP_CP_ATTENTION_AT_CP1=1: what the algorithm alone saves), cp 2 and
# cp 4 (what splitting the sequence saves on top), each with keys/values all-gathered and passed
# around the p2p ring (distributed.cp_comm_type). Global batch 1 sequence, so every rank of a run
# holds 1/cp of the same tokens; FSDP strategy 3 over the same ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET_MIB=${1:-1536}
STEPS=${2:-4}
MFSDP=${MFSDP:-build/bin/mfsdp}
OUT=bench/results_cp.md
W=$(mktemp -d)
source bench/lib.sh
bench_text_data "$W" "$MFSDP"
.venv/bin/python scripts/export_model.py --arch gpt --layers 2 --d-model 128 --heads 4 --vocab 264 --max-seq 16384 \
  --out "$W/gpt.pt" > /dev/null
common=(model.path=$W/gpt.pt data.train=$W/data data.valid_fraction=0 data.shuffle=false training.max_steps=$STEPS
        training.micro_batch_size=1 training.global_batch_size=1 training.threads=1 training.eval_every=0
        training.log_every=1000 lr_scheduler.warmup_steps=0 distributed.zero_dp_strategy=3 logging.peak_tflops=1)
budget_kib=$((BUDGET_MIB * 1024))
# name np seq [env...] -- [overrides...] -> "status peak_rss_mib median_ms loss1"
run() {
  local name=$1 np=$2 seq=$3; shift 3
  local envs=() status=ok
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  env "${envs[@]}" mpirun --oversubscribe --allow-run-as-root -np "$np" bash -c "ulimit -d $budget_kib; exec \"\$0\" \"\$@\"" \
    "$MFSDP" train "${common[@]}" training.seq_length=$seq distributed.cp_size=$np run_dir=$W/$name "$@" \
    > "$W/$name.log" 2>&1 || status=OOM
  if [ $status = OOM ] && ! grep -q "error: out of memory" "$W/$name.log"; then cat "$W/$name.log" >&2; exit 1; fi
  if [ $status = ok ]; then
    python3 - "$W/$name/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ms = 1000 * statistics.median(r["step_time_s"] for r in rows[1:])
print(f"fits {max(r['peak_mem_mib'] for r in rows):.0f} {ms:.0f} {rows[0]['loss']:.4f}")
PY
  else
    echo "out-of-memory - - -"
  fi
}
read -r _ base_rss _ _ <<< "$(run base_cp1 1 128 --)"
rows=()
for seq in 4096 6144 8192; do
  for spec in "1:model core::" "1:blockwise::MFSDP_CP_ATTENTION_AT_CP1=1" "2:all_gather:all_gather:" "2:p2p ring:p2p:" \
              "4:all_gather:all_gather:" "4:p2p ring:p2p:"; do
    IFS=: read -r cp kind comm envs <<< "$spec"
    read -r status rss ms loss <<< "$(run t${seq}_cp${cp}_${kind// /_} "$cp" "$seq" $envs -- ${comm:+distributed.cp_comm_type=$comm})"
    act=$([ "$rss" = - ] && echo - || echo $((rss - base_rss)))
    rows+=("| $seq | $cp | $kind | $status | $rss | $act | $ms | $loss |")
  done
done
{
  echo "# Context parallelism: peak memory per rank for long sequences"
  echo
  echo "GPT 2 x 128 (4 heads, learned positions up to 16384), one sequence per step, FSDP strategy 3 over"
  echo "the cp ranks, one thread per rank, fp32, $STEPS steps. Each rank runs under \`ulimit -d $budget_kib\`"
  echo "(a ${BUDGET_MIB} MiB data-segment budget: heap and private anonymous memory, LibTorch's included): a run"
  echo "that does not fit stops with an allocation error. Peak RSS is the largest process peak (MiB) over"
  echo "the steps on rank 0; step time is the median of steps 2..$STEPS. The first-step loss is the same in"
  echo "every row that fits (same tokens, same model): the rows compute the same thing."
  echo
  echo "Activations and temporaries = peak RSS minus the peak RSS of the same run at seq_length 128"
  echo "(${base_rss} MiB: LibTorch, Open MPI, model and optimizer state)."
  echo
  echo "| seq | cp | attention | budget | peak RSS MiB | activations MiB | ms/step | loss step 1 |"
  echo "|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "Measured $(date -u +%Y-%m-%d) on $(nproc) cores; this machine is shared, compare within one run."
} > "$OUT"
cat "$OUT"
rm -rf "$W"
