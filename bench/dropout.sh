#!/usr/bin/env bash
# A nanoGPT-shaped model with dropout (bench/nanogpt.py: 6 x 384, 6 heads, block 256, dropout on the
# embeddings, attention probabilities and residuals, as nanoGPT's shakespeare_char config trains;
# and the same model with dropout 0), micro-batch 8 x 256 tokens, AdamW, one process with 1 and 2
# threads, in alternating processes:
#   mfsdp                 its dropout and attention (model/fast_dropout.h, model/cpu_attention.h)
#   mfsdp, ATen's         MFSDP_FAST_DROPOUT=off MFSDP_FAST_ATTENTION=off: ATen's dropout and SDPA
#   PyTorch eager         the same model, same initial weights and windows (bench/nanogpt.py step)
#   torch.compile         the same, its forward and backward through Inductor (first round only)
# Median step time of steps 6-STEPS. Writes bench/results_dropout.md. Needs the demo's data.
# ATTENTION=written: the model's attention is nanoGPT's written-out fallback (softmax(q k^T) v, its
# dropout an nn.Dropout on the probabilities; model/eager_attention.cpp), written to
# bench/results_written_attention.md.
#   [ATTENTION=written] bench/dropout.sh [ROUNDS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
STEPS=${2:-15}
MFSDP=${MFSDP:-build/bin/mfsdp}
PY=${PY:-.venv/bin/python}
ATTENTION=${ATTENTION:-sdpa}
if [ "$ATTENTION" = written ]; then OUT=${OUT:-bench/results_written_attention.md}; else OUT=${OUT:-bench/results_dropout.md}; fi
THREADS=${THREADS:-1 2}
DATA=runs/demo/data/kjv
[ -f "$DATA.idx" ] || { echo "run scripts/demo.sh first (it prepares $DATA)"; exit 1; }
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
source bench/lib.sh
bench_step_common "$DATA" "$STEPS"
common=("${STEP_COMMON[@]}" training.global_batch_size=8 training.seq_length=256 distributed.zero_dp_strategy=no_shard)
for p in 0.2 0.0; do "$PY" bench/nanogpt.py export --dropout $p --attention "$ATTENTION" --out "$W/nano_$p.pt"; done
mfsdp_ms() {  # name threads p [env...] -> median ms
  local name=$1 th=$2 p=$3; shift 3
  env "$@" "$MFSDP" train "${common[@]}" model.path="$W/nano_$p.pt" training.threads=$th run_dir="$W/$name" \
    > "$W/$name.log" 2>&1 || { cat "$W/$name.log" >&2; exit 1; }
  python3 -c "import json,statistics,sys; t=[json.loads(l)['step_time_s'] for l in open(sys.argv[1])][5:]; print(f'{1000*statistics.median(t):.1f}')" \
    "$W/$name/metrics.jsonl"
}
eager_ms() {  # threads p [--compile] -> median ms
  "$PY" bench/nanogpt.py step --data "$DATA" --dropout $2 --attention "$ATTENTION" --threads $1 --steps "$STEPS" ${3:-} 2> /dev/null |
    awk '/median_ms/ {print $2}'
}
rows=()
for p in 0.2 0.0; do
  for th in $THREADS; do
    for r in $(seq "$ROUNDS"); do
      ours=$(mfsdp_ms ours_${p}_${th}_$r $th $p)
      aten=$(mfsdp_ms aten_${p}_${th}_$r $th $p MFSDP_FAST_DROPOUT=off MFSDP_FAST_ATTENTION=off)
      eager=$(eager_ms $th $p)
      compiled=-; vs_compiled=-
      if [ "$r" = 1 ]; then
        compiled=$(eager_ms $th $p --compile)
        vs_compiled=$(python3 -c "print(f'{$ours / $compiled:.2f}')")
      fi
      rows+=("| $p | $th | $r | $ours | $aten | $eager | $compiled | $(python3 -c "print(f'{$ours / $eager:.2f}')") | $(python3 -c "print(f'{$aten / $eager:.2f}')") | $vs_compiled |")
      echo "${rows[-1]}"
    done
  done
done
kernels=$(grep -o "mfsdp's CPU kernels: .*" "$W/ours_0.2_${THREADS%% *}_1.log" | head -1)
attn=$(grep -o "mfsdp's CPU attention: [0-9]* of .*" "$W/ours_0.2_${THREADS%% *}_1.log" | head -1)
{
  if [ "$ATTENTION" = written ]; then
    echo "# Attention written out on the CPU: nanoGPT's fallback attention, mfsdp against PyTorch eager"
  else
    echo "# Dropout on the CPU: a nanoGPT-shaped model, mfsdp against PyTorch eager"
  fi
  echo
  echo "Written by bench/dropout.sh $ROUNDS $STEPS on $(date -u +%Y-%m-%d) ($(nproc) cores: $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)), commit $(git rev-parse --short HEAD), PyTorch $("$PY" -c 'import torch; print(torch.__version__)')."
  echo "bench/nanogpt.py: 6 layers x 384, 6 heads, block 256, vocab 264, exact GELU, tied head; dropout p on the"
  if [ "$ATTENTION" = written ]; then
    echo "embeddings, the attention probabilities (an nn.Dropout after the softmax) and both residuals; attention written"
    echo "out as nanoGPT's fallback writes it: \`(q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))\`, masked_fill of a"
    echo "tril buffer with -inf, F.softmax, \`att @ v\`."
  else
    echo "embeddings, the attention probabilities (SDPA's \`dropout_p=p if self.training else 0\`) and both residuals."
  fi
  echo "Micro-batch 8 x 256 tokens, AdamW, one process, median step time (ms) of steps 6-$STEPS; the runs alternate;"
  echo "torch.compile (Inductor, the optimizer eager; compilation in the first steps, outside the median) in the first round."
  echo "\"ATen's\": mfsdp with MFSDP_FAST_DROPOUT=off MFSDP_FAST_ATTENTION=off. mfsdp's start-up lines (p 0.2):"
  echo "\`$kernels\`; \`$attn\`."
  echo
  echo "| dropout | threads | round | mfsdp | mfsdp, ATen's dropout and attention | PyTorch eager | torch.compile | mfsdp / eager | ATen's / eager | mfsdp / compile |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > "$OUT"
echo "wrote $OUT"
