# Shared by the bench scripts (sourced): a byte-level Megatron dataset from the license texts every
# Debian machine has, for benchmarks that need no prepared corpus.
#   bench_text_data DIR MFSDP  -> DIR/data.bin + DIR/data.idx
bench_text_data() {
  local dir=$1 mfsdp=$2
  cat /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/LGPL-3 \
      /usr/share/common-licenses/MPL-2.0 /usr/share/common-licenses/GPL-2 > "$dir/text.txt"
  "$mfsdp" prepare-data -i "$dir/text.txt" -o "$dir/data" > /dev/null
}

# The models and the mfsdp overrides of one bench/train_step.sh step: the shape of the reference
# figures in ../shared/reference/formats.md (4 x 256, 4 heads, vocab 264, seq 128, micro-batch 8,
# AdamW at a constant rate, one thread); GPT (learned positions, GELU) and Llama (RoPE, SwiGLU).
#   bench_step_models DIR              -> DIR/gpt.pt, DIR/llama.pt
#   bench_step_common DATA STEPS       -> the overrides, in the array STEP_COMMON
bench_step_models() {
  local arch
  for arch in gpt llama; do
    .venv/bin/python scripts/export_model.py --arch $arch --layers 4 --d-model 256 --heads 4 --vocab 264 --max-seq 128 \
      --out "$1/$arch.pt" > /dev/null
  done
}
bench_step_common() {
  STEP_COMMON=(data.train=$1 data.valid_fraction=0 training.max_steps=$2 training.micro_batch_size=8
               training.seq_length=128 training.threads=1 training.eval_every=0 training.log_every=1000
               lr_scheduler.warmup_steps=0 lr_scheduler.name=constant lr_scheduler.min_lr=0 optimizer.lr=1e-4
               logging.peak_tflops=1)
}
