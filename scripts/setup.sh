#!/usr/bin/env bash
# Installs what is missing (Debian packages, only when absent), configures and builds mfsdp.
# Idempotent: a second run installs nothing and rebuilds only what changed.
#   scripts/setup.sh            # -> build/bin/mfsdp
# Environment: BUILD_DIR (default build), JOBS (default 2), MFSDP_SKIP_APT=1 to never call apt.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev python3-torch                       # LibTorch 1.13 (C++) and PyTorch to export models
  libopenmpi-dev openmpi-bin                       # MPI: launch and CPU collectives
  libyaml-cpp-dev libfmt-dev libcli11-dev catch2   # config, formatting, CLI, tests
  nlohmann-json3-dev                               # checkpoint index (JSON)
  libopenblas0-pthread                             # fast BLAS for LibTorch (reference BLAS is ~50x slower)
  libsentencepiece-dev                             # prepare-data with a SentencePiece model
  bible-kjv bible-kjv-text                         # the demo corpus (public domain)
  python3
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "${MFSDP_SKIP_APT:-0}" = 1 ]; then
    echo "setup: missing Debian packages: ${missing[*]} (MFSDP_SKIP_APT=1: not installing)" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=(); elif command -v sudo >/dev/null; then SUDO=(sudo); else
    echo "setup: need root or sudo to install: ${missing[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${SUDO[@]}" apt-get update -qq
  "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "setup: built $BUILD_DIR/bin/mfsdp"
