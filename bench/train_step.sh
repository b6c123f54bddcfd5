#!/usr/bin/env bash
# One training step of mfsdp against PyTorch 2.11 eager (the same wheel mfsdp links, .venv) on the same model, data, batch and
# threads, measured side by side in one run (this machine is shared and noisy: compare ratios).
# Writes bench/results_train_step.md. Needs the demo's data (scripts/demo.sh prepares it).
#   bench/train_step.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-25}
MFSDP=${MFSDP:-build/bin/mfsdp}
OUT=bench/results_train_step.md
W=$(mktemp -d)
DATA=runs/demo/data/kjv
[ -f "$DATA.idx" ] || { echo "run scripts/demo.sh first (it prepares $DATA)"; exit 1; }
MPIRUN=(mpirun --oversubscribe --allow-run-as-root --bind-to none)
# Both sides run the wheel's LibTorch and its MKL: the comparison is of the trainers.
PY=.venv/bin/python
.venv/bin/python scripts/export_model.py --arch gpt --layers 4 --d-model 256 --heads 4 --vocab 264 --max-seq 128 \
  --out "$W/gpt.pt" > /dev/null
# Same shape as the reference figures in ../shared/reference/formats.md: 4 x 256, 4 heads, seq 128,
# micro-batch 8, AdamW, one thread per process, clipping at 1.0.
common=(model.path=$W/gpt.pt data.train=$DATA data.valid_fraction=0 training.max_steps=$STEPS training.micro_batch_size=8
        training.seq_length=128 training.threads=1 training.eval_every=0 training.log_every=1000
        lr_scheduler.warmup_steps=0 lr_scheduler.name=constant lr_scheduler.min_lr=0 optimizer.lr=1e-4 logging.peak_tflops=1
        distributed.zero_dp_strategy=no_shard)
median() { python3 -c "import json,statistics,sys; t=[json.loads(l)['step_time_s'] for l in open(sys.argv[1])][5:]; print(f'{1000*statistics.median(t):.1f}')" "$1/metrics.jsonl"; }
run_mfsdp() {  # name np extra...
  local name=$1 np=$2; shift 2
  "${MPIRUN[@]}" -np "$np" "$MFSDP" train "${common[@]}" run_dir=$W/$name "$@" > "$W/$name.log" 2>&1 || { cat "$W/$name.log" >&2; exit 1; }
  median "$W/$name"
}
run_torch() { "$PY" bench/pytorch_step.py --data "$DATA" --micro 8 --seq 128 --steps "$STEPS" --threads $THREADS "$@" | awk '{print $2}'; }

rows=()
THREADS=2
m=$(run_mfsdp m1_t2 1 training.global_batch_size=8 training.threads=2)
t=$(run_torch --procs 1)
rows+=("| 1 process, 2 threads, fp32 | $m | $t | $(python3 -c "print(f'{$m/$t:.2f}')") |")
tj=$(run_torch --procs 1 --jit "$W/gpt.pt")
rows+=("| 1 process, 2 threads, fp32, PyTorch training the same TorchScript file | $m | $tj | $(python3 -c "print(f'{$m/$tj:.2f}')") |")
THREADS=1
# bf16 GEMMs are emulated on CPUs without AVX-512 BF16 or AMX (~70x slower than fp32 with the
# wheel's MKL on an AVX2 machine): there the bf16 rows would measure the emulation, not the trainers.
variants=(fp32)
if grep -qE "avx512_bf16|amx_bf16" /proc/cpuinfo; then variants+=(bf16); else
  rows_note="bf16 rows left out: this CPU has neither AVX-512 BF16 nor AMX (bf16 matrix products are emulated)."; fi
for variant in "${variants[@]}"; do
  extra=(); textra=()
  [ $variant = bf16 ] && extra=(model.compute_dtype=bf16 distributed.preserve_fp32_weights=true distributed.grad_reduce_in_fp32=true) && textra=(--bf16)
  m1=$(run_mfsdp m1_$variant 1 training.global_batch_size=8 "${extra[@]}")
  t1=$(run_torch --procs 1 "${textra[@]}")
  m2=$(run_mfsdp m2_$variant 2 training.global_batch_size=16 "${extra[@]}")
  t2=$(run_torch --procs 2 "${textra[@]}")
  rows+=("| 1 process, 1 thread, $variant | $m1 | $t1 | $(python3 -c "print(f'{$m1/$t1:.2f}')") |")
  rows+=("| 2 processes x 1 thread, $variant (mfsdp no_shard vs DDP gloo) | $m2 | $t2 | $(python3 -c "print(f'{$m2/$t2:.2f}')") |")
done
{
  echo "# One training step: mfsdp vs PyTorch 2.11 eager (torch wheel in .venv), same machine, same run"
  echo
  echo "GPT 4 layers x 256, 4 heads, vocab 264, seq 128, micro-batch 8 per process, AdamW, grad clipping 1.0,"
  echo "KJV byte-level data, one thread per process unless the row says otherwise. Median of steps 6..$STEPS. PyTorch bf16 = autocast;"
  echo "mfsdp bf16 = bf16 compute with fp32 main weights and fp32 gradient reduction."
  echo "Written by bench/train_step.sh on $(date -u +%Y-%m-%d) ($(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))."
  echo
  echo "| run | mfsdp ms/step | PyTorch ms/step | ratio mfsdp/PyTorch |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  [ -n "${rows_note:-}" ] && echo "$rows_note" && echo
  echo "Both use the wheel's MKL ($("$PY" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())') kernels). A ratio below 1 means mfsdp is faster."
} > "$OUT"
cat "$OUT"
rm -rf "$W"
