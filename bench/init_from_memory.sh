#!/usr/bin/env bash
# model.init_from and memory: the per-rank peak RSS of starting a run from a safetensors file, all
# rows in one run. Writes bench/results_init_from.md.
#   bench/init_from_memory.sh [LAYERS] [D_MODEL] [NP]
# The model: the project's own Llama export (no buffers, so it loads on the meta device), about
# 330 M parameters by default (1.3 GB in fp32), its weights written to a safetensors file. Rows, each
# NP ranks, zero_dp_strategy 3, SGD without momentum (no optimizer state), one step of 1 x 16 tokens:
#   baseline   the same launcher on a 2-layer toy model: what LibTorch, MPI and the data cost;
#   file       the weights from the TorchScript file (every rank loads the whole model first);
#   rules      init_fsdp_with_meta_device alone (mfsdp's initialisation rules, no weights read);
#   meta       init_fsdp_with_meta_device + model.init_from: each rank maps the file and copies
#              only its shard (the full model is never built).
#   hf_file    the same shape as a Hugging Face LlamaForCausalLM (scripts/export_hf.py, traced: tensor
#              constants and rotary buffers), its weights from the TorchScript file;
#   hf_meta    that model on the meta device + model.init_from of its save_pretrained directory
#              (sharded safetensors with an index, bf16 as HF writes by default: converted on read).
#   The automatic units of these rows are the layers plus the embedding table and the output head,
#   each a unit of its own (each holds more than a layer), so that strategy 3 gathers each alone;
#   meta_layers, hf_layers   the meta rows with the layers alone as units
#              (distributed.megatron_fsdp_unit_modules), the embedding and head then gathered
#              together for the whole step (the automatic units before 2026-12-02's change);
#   hf_meta_2np   the hf_meta row at 2 x NP ranks (the shards halve; the rest does not).
# Peak RSS per rank from /usr/bin/time (max resident set size), max over the ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
LAYERS=${1:-20}
D=${2:-1024}
NP=${3:-4}
MFSDP=${MFSDP:-build/bin/mfsdp}
OUT=bench/results_init_from.md
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
source bench/lib.sh
bench_text_data "$W" "$MFSDP"
.venv/bin/python scripts/export_model.py --arch llama --layers "$LAYERS" --d-model "$D" --heads 16 --vocab 32000 \
  --out "$W/big.pt" --state-dict "$W/big.sd" > /dev/null
.venv/bin/python - "$W" <<'PY'
import sys, torch
from safetensors.torch import save_file
w = sys.argv[1]
sd = torch.load(f"{w}/big.sd")
seen, out = set(), {}
for k, v in sd.items():
    if v.data_ptr() in seen:
        continue
    seen.add(v.data_ptr())
    out[k] = v.contiguous()
save_file(out, f"{w}/big.safetensors")
print(sum(v.numel() for v in out.values()))
PY
.venv/bin/python scripts/export_model.py --arch llama --layers 2 --d-model 64 --heads 4 --vocab 32000 --out "$W/toy.pt" > /dev/null
.venv/bin/python - "$W" "$LAYERS" "$D" <<'PY'
import sys, torch, transformers
w, layers, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = transformers.LlamaConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                               intermediate_size=(8 * d // 3 + 255) // 256 * 256, vocab_size=32000)
torch.manual_seed(0)
transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(f"{w}/hf_dir", max_shard_size="200MB")
PY
.venv/bin/python scripts/export_hf.py --model-dir "$W/hf_dir" --out "$W/hf.pt" > /dev/null
params=$(.venv/bin/python -c "
import torch; m = torch.jit.load('$W/big.pt'); print(sum(p.numel() for p in m.parameters()))")
model_mib=$((params * 4 / 1048576))
common=(data.train=$W/data data.valid_fraction=0 training.max_steps=1 training.micro_batch_size=1
        training.seq_length=16 training.threads=1 training.log_every=1000 training.eval_every=0
        lr_scheduler.warmup_steps=0 optimizer.name=sgd optimizer.momentum=0 distributed.zero_dp_strategy=3
        logging.peak_tflops=1)
# name overrides... -> "peak_mib seconds"
# RUN_NP (default NP): the ranks.
run() {
  local name=$1; shift
  local t0 t1 np=${RUN_NP:-$NP}
  t0=$(date +%s.%N)
  mpirun --oversubscribe --allow-run-as-root -np "$np" /usr/bin/time -f "maxrss_kib %M" "$MFSDP" train \
    run_dir="$W/run_$name" "${common[@]}" training.global_batch_size="$np" "$@" > "$W/$name.log" 2>&1 ||
    { tail -20 "$W/$name.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  local peak
  peak=$(grep -o 'maxrss_kib [0-9]*' "$W/$name.log" | awk '{ if ($2 > m) m = $2 } END { print int(m / 1024) }')
  echo "$peak $(echo "$t1 - $t0" | bc)"
}
read -r base_mib base_s < <(run baseline model.path="$W/toy.pt")
read -r file_mib file_s < <(run file model.path="$W/big.pt")
read -r rules_mib rules_s < <(run rules model.path="$W/big.pt" distributed.init_fsdp_with_meta_device=true)
read -r meta_mib meta_s < <(run meta model.path="$W/big.pt" distributed.init_fsdp_with_meta_device=true \
  model.init_from="$W/big.safetensors")
read -r hf_file_mib hf_file_s < <(run hf_file model.path="$W/hf.pt")
read -r hf_meta_mib hf_meta_s < <(run hf_meta model.path="$W/hf.pt" distributed.init_fsdp_with_meta_device=true \
  model.init_from="$W/hf_dir")
read -r meta_layers_mib meta_layers_s < <(run meta_layers model.path="$W/big.pt" distributed.init_fsdp_with_meta_device=true \
  model.init_from="$W/big.safetensors" "distributed.megatron_fsdp_unit_modules=[DecoderLayer]")
read -r hf_layers_mib hf_layers_s < <(run hf_layers model.path="$W/hf.pt" distributed.init_fsdp_with_meta_device=true \
  model.init_from="$W/hf_dir" "distributed.megatron_fsdp_unit_modules=[LlamaDecoderLayer]")
read -r hf_2np_mib hf_2np_s < <(RUN_NP=$((2 * NP)) run hf_meta_2np model.path="$W/hf.pt" \
  distributed.init_fsdp_with_meta_device=true model.init_from="$W/hf_dir")
grep -h "units:" "$W/hf_meta.log" | head -1 > "$W/init_line" || true
grep -h "initial weights" "$W/meta.log" | head -1 >> "$W/init_line" || true
grep -h "initial weights\|left unread" "$W/hf_meta.log" | head -2 >> "$W/init_line" || true
for r in meta meta_layers hf_meta hf_layers hf_meta_2np; do
  grep -h "memory on rank" "$W/$r.log" | sed "s/^/($r, rank 0) /" >> "$W/init_line" || true
done
hf_shards=$(ls "$W/hf_dir"/*.safetensors | wc -l)
{
  echo "# model.init_from: per-rank peak memory"
  echo
  echo "Measured $(date -u +%Y-%m-%d) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')),"
  echo "\`bench/init_from_memory.sh $LAYERS $D $NP\`: a Llama of $params parameters (${model_mib} MiB in fp32),"
  echo "$NP ranks, zero_dp_strategy 3, SGD without state, one step. Peak RSS: the largest of the ranks'"
  echo "maximum resident set sizes (/usr/bin/time)."
  echo
  echo "| start | ranks | peak RSS per rank (MiB) | peak / model | above the baseline (MiB) | above the baseline / model | wall (s) |"
  echo "|---|---|---|---|---|---|---|"
  echo "| baseline (2-layer toy model) | $NP | $base_mib | - | 0 | - | $base_s |"
  for row in "file:weights from the TorchScript file:$file_mib:$file_s" \
             "rules:meta device + mfsdp's init rules (no weights read):$rules_mib:$rules_s" \
             "meta:meta device + model.init_from (safetensors):$meta_mib:$meta_s" \
             "hf_file:HF LlamaForCausalLM, weights from the TorchScript file:$hf_file_mib:$hf_file_s" \
             "hf_meta:HF LlamaForCausalLM, meta device + model.init_from (save_pretrained dir, $hf_shards bf16 shards):$hf_meta_mib:$hf_meta_s" \
             "meta_layers:meta device + model.init_from, the layers alone as units:$meta_layers_mib:$meta_layers_s" \
             "hf_layers:HF LlamaForCausalLM, meta device + model.init_from, the layers alone as units:$hf_layers_mib:$hf_layers_s" \
             "hf_meta_2np:HF LlamaForCausalLM, meta device + model.init_from, $((2 * NP)) ranks:$hf_2np_mib:$hf_2np_s"; do
    IFS=: read -r name label mib s <<< "$row"
    np=$NP
    [ "$name" = hf_meta_2np ] && np=$((2 * NP))
    echo "| $label | $np | $mib | $(echo "scale=2; $mib / $model_mib" | bc) | $((mib - base_mib)) | $(echo "scale=2; ($mib - $base_mib) / $model_mib" | bc) | $s |"
  done
  echo
  echo "Expected for the meta row: this rank's shard of the weights and of the gradients (2 x model / $NP),"
  echo "plus the gathered units of a step; the file row holds the whole model first. Log of the meta runs:"
  echo
  while read -r line; do echo "    ${line:0:220}"; done < "$W/init_line"
} > "$OUT"
cat "$OUT"
