#!/usr/bin/env bash
# Hugging Face models as their users train them: the transformers model exported unchanged by
# scripts/export_hf.py and trained by mfsdp, against the same transformers model trained in PyTorch
# eager and torch.compile (bench/pytorch_step.py --hf: the Python model, not the trace, with the
# file's initial weights), same wheel, data, batch and threads, side by side in one run.
#   Llama (grouped-query attention: 4 heads, 2 key/value heads; RoPE, RMSNorm, SwiGLU)
#   Qwen2 (the same with q/k/v biases and a tied head)
#   GPT-2 (Conv1D layers, learned positions, tanh GELU, tied head)
# all 4 layers x 256, vocabulary 264, seq 128, micro-batch 8 per process, AdamW, clipping 1.0 (the
# shape of bench/train_step.sh). Median step time of steps 6..STEPS. Writes bench/results_hf_step.md.
# Needs the demo's data (scripts/demo.sh prepares it).
#   bench/hf_step.sh [STEPS]
#   ROWS=1t,2t,dp2 MODELS="llama qwen2 gpt2" bench/hf_step.sh
# ATTENTION=eager: exported and trained by PyTorch with attn_implementation="eager" (softmax(q k^T) v
# written out; the export routes it through mfsdp::attention), written to OUT (default
# bench/results_hf_step_eager.md).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-25}
MFSDP=${MFSDP:-build/bin/mfsdp}
PY=${PY:-.venv/bin/python}
ROWS=${ROWS:-1t,2t,dp2}
MODELS=${MODELS:-llama qwen2 gpt2}
ATTENTION=${ATTENTION:-auto}
if [ "$ATTENTION" = eager ]; then OUT=${OUT:-bench/results_hf_step_eager.md}; else OUT=${OUT:-bench/results_hf_step.md}; fi
want() { [[ ",$ROWS," == *",$1,"* ]]; }
DATA=runs/demo/data/kjv
[ -f "$DATA.idx" ] || { echo "run scripts/demo.sh first (it prepares $DATA)"; exit 1; }
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
MPIRUN=(mpirun --oversubscribe --allow-run-as-root --bind-to none)
source bench/lib.sh
bench_step_common "$DATA" "$STEPS"
common=("${STEP_COMMON[@]}" distributed.zero_dp_strategy=no_shard)
shape=(hidden_size=256 num_hidden_layers=4 num_attention_heads=4 vocab_size=264 max_position_embeddings=128)
export_one() {  # family -> $W/family.pt
  case $1 in
    llama) args=(--family llama --set "${shape[@]}" num_key_value_heads=2 intermediate_size=688) ;;
    qwen2) args=(--family qwen2 --set "${shape[@]}" num_key_value_heads=2 intermediate_size=688 tie_word_embeddings=true) ;;
    gpt2) args=(--family gpt2 --set vocab_size=264 n_embd=256 n_layer=4 n_head=4 n_positions=128) ;;
    *) echo "unknown model $1 (llama, qwen2, gpt2)" >&2; exit 2 ;;
  esac
  "$PY" scripts/export_hf.py "${args[@]}" --attention "$ATTENTION" --out "$W/$1.pt" > "$W/export_$1.log" 2>&1 || { cat "$W/export_$1.log" >&2; exit 1; }
}
median() { python3 -c "import json,statistics,sys; t=[json.loads(l)['step_time_s'] for l in open(sys.argv[1])][5:]; print(f'{1000*statistics.median(t):.1f}')" "$1/metrics.jsonl"; }
run_mfsdp() {  # name np extra...
  local name=$1 np=$2; shift 2
  local launch=("${MPIRUN[@]}" -np "$np")
  [ "$np" = 1 ] && launch=()  # one process starts as PyTorch's does, without a launcher
  "${launch[@]}" "$MFSDP" train "${common[@]}" run_dir=$W/$name "$@" > "$W/$name.log" 2>&1 || { cat "$W/$name.log" >&2; exit 1; }
  median "$W/$name"
}
run_torch() { "$PY" bench/pytorch_step.py --data "$DATA" --micro 8 --seq 128 --steps "$STEPS" "$@" 2> "$W/torch.err" | awk '{print $2}'
              [ "${PIPESTATUS[0]}" = 0 ] || { cat "$W/torch.err" >&2; exit 1; }; }
ratio() { python3 -c "print(f'{$1/$2:.2f}')"; }
rows=()
lines=()
row() {  # label mfsdp-ms torch-args...
  local label=$1 m=$2; shift 2
  local te tc
  te=$(run_torch "$@"); tc=$(run_torch "$@" --compile)
  rows+=("| $label | $m | $te | $tc | $(ratio $m $te) | $(ratio $m $tc) |")
  echo "${rows[-1]}"
}
for model in $MODELS; do
  export_one $model
  f=$W/$model.pt
  if want 1t; then
    m=$(run_mfsdp ${model}_1t 1 training.global_batch_size=8 model.path=$f)
    row "$model, 1 process x 1 thread" "$m" --hf "$f" --threads 1
    lines+=("$model: \`$(grep -o "mfsdp's CPU kernels: .*" "$W/${model}_1t.log" | head -1)\`; \`$(grep -o "mfsdp's CPU attention: [0-9]* of .*" "$W/${model}_1t.log" | head -1)\`; \`$(grep -o "gradients: the products of .*" "$W/${model}_1t.log" | head -1)\`")
  fi
  if want 2t; then
    m=$(run_mfsdp ${model}_2t 1 training.global_batch_size=8 training.threads=2 model.path=$f)
    row "$model, 1 process x 2 threads" "$m" --hf "$f" --threads 2
  fi
  if want dp2; then
    m=$(run_mfsdp ${model}_dp2 2 training.global_batch_size=16 model.path=$f)
    row "$model, 2 processes x 1 thread: mfsdp no_shard vs DDP (gloo)" "$m" --hf "$f" --threads 1 --procs 2
  fi
done
{
  echo "# Hugging Face models: mfsdp vs the same transformers model in PyTorch eager and torch.compile, same run"
  echo
  echo "Written by ATTENTION=$ATTENTION ROWS=$ROWS MODELS=\"$MODELS\" bench/hf_step.sh $STEPS on $(date -u +%Y-%m-%d) ($(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)),"
  echo "mfsdp of commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- lib apps || echo ' with uncommitted changes'), PyTorch $("$PY" -c 'import torch; print(torch.__version__)'), transformers $("$PY" -c 'import transformers; print(transformers.__version__)')."
  echo "Each model exported by scripts/export_hf.py from a config (4 layers x 256, 4 heads, vocabulary 264; Llama and"
  echo "Qwen2 with 2 key/value heads and an MLP of 688); mfsdp trains the file, PyTorch the transformers model built"
  echo "from the config the file holds, with its initial weights (bench/pytorch_step.py --hf; attention: $ATTENTION). Seq 128,"
  echo "micro-batch 8 per process, AdamW, clipping 1.0, KJV byte-level data, fp32; median ms per step of steps 6..$STEPS."
  echo "torch.compile: the model through Inductor, the optimizer eager, compilation outside the median."
  echo
  echo "| run | mfsdp ms/step | PyTorch eager ms/step | torch.compile ms/step | mfsdp/eager | mfsdp/compile |"
  echo "|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "mfsdp's start-up lines (one thread):"
  echo
  for l in "${lines[@]}"; do echo "- $l"; done
} > "$OUT"
echo "wrote $OUT"
