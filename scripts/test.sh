#!/usr/bin/env bash
# The test command: set up (install, configure, build) and run every test; ends with CTest's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
t0=$(date +%s)
scripts/setup.sh
echo "test.sh: set-up (install, configure, build) took $(( $(date +%s) - t0 )) s"
cd "$BUILD_DIR"
# Multi-rank tests run under mpirun with more ranks than cores; CTest schedules them by PROCESSORS.
ctest --output-on-failure -j "${JOBS:-2}"
