#!/usr/bin/env bash
# One training step of mfsdp against PyTorch 2.11 eager and torch.compile (the same wheel mfsdp links, .venv) on the same
# model, data, batch and threads, measured side by side in one run (this machine is shared and noisy: compare ratios).
# Writes bench/results_train_step.md. Needs the demo's data (scripts/demo.sh prepares it).
#   bench/train_step.sh [STEPS]
#   ROWS=1t,2t bench/train_step.sh      # only these rows (of 1t 2t dp2 s3 ga4 file long; default all), into OUT
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-25}
MFSDP=${MFSDP:-build/bin/mfsdp}
ROWS=${ROWS:-1t,2t,dp2,s3,ga4,file,long}
OUT=${OUT:-bench/results_train_step.md}
want() { [[ ",$ROWS," == *",$1,"* ]]; }
W=$(mktemp -d)
DATA=runs/demo/data/kjv
[ -f "$DATA.idx" ] || { echo "run scripts/demo.sh first (it prepares $DATA)"; exit 1; }
MPIRUN=(mpirun --oversubscribe --allow-run-as-root --bind-to none)
# Both sides run the wheel's LibTorch and its MKL: the comparison is of the trainers.
PY=.venv/bin/python
# The shape of the reference figures (bench/lib.sh), clipping at 1.0.
source bench/lib.sh
bench_step_models "$W"
bench_step_common "$DATA" "$STEPS"
common=("${STEP_COMMON[@]}")
median() { python3 -c "import json,statistics,sys; t=[json.loads(l)['step_time_s'] for l in open(sys.argv[1])][5:]; print(f'{1000*statistics.median(t):.1f}')" "$1/metrics.jsonl"; }
run_mfsdp() {  # name np extra...
  local name=$1 np=$2; shift 2
  # One process starts as PyTorch does, without a launcher (MPI's singleton init): under `mpirun
  # --bind-to none` the launcher and its progress took time from two busy threads on two cores
  # (GPT fp32, 2 threads: 141-153 against 110-112 ms started directly, 2026-12-05).
  local launch=("${MPIRUN[@]}" -np "$np")
  [ "$np" = 1 ] && launch=()
  "${launch[@]}" "$MFSDP" train "${common[@]}" run_dir=$W/$name "$@" > "$W/$name.log" 2>&1 || { cat "$W/$name.log" >&2; exit 1; }
  median "$W/$name"
}
run_torch() { "$PY" bench/pytorch_step.py --data "$DATA" --micro "${MICRO:-8}" --seq "${SEQ:-128}" --steps "$STEPS" "$@" 2> "$W/torch.err" | awk '{print $2}'
              [ "${PIPESTATUS[0]}" = 0 ] || { cat "$W/torch.err" >&2; exit 1; }; }
ratio() { python3 -c "print(f'{$1/$2:.2f}')"; }

rows=()
# bf16 GEMMs are emulated on CPUs without AVX-512 BF16 or AMX (~70x slower than fp32 with the
# wheel's MKL on an AVX2 machine): there the bf16 rows would measure the emulation, not the trainers.
variants=(fp32)
if grep -qE "avx512_bf16|amx_bf16" /proc/cpuinfo; then variants+=(bf16); else
  rows_note="bf16 rows left out: this CPU has neither AVX-512 BF16 nor AMX (bf16 matrix products are emulated)."; fi
# mfsdp's binary links jemalloc (DESIGN.md section 7); PyTorch runs with glibc's malloc unless
# preloaded. The jemalloc column gives PyTorch eager the same malloc (LD_PRELOAD), when it is here.
JEMALLOC=$(ldconfig -p 2>/dev/null | awk '/libjemalloc.so.2 / { print $NF; exit }')
# mfsdp's binary also answers MKL's vendor check on CPUs with AVX-512 not made by Intel, so that MKL picks its
# kernels by instruction set (lib/train/system.cpp; ~10% faster products on an AMD EPYC). The
# "eager + mfsdp's settings" column gives PyTorch eager both: jemalloc and that answer, preloaded.
PRELOAD=$JEMALLOC
avx512=yes
for f in avx512f avx512cd avx512bw avx512dq avx512vl; do grep -qw $f /proc/cpuinfo || avx512=no; done
if ! grep -q GenuineIntel /proc/cpuinfo && [ $avx512 = yes ] && command -v cc > /dev/null; then
  echo 'int mkl_serv_intel_cpu_true(void) { return 1; }' > "$W/mkl_isa.c"
  cc -shared -fPIC -O2 "$W/mkl_isa.c" -o "$W/libmkl_isa.so" && PRELOAD="$PRELOAD${PRELOAD:+:}$W/libmkl_isa.so"
fi
row() {  # label mfsdp-ms torch-args...: one row, PyTorch eager and torch.compile of the same run
  local label=$1 m=$2; shift 2
  local te tc tj=- rj=-
  te=$(run_torch "$@"); tc=$(run_torch "$@" --compile)
  if [ -n "$PRELOAD" ]; then tj=$(LD_PRELOAD=$PRELOAD run_torch "$@"); rj=$(ratio $m $tj); fi
  rows+=("| $label | $m | $te | $tc | $tj | $(ratio $m $te) | $(ratio $m $tc) | $rj |")
}
for arch in gpt llama; do
  for variant in "${variants[@]}"; do
    extra=(model.path=$W/$arch.pt); textra=(--arch $arch)
    [ $variant = bf16 ] && extra+=(model.compute_dtype=bf16 distributed.preserve_fp32_weights=true distributed.grad_reduce_in_fp32=true) && textra+=(--bf16)
    if want 1t; then
      m=$(run_mfsdp ${arch}_1t_$variant 1 training.global_batch_size=8 "${extra[@]}" distributed.zero_dp_strategy=no_shard)
      row "$arch, 1 process x 1 thread, $variant" "$m" --threads 1 --procs 1 "${textra[@]}"
    fi
    if want 2t; then
      m=$(run_mfsdp ${arch}_2t_$variant 1 training.global_batch_size=8 training.threads=2 "${extra[@]}" distributed.zero_dp_strategy=no_shard)
      row "$arch, 1 process x 2 threads, $variant" "$m" --threads 2 --procs 1 "${textra[@]}"
    fi
    if want dp2; then
      m=$(run_mfsdp ${arch}_dp2_$variant 2 training.global_batch_size=16 "${extra[@]}" distributed.zero_dp_strategy=no_shard)
      row "$arch, 2 processes x 1 thread, $variant: mfsdp no_shard vs DDP (gloo)" "$m" --threads 1 --procs 2 "${textra[@]}"
    fi
    if want s3; then
      m=$(run_mfsdp ${arch}_s3_$variant 4 training.global_batch_size=32 "${extra[@]}" distributed.zero_dp_strategy=optim_grads_params)
      row "$arch, 4 processes x 1 thread, $variant: mfsdp optim_grads_params vs FSDP2 (gloo)" "$m" --threads 1 --procs 4 --fsdp "${textra[@]}"
    fi
    if want ga4; then
      # Gradient accumulation: 4 micro-batches of 8 per step, one process x 1 thread (the optimizer's
      # and the step's fixed costs spread over four forward-backward passes).
      m=$(run_mfsdp ${arch}_ga4_$variant 1 training.global_batch_size=32 "${extra[@]}" distributed.zero_dp_strategy=no_shard)
      row "$arch, 1 process x 1 thread, 4 micro-batches per step, $variant" "$m" --threads 1 --procs 1 --accum 4 "${textra[@]}"
    fi
  done
done
if want file; then
  m=$(run_mfsdp gpt_1t_file 1 training.global_batch_size=8 model.path=$W/gpt.pt distributed.zero_dp_strategy=no_shard)
  t=$(run_torch --threads 1 --procs 1 --jit "$W/gpt.pt")
  rows+=("| gpt, 1 process x 1 thread, fp32, PyTorch training the same TorchScript file | $m | $t | - | - | $(ratio $m $t) | - | - |")
fi
if want long; then
  # Longer sequences, where attention is a larger share of the step: 6 x 384, 6 heads, seq 512,
  # micro-batch 2 (the same 1024 tokens per step as above), 1 process x 1 thread, fp32. mfsdp's
  # attention recomputes its probabilities from a log-sum-exp here (model/cpu_attention.cpp).
  long_args="layers=6 d_model=384 heads=6 vocab=264 max_seq=512"
  for arch in gpt llama; do
    .venv/bin/python scripts/export_model.py --arch $arch --layers 6 --d-model 384 --heads 6 --vocab 264 --max-seq 512 \
      --out "$W/${arch}_long.pt" > /dev/null
    m=$(run_mfsdp ${arch}_long 1 training.global_batch_size=2 training.micro_batch_size=2 training.seq_length=512 \
        model.path=$W/${arch}_long.pt distributed.zero_dp_strategy=no_shard)
    MICRO=2 SEQ=512 row "$arch 6 x 384 (6 heads), seq 512, micro-batch 2, 1 process x 1 thread, fp32" "$m" \
      --threads 1 --procs 1 --arch $arch --model-args "$long_args"
  done
fi
{
  echo "# One training step: mfsdp vs PyTorch 2.11 eager and torch.compile (torch wheel in .venv), same machine, same run"
  echo
  echo "GPT and Llama, 4 layers x 256, 4 heads, vocab 264, seq 128, micro-batch 8 per process, AdamW, grad clipping 1.0,"
  echo "(the \"seq 512\" rows: 6 x 384, 6 heads, seq 512, micro-batch 2), KJV byte-level data. Median of steps 6..$STEPS. torch.compile: the model (forward and backward through Inductor),"
  echo "the optimizer eager; compilation falls in the first steps, outside the median. PyTorch bf16 = autocast (FSDP2:"
  echo "bf16 parameters, fp32 reduction); mfsdp bf16 = bf16 compute with fp32 main weights and fp32 gradient reduction."
  echo "mfsdp's binary links jemalloc as its malloc and, on a CPU with AVX-512 not made by Intel, makes MKL pick its kernels by instruction set;"
  echo "\"eager + mfsdp's settings\" is PyTorch eager with both preloaded (LD_PRELOAD: $(echo "${PRELOAD:-nothing}" | sed "s|$W/||g"))."
  echo "Written by ROWS=$ROWS bench/train_step.sh $STEPS on $(date -u +%Y-%m-%d) ($(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), mfsdp of commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- lib apps || echo ' with uncommitted changes')."
  echo
  echo "| run | mfsdp ms/step | PyTorch eager ms/step | torch.compile ms/step | eager + mfsdp's settings ms/step | mfsdp/eager | mfsdp/compile | mfsdp/(eager + mfsdp's settings) |"
  echo "|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  [ -n "${rows_note:-}" ] && echo "$rows_note" && echo
  echo "Both use the wheel's MKL ($("$PY" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())') kernels). A ratio below 1 means mfsdp is faster."
} > "$OUT"
cat "$OUT"
rm -rf "$W"
