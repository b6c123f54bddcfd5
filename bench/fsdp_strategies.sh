#!/usr/bin/env bash
# Step time and per-rank memory for every zero_dp_strategy at world sizes 1, 2 and 4, against
# no_shard at the same world size, all in one run (this machine is shared: compare ratios).
# Writes bench/results_fsdp.md. Needs the demo's data (scripts/demo.sh prepares it).
#   bench/fsdp_strategies.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-15}
MFSDP=${MFSDP:-build/bin/mfsdp}
OUT=bench/results_fsdp.md
DATA=runs/demo/data/kjv
[ -f "$DATA.idx" ] || { echo "run scripts/demo.sh first (it prepares $DATA)"; exit 1; }
W=$(mktemp -d)
.venv/bin/python scripts/export_model.py --arch gpt --layers 4 --d-model 256 --heads 4 --vocab 264 --max-seq 128 \
  --out "$W/gpt.pt" > /dev/null
common=(model.path=$W/gpt.pt data.train=$DATA data.valid_fraction=0 training.max_steps=$STEPS training.micro_batch_size=8
        training.global_batch_size=32 training.seq_length=128 training.threads=1 training.eval_every=0
        training.log_every=1000 lr_scheduler.warmup_steps=0 lr_scheduler.min_lr=0 logging.peak_tflops=1)
run() {  # name np overrides...
  local name=$1 np=$2; shift 2
  mpirun --oversubscribe --allow-run-as-root -np "$np" "$MFSDP" train "${common[@]}" run_dir=$W/$name "$@" \
    > "$W/$name.log" 2>&1 || { cat "$W/$name.log" >&2; exit 1; }
}
# median step time (ms), then rank 0's memory at step 2 (MiB): weights main grads optimizer fsdp-peak rss
stats() {
  python3 - "$W/$1/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ms = 1000 * statistics.median(r["step_time_s"] for r in rows[5:])
r = rows[1]
mib = lambda b: b / 2**20
print(f"{ms:.1f} {mib(r['mem_weights']):.2f} {mib(r['mem_main_weights']):.2f} {mib(r['mem_grads']):.2f} "
      f"{mib(r['mem_optimizer']):.2f} {mib(r['mem_fsdp_peak']):.2f} {max(x['peak_mem_mib'] for x in rows):.0f}")
PY
}
rows=()
for n in 1 2 4; do
  base=""
  for s in 0 1 2 3; do
    run s${s}_n$n $n distributed.zero_dp_strategy=$s
    read -r ms w m g o p rss <<< "$(stats s${s}_n$n)"
    [ $s = 0 ] && base=$ms
    ratio=$(python3 -c "print(f'{$ms/$base:.2f}')")
    rows+=("| $n | $s | $ms | $ratio | $w | $m | $g | $o | $p | $rss |")
  done
done
extra=()
run s3_n2_ckpt 2 distributed.zero_dp_strategy=3 distributed.activation_checkpointing=true
read -r ms w m g o p rss <<< "$(stats s3_n2_ckpt)"
read -r ms0 _ _ _ _ _ rss0 <<< "$(stats s3_n2)"
extra+=("| 2 | 3 + activation checkpointing | $ms | $(python3 -c "print(f'{$ms/$ms0:.2f}')") vs strategy 3 | $w | $m | $g | $o | $p | $rss (vs $rss0) |")
# bf16 GEMMs are emulated on CPUs without AVX-512 BF16 or AMX (~70x slower than fp32 with the
# wheel's MKL on an AVX2 machine): the row would measure the emulation.
if grep -qE "avx512_bf16|amx_bf16" /proc/cpuinfo; then
  run s3_n2_bf16 2 distributed.zero_dp_strategy=3 model.compute_dtype=bf16 distributed.preserve_fp32_weights=true distributed.grad_reduce_in_fp32=true
  read -r ms w m g o p rss <<< "$(stats s3_n2_bf16)"
  extra+=("| 2 | 3, bf16 compute + fp32 main weights | $ms | $(python3 -c "print(f'{$ms/$ms0:.2f}')") vs strategy 3 fp32 | $w | $m | $g | $o | $p | $rss |")
else
  extra+=("| 2 | 3, bf16 compute | left out: this CPU has neither AVX-512 BF16 nor AMX (bf16 GEMMs are emulated) | | | | | | | |")
fi
{
  echo "# Megatron-FSDP strategies: step time and per-rank memory"
  echo
  echo "GPT 4 x 256 (3.3 M parameters, 13 MB fp32), global batch 32 x 128 tokens, micro-batch 8, AdamW, one"
  echo "thread per rank, fp32 unless stated. Median of steps 6..$STEPS. Memory is rank 0's at step 2 in MiB:"
  echo "weights, separate main weights, main gradients, optimizer state, the most the FSDP engine held during"
  echo "the step (persistent + gathered weights + gradients in flight + optimizer state), and the process's"
  echo "peak RSS (includes LibTorch, MPI and the data, ~250 MiB since CPU ranks stopped loading the CUDA libraries, and activations)."
  echo "Written by bench/fsdp_strategies.sh on $(date -u +%Y-%m-%d), $(nproc) cores: 4 ranks oversubscribe"
  echo "them, so compare step-time ratios within a world size, not across."
  echo
  echo "| world | strategy | ms/step | vs no_shard | weights | main | grads | optimizer | FSDP peak | RSS peak |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}" "${extra[@]}"
} > "$OUT"
cat "$OUT"
rm -rf "$W"
