#!/usr/bin/env bash
# Grouped-query attention under context parallelism: the keys/values a rank exchanges and holds with
# their own head count (the grouped blocks) against the same heads repeated to the query heads first
# (measurement knob MFSDP_CP_GQA=repeat: what mfsdp did before), side by side in one run. A Hugging
# Face Llama (scripts/export_hf.py; its sdpa call takes the shared heads with enable_gqa), one
# sequence per step, cp 2 at 2 ranks, both exchanges. Writes bench/results_cp_gqa.md.
#   bench/cp_gqa.sh [SEQ] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ=${1:-4096}
STEPS=${2:-4}
MFSDP=${MFSDP:-build/bin/mfsdp}
OUT=bench/results_cp_gqa.md
W=$(mktemp -d)
source bench/lib.sh
bench_text_data "$W" "$MFSDP"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
rows=()
for kv in 2 1; do
  .venv/bin/python scripts/export_hf.py --family llama --set vocab_size=264 hidden_size=256 intermediate_size=512 \
    num_hidden_layers=2 num_attention_heads=8 num_key_value_heads=$kv max_position_embeddings=$SEQ \
    --out "$W/llama_kv$kv.pt" > /dev/null 2>&1
  for comm in all_gather p2p; do
    for mode in grouped repeat; do
      name=kv${kv}_${comm}_${mode}
      envs=(MFSDP_CP_GQA=$mode)
      env "${envs[@]}" mpirun --oversubscribe -np 2 -x MFSDP_CP_GQA "$MFSDP" train model.path="$W/llama_kv$kv.pt" \
        data.train=$W/data data.valid_fraction=0 data.shuffle=false training.max_steps=$STEPS \
        training.seq_length=$SEQ training.micro_batch_size=1 training.global_batch_size=1 training.threads=1 \
        training.eval_every=0 training.log_every=1000 lr_scheduler.warmup_steps=0 distributed.zero_dp_strategy=3 \
        distributed.cp_size=2 distributed.cp_comm_type=$comm logging.peak_tflops=1 run_dir=$W/$name > "$W/$name.log" 2>&1 \
        || { cat "$W/$name.log" >&2; exit 1; }
      r=$(python3 - "$W/$name/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ms = 1000 * statistics.median(r["step_time_s"] for r in rows[1:])
print(f"{max(r['peak_mem_mib'] for r in rows):.0f} | {ms:.0f} | {rows[0]['loss']:.6f} | {rows[-1]['loss']:.6f}")
PY
)
      # keys + values exchanged per layer per direction, fp32: 2 x heads x (SEQ/2) x head_dim x 4 bytes
      heads=$([ $mode = grouped ] && echo $kv || echo 8)
      kib=$((2 * heads * SEQ / 2 * 32 * 4 / 1024))
      rows+=("| $kv | $((8 / kv)) | $comm | $mode | $kib | $r |")
    done
  done
done
{
  echo "# Context parallelism with grouped-query attention: shared key/value heads exchanged as they are"
  echo
  echo "Hugging Face Llama 2 x 256 (8 query heads of 32, key/value heads below, vocabulary 264), seq_length"
  echo "$SEQ, one sequence per step, cp 2 at 2 ranks, FSDP strategy 3, one thread per rank, fp32, $STEPS steps."
  echo "grouped: the blocks read each group's one key/value head (what mfsdp does); repeat: the heads"
  echo "repeated to the query heads before the blocks (MFSDP_CP_GQA=repeat, mfsdp before 2026-12-03)."
  echo "K/V KiB: the keys and values of one layer a rank sends (all_gather: once; p2p: per ring step),"
  echo "computed from the shapes. Peak RSS (MiB) is rank 0's largest; step time the median of steps 2..$STEPS."
  echo "Equal losses in a pair: the two compute the same thing."
  echo
  echo "| kv heads | G | exchange | blocks | K/V KiB | peak RSS MiB | ms/step | loss step 1 | loss step $STEPS |"
  echo "|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "Measured $(date -u +%Y-%m-%d) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs));"
  echo "command: bench/cp_gqa.sh $SEQ $STEPS. This machine is shared: compare within one run."
} > "$OUT"
cat "$OUT"
rm -rf "$W"
