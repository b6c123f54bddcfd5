#!/usr/bin/env bash
# Test fixture: small real data (license texts every Debian machine has) and small models,
# exported with the torch of $MFSDP_PYTHON (the project venv). Usage: fixture.sh MFSDP_BIN OUT_DIR
set -euo pipefail
bin=$1 out=$2
PY=${MFSDP_PYTHON:?set MFSDP_PYTHON to the python with the torch mfsdp links (CTest does)}
mkdir -p "$out"
cat /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/LGPL-3 \
    /usr/share/common-licenses/MPL-2.0 > "$out/licenses.txt"
"$bin" prepare-data -i "$out/licenses.txt" -o "$out/licenses" --split-lines
here=$(cd "$(dirname "$0")/../.." && pwd)
# The exports are independent: they run side by side (each pays Python's and torch's start-up,
# most of this fixture's time), and every one must succeed.
pids=()
export_model() { "$PY" "$here/scripts/export_model.py" "$@" & pids+=($!); }
py() { "$PY" "$@" & pids+=($!); }
export_model --arch gpt --layers 2 --d-model 64 --heads 4 --vocab 264 --max-seq 64 --out "$out/gpt.pt"
export_model --arch gpt --layers 2 --d-model 64 --heads 4 --vocab 264 --max-seq 64 --trace --out "$out/gpt_traced.pt"
export_model --arch gpt --layers 2 --d-model 64 --heads 4 --vocab 264 --max-seq 64 --untied --out "$out/gpt_untied.pt"
export_model --arch llama --layers 2 --d-model 64 --heads 4 --kv-heads 2 --vocab 264 --out "$out/llama.pt"
# A vocabulary large against the layers (the embedding and the head each outweigh a layer, as in
# real LLMs): the automatic units include them.
export_model --arch llama --layers 2 --d-model 64 --heads 4 --kv-heads 2 --vocab 1024 --out "$out/llama_v1024.pt"
export_model --arch gpt --layers 1 --d-model 32 --heads 2 --vocab 200 --max-seq 64 --out "$out/gpt_vocab200.pt"
export_model --arch gpt --layers 2 --d-model 64 --heads 4 --vocab 264 --max-seq 64 --no-tp-plan --out "$out/gpt_noplan.pt"
# A model written apart from export_model.py, following only the README contract; its TP plan is
# in foreign.yaml (fused q/k/v with unequal GQA parts, a colwise_rep output head).
py "$here/tests/train/foreign_model.py" "$out/foreign.pt"
py "$here/tests/train/foreign_model.py" "$out/foreign_hf.pt" --hf  # body under `model`, head at the root
py "$here/tests/train/foreign_model.py" "$out/foreign_buf.pt" --pos-buffer  # a 128 KiB buffer, + foreign_buf.safetensors
# torchtitan's way of writing a Llama (a complex rotary buffer, nn.RMSNorm, default initialisation).
py "$here/tests/train/titan_model.py" "$out/titan.pt"
# torch.nn's own layers (nn.TransformerEncoderLayer: nn.MultiheadAttention's functional path), with
# and without its dropout (attention, residual, feed-forward).
py "$here/tests/train/torch_layers_model.py" "$out/torch_layers.pt"
py "$here/tests/train/torch_layers_model.py" "$out/torch_layers_dropout.pt" --dropout 0.1
# Attention written out (softmax(q k^T) v): minGPT's, scripted with attention dropout, and Meta's
# reference Llama's, traced with grouped-query attention.
py "$here/tests/train/written_attention_model.py" "$out/written_mingpt.pt" --style mingpt --dropout 0.1
py "$here/tests/train/written_attention_model.py" "$out/written_meta.pt" --style meta
echo "not a model" > "$out/garbage.pt"
# Same weights as gpt.pt (same seed and init order), blocks two levels down: blocks.K.blocks.J.
export_model --arch gpt --layers 2 --d-model 64 --heads 4 --vocab 264 --max-seq 64 --nested --out "$out/gpt_nested.pt"
# Four units: double buffering reuses each of its two buffers; gathers per unit are countable.
export_model --arch gpt --layers 4 --d-model 64 --heads 4 --vocab 264 --max-seq 64 --out "$out/gpt4.pt"
# Residual dropout: activation checkpointing must replay the same masks in its recompute.
export_model --arch gpt --layers 4 --d-model 64 --heads 4 --vocab 264 --max-seq 64 --dropout 0.1 --out "$out/gpt_dropout.pt"
# Tensor-parallel edge cases (tests/train/tp_edge_models.py): an embedding's padding row split over
# the vocabulary (scripted, traced, and with scale_grad_by_freq), a block's own parameter marked alone;
# and a layer that some steps leave without a gradient.
for kind in padding_idx padding_idx_traced padding_idx_freq own_param sometimes_unused; do
  py "$here/tests/train/tp_edge_models.py" "$kind" "$out/$kind.pt"
done
# No repeated sibling modules: no FSDP unit is found.
py "$here/tests/train/no_units_model.py" "$out/no_units.pt"
for p in "${pids[@]}"; do wait "$p"; done  # set -e: a failed export fails the fixture
experiment="# The parity tests' experiment: 20 steps, fp32, global batch 16 in micro-batches of 2.
run_dir: $out/run
data: {train: $out/licenses, valid_fraction: 0.05}
training: {max_steps: 20, global_batch_size: 16, micro_batch_size: 2, seq_length: 32, log_every: 100, threads: 1}
optimizer: {lr: 0.003}
lr_scheduler: {warmup_steps: 3}
logging: {peak_tflops: 1.0}"
cat > "$out/base.yaml" <<YAML
$experiment
model: {path: $out/gpt.pt}
distributed: {zero_dp_strategy: no_shard}
YAML
cat > "$out/foreign.yaml" <<YAML
# The parity experiment of base.yaml on foreign.pt, with the model's tensor-parallel plan.
$experiment
model: {path: $out/foreign.pt}
distributed:
  zero_dp_strategy: no_shard
  tp_plan:
    tok_embeddings: vocab_parallel
    "layers.*.attention.wqkv": colwise:64+32+32
    "layers.*.attention.wo": rowwise
    "layers.*.feed_forward.w1": colwise
    "layers.*.feed_forward.w3": colwise
    "layers.*.feed_forward.w2": rowwise
    "*norm": sequence_parallel
    output: colwise_rep
YAML
cat > "$out/foreign_hf.yaml" <<YAML
# The same on foreign_hf.pt: units and the final norm one level down (model.layers.N, model.norm).
$experiment
model: {path: $out/foreign_hf.pt}
distributed:
  zero_dp_strategy: no_shard
  tp_plan:
    model.embed_tokens: vocab_parallel
    "model.layers.*.attention.wqkv": colwise:64+32+32
    "model.layers.*.attention.wo": rowwise
    "model.layers.*.feed_forward.w1": colwise
    "model.layers.*.feed_forward.w3": colwise
    "model.layers.*.feed_forward.w2": rowwise
    "model.layers.*norm": sequence_parallel
    model.norm: sequence_parallel
    lm_head: colwise
YAML
echo "fixture ready in $out"
