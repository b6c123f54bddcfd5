#!/usr/bin/env bash
# The main job on the embedded default config. Until `mfsdp train` lands, it checks the default
# config and lays out its mesh for 2 ranks, then measures the communication it would use.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
scripts/setup.sh
MFSDP="$BUILD_DIR/bin/mfsdp"
"$MFSDP" validate --world-size 2
mpirun --oversubscribe --allow-run-as-root -np 2 "$MFSDP" bench-comm -e 4194304
