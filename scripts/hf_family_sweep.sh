#!/usr/bin/env bash
# A sweep of Hugging Face families beyond the CI fixtures (README "Hugging Face models"): each is
# exported with scripts/export_hf.py from a tiny config, trained by mfsdp for the tests' 20-step
# experiment (2 ranks strategy 3; TP 2; TP 2 + SP at 4 ranks; CP 2) and judged against PyTorch
# training the transformers model (tests/oracle/reference_trainer.py, 1e-5). A run mfsdp refuses
# (no plan, a window, no sdpa) is listed with its error. Needs the build's test fixtures (ctest
# made build/tests/fixture: base.yaml and its data).
#   scripts/hf_family_sweep.sh [FAMILY...]      # default: all below; results under $SWEEP (/tmp/hf_sweep)
#   scripts/hf_family_sweep.sh --real [NAME...] # shrunk copies of real models' config.json files
#                                               # (scripts/hf_real_configs.py), exported with --model-dir
#   scripts/hf_family_sweep.sh --configs DIR [NAME...]  # DIR/NAME/config.json, e.g. your own shrunk configs
# With SWEEP_IO=1 each family also goes in and out as Hugging Face files: a save_pretrained
# directory of other weights (bf16 shards) read by model.init_from (TP 2 + SP, strategy 3, 4 ranks;
# judged against PyTorch with the weights from_pretrained reads), and `export --format hf` of that
# run's checkpoint (tests/hf/check_hf_export.py: from_pretrained loads it with mfsdp's logits and
# the names save_pretrained writes).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${MFSDP_PYTHON:-.venv/bin/python}
FX=${FX:-build/tests/fixture}
OUT=${SWEEP:-/tmp/hf_sweep}
mkdir -p "$OUT/models" "$OUT/runs"
[ -f "$FX/base.yaml" ] || { echo "hf_family_sweep: $FX/base.yaml missing: run ctest first (its train fixture)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
C="vocab_size=264 hidden_size=64 intermediate_size=128 num_hidden_layers=2 num_attention_heads=4"
G="$C num_key_value_heads=2"
declare -A M=(
  [arcee]="$G" [cohere]="$G" [cohere2]="$G" [exaone4]="$G" [glm]="$G" [granite]="$G" [olmo]="$C"
  [olmo2]="$G" [olmo3]="$G" [seed_oss]="$G" [smollm3]="$G" [starcoder2]="$G" [helium]="$G head_dim=16"
  [gemma3_text]="$G head_dim=16" [ministral]="$G head_dim=16 sliding_window=8"
  [gptj]="vocab_size=264 n_embd=64 n_layer=2 n_head=4 n_positions=128 rotary_dim=8"
  [codegen]="vocab_size=264 n_embd=64 n_layer=2 n_head=4 n_positions=128 n_ctx=128 rotary_dim=8"
  [mixtral]="$G num_local_experts=4 num_experts_per_tok=2" [granitemoe]="$G num_local_experts=4 num_experts_per_tok=2"
  [qwen2_moe]="$G num_experts=4 num_experts_per_tok=2 moe_intermediate_size=32 shared_expert_intermediate_size=64"
  [qwen3_moe]="$G num_local_experts=4 num_experts_per_tok=2 moe_intermediate_size=32"
  [llama4_text]="$C intermediate_size_mlp=128 num_key_value_heads=2 head_dim=16 num_local_experts=2 attention_chunk_size=8"
  [gpt_neo]="vocab_size=264 hidden_size=64 num_layers=2 num_heads=4 attention_types=[[[\"global\",\"local\"],1]] window_size=8 max_position_embeddings=128"
  [gpt_bigcode]="vocab_size=264 n_embd=64 n_layer=2 n_head=4 n_positions=128"
  [falcon]="vocab_size=264 hidden_size=64 num_hidden_layers=2 num_attention_heads=4"
  [bloom]="vocab_size=264 hidden_size=64 n_layer=2 n_head=4"
  [deepseek_v2]="$C num_key_value_heads=4 moe_intermediate_size=32 n_routed_experts=4 n_shared_experts=1 num_experts_per_tok=2 first_k_dense_replace=1 kv_lora_rank=16 q_lora_rank=24 qk_nope_head_dim=8 qk_rope_head_dim=8 v_head_dim=8"
  [deepseek_v3]="$C num_key_value_heads=4 moe_intermediate_size=32 n_routed_experts=4 n_shared_experts=1 num_experts_per_tok=2 n_group=2 topk_group=1 first_k_dense_replace=1 kv_lora_rank=16 q_lora_rank=24 qk_nope_head_dim=8 qk_rope_head_dim=8 v_head_dim=8"
  [qwen3_next]="$G head_dim=16 num_experts=4 num_experts_per_tok=2 moe_intermediate_size=32 shared_expert_intermediate_size=64 linear_num_key_heads=2 linear_num_value_heads=4 linear_key_head_dim=8 linear_value_head_dim=8"
)
real=0 cfgdir="$OUT/configs"
if [ "${1:-}" = "--real" ]; then
  real=1; shift
  "$PY" scripts/hf_real_configs.py "$cfgdir" > "$OUT/configs.list" || exit 2
elif [ "${1:-}" = "--configs" ]; then
  [ -d "${2:-}" ] || { echo "hf_family_sweep: --configs needs a directory of NAME/config.json" >&2; exit 2; }
  real=1 cfgdir=$(cd "$2" && pwd); shift 2
  (cd "$cfgdir" && for d in */config.json; do echo "${d%/config.json}"; done) > "$OUT/configs.list"
fi
families=("$@")
if [ ${#families[@]} -eq 0 ]; then
  if [ $real = 1 ]; then families=($(cat "$OUT/configs.list")); else families=($(printf '%s\n' "${!M[@]}" | sort)); fi
fi
runs=()
train() {  # NAME NP OVERRIDES...
  local name=$1 np=$2; shift 2
  rm -rf "$OUT/runs/$name"
  if mpirun --oversubscribe -np "$np" build/bin/mfsdp train -c "$FX/base.yaml" run_dir="$OUT/runs/$name" \
       model.path="$OUT/models/$f.pt" "$@" > "$OUT/runs/$name.log" 2>&1; then
    runs+=("$OUT/runs/$name")
  else
    echo "$name: refused: $(grep -m1 'error' "$OUT/runs/$name.log" | cut -c1-240)"
  fi
}
for f in "${families[@]}"; do
  if [ $real = 1 ]; then
    [ -f "$cfgdir/$f/config.json" ] || { echo "hf_family_sweep: no config $cfgdir/$f/config.json" >&2; exit 2; }
    export_args=(--model-dir "$cfgdir/$f" --random-init)
  else
    [ -n "${M[$f]:-}" ] || { echo "hf_family_sweep: no config for $f" >&2; exit 2; }
    # shellcheck disable=SC2206  # the config keys are words
    export_args=(--family "$f" --set ${M[$f]})
  fi
  if ! "$PY" scripts/export_hf.py "${export_args[@]}" --out "$OUT/models/$f.pt" > "$OUT/models/$f.log" 2>&1; then
    echo "$f: export failed: $(tail -1 "$OUT/models/$f.log")"; continue
  fi
  train "${f}_s3_n2" 2 distributed.zero_dp_strategy=3
  if grep -q "tp plan stored" "$OUT/models/$f.log"; then
    train "${f}_tp2_s1_n2" 2 distributed.tp_size=2 distributed.zero_dp_strategy=1
    train "${f}_tp2_sp_s3_n4" 4 distributed.tp_size=2 distributed.sequence_parallel=true distributed.zero_dp_strategy=3
  fi
  train "${f}_cp2_s2_n2" 2 distributed.cp_size=2 distributed.zero_dp_strategy=2
  if [ "${SWEEP_IO:-0}" = 1 ]; then
    "$PY" tests/hf/make_init_weights.py --one "$OUT/models/$f.pt" "$OUT/models/${f}_pretrained" \
      > "$OUT/models/${f}_pretrained.log" 2>&1 \
      || { echo "${f}: save_pretrained failed: $(tail -1 "$OUT/models/${f}_pretrained.log")"; continue; }
    tp_io=()  # the widest layout that trained above: TP 2 + SP, else TP 2, else none
    if [ -f "$OUT/runs/${f}_tp2_sp_s3_n4/metrics.jsonl" ]; then tp_io=(distributed.tp_size=2 distributed.sequence_parallel=true)
    elif [ -f "$OUT/runs/${f}_tp2_s1_n2/metrics.jsonl" ]; then tp_io=(distributed.tp_size=2); fi
    rm -rf "$OUT/runs/${f}_io_ckpt"
    train "${f}_init_s3_n4" 4 distributed.zero_dp_strategy=3 "${tp_io[@]}" model.init_from="$OUT/models/${f}_pretrained" \
      checkpoint.dir="$OUT/runs/${f}_io_ckpt" checkpoint.save_final=true checkpoint.resume=none
    if [ -d "$OUT/runs/${f}_io_ckpt" ]; then
      if "$PY" tests/hf/check_hf_export.py --mfsdp build/bin/mfsdp --checkpoint "$OUT/runs/${f}_io_ckpt" \
           --work "$OUT/runs/${f}_export" > "$OUT/runs/${f}_export.log" 2>&1; then
        echo "${f}: export --format hf: $(grep -c '^ok' "$OUT/runs/${f}_export.log") checks passed"
      else
        echo "${f}: export --format hf FAILED: $(grep -m2 FAIL "$OUT/runs/${f}_export.log" | tr '\n' ' ' | cut -c1-300)"
      fi
    fi
  fi
done
[ ${#runs[@]} -gt 0 ] || { echo "hf_family_sweep: no run trained" >&2; exit 1; }
"$PY" tests/oracle/reference_trainer.py --runs "${runs[@]}"
