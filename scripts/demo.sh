#!/usr/bin/env bash
# The main job: a small GPT trained on the King James Bible with `mpirun -np 2` on CPU, using the
# embedded default config (configs/default.yaml). About eight minutes on a 2-core machine.
#   1. install what is missing and build (scripts/setup.sh)
#   2. decode the KJV text (Debian's bible-kjv) and turn it into a Megatron dataset
#   3. export a 4-layer, 256-wide GPT as TorchScript (torch 2.11 in .venv)
#   4. train it on 2 ranks, then draw the loss curves
# Tokenizer: DEMO_TOKENIZER=byte (default: the built-in byte-level tokenizer, vocabulary 257) or
# DEMO_TOKENIZER=gpt2 (GPT-2's BPE from genuine files, scripts/tokenizers/fetch_vocabularies.py;
# the model's vocabulary comes from the dataset's .meta.json; run directory runs/demo-gpt2).
# Extra arguments are config overrides, e.g. scripts/demo.sh training.max_steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
TOK=${DEMO_TOKENIZER:-byte}
scripts/setup.sh
MFSDP="$BUILD_DIR/bin/mfsdp"
case "$TOK" in
  byte)
    RUN=runs/demo
    overrides=()
    prep=()
    ;;
  gpt2)
    RUN=runs/demo-gpt2
    .venv/bin/python scripts/tokenizers/fetch_vocabularies.py .cache/vocab
    # End of document = <|endoftext|> (50256); the loss on predicting it is kept, as the byte demo.
    # A 50,257-token output layer costs ~12x the byte model's step: a shorter run of smaller batches.
    overrides=(run_dir=$RUN model.path=$RUN/gpt.pt data.train=$RUN/data/kjv data.eod_token=50256
               training.max_steps=150 training.global_batch_size=16 training.eval_every=50)
    prep=(--tokenizer .cache/vocab/gpt2 --append-eod)
    ;;
  *) echo "demo.sh: DEMO_TOKENIZER=$TOK: expected byte or gpt2" >&2; exit 2 ;;
esac
mkdir -p "$RUN/data"
if [ ! -f "$RUN/data/kjv.idx" ]; then
  bible -l100000 'Gen1:1-Rev22:21' > "$RUN/kjv.txt"
  "$MFSDP" prepare-data --input "$RUN/kjv.txt" --output "$RUN/data/kjv" --split-lines "${prep[@]}"
fi
if [ ! -f "$RUN/gpt.pt" ]; then
  .venv/bin/python scripts/export_model.py --arch gpt --layers 4 --d-model 256 --heads 4 --max-seq 128 \
    --vocab-from "$RUN/data/kjv.meta.json" --vocab-multiple 8 --out "$RUN/gpt.pt"
fi
mpirun --oversubscribe --allow-run-as-root -np 2 "$MFSDP" train "${overrides[@]}" "$@"
"$MFSDP" plot "$RUN"
echo "run directory: $RUN (metrics: $RUN/metrics.jsonl, config: $RUN/config.yaml, plot: $RUN/loss.svg)"
