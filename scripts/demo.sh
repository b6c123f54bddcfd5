#!/usr/bin/env bash
# The main job: a small GPT trained on the King James Bible with `mpirun -np 2` on CPU, using the
# embedded default config (configs/default.yaml). About three minutes on a 2-core machine.
#   1. install what is missing and build (scripts/setup.sh)
#   2. decode the KJV text (Debian's bible-kjv) and turn it into a byte-level Megatron dataset
#   3. export a 4-layer, 256-wide GPT as TorchScript (torch 2.11 in .venv)
#   4. train it on 2 ranks, then draw the loss curves
# Extra arguments are config overrides, e.g. scripts/demo.sh training.max_steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
scripts/setup.sh
MFSDP="$BUILD_DIR/bin/mfsdp"
RUN=runs/demo
mkdir -p "$RUN/data"
if [ ! -f "$RUN/data/kjv.idx" ]; then
  bible -l100000 'Gen1:1-Rev22:21' > "$RUN/kjv.txt"
  "$MFSDP" prepare-data --input "$RUN/kjv.txt" --output "$RUN/data/kjv" --split-lines
fi
if [ ! -f "$RUN/gpt.pt" ]; then
  .venv/bin/python scripts/export_model.py --arch gpt --layers 4 --d-model 256 --heads 4 --vocab 264 --max-seq 128 \
    --out "$RUN/gpt.pt"
fi
mpirun --oversubscribe --allow-run-as-root -np 2 "$MFSDP" train "$@"
"$MFSDP" plot "$RUN"
echo "run directory: $RUN (metrics: $RUN/metrics.jsonl, config: $RUN/config.yaml, plot: $RUN/loss.svg)"
