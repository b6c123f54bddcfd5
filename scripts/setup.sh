#!/usr/bin/env bash
# Installs what is missing, configures and builds mfsdp. Idempotent: a second run downloads and
# installs nothing and rebuilds only what changed.
#   scripts/setup.sh            # -> build/bin/mfsdp
# What it installs:
#   - Debian packages that are absent (build tools, Open MPI, yaml-cpp, fmt, CLI11, Catch2, json);
#   - PyTorch 2.11.0 from PyPI into the project-local virtual environment .venv (reused when it
#     already holds that version): its LibTorch is what mfsdp links, its python runs the exporter,
#     the PyTorch oracle and every helper. The wheel is CUDA-enabled (CUDA 13.0, NCCL 2.28), so the
#     build is too; it runs on machines without a GPU.
# Environment: BUILD_DIR (default build), JOBS (default 2), MFSDP_VENV (default .venv),
#   MFSDP_SKIP_APT=1 to never call apt, CUDA_HOME (default /usr/local/cuda: nvcc for Torch's CMake).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
VENV=${MFSDP_VENV:-.venv}
TORCH_VERSION=2.11.0

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libopenmpi-dev openmpi-bin                       # MPI: launch and CPU collectives
  libjemalloc-dev                                  # the binary's malloc (DESIGN.md section 7)
  libyaml-cpp-dev libcli11-dev catch2           # config, CLI, tests (fmt: the wheel's copy)
  nlohmann-json3-dev                               # checkpoint index (JSON)
  libpcre2-dev libutf8proc-dev zlib1g-dev libzstd-dev zstd libsentencepiece-dev   # prepare-data's tokenizers and inputs
  bible-kjv bible-kjv-text                         # the demo corpus (public domain)
  slurmctld slurmd slurm-client munge              # a real SLURM for the tests (started by them)
  clang libclang-rt-14-dev                         # libFuzzer + sanitizers for fuzz/ (scripts/fuzz.sh)
  iproute2                                         # network namespaces: the tests' two hosts
  python3 python3-venv
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

# --- PyTorch from PyPI in a project-local virtual environment -----------------------------------
# The reference tokenizer libraries (tests hold prepare-data to them), pinned.
REF_TOKENIZERS=(tokenizers==0.23.3 tiktoken==0.14.0 sentencepiece==0.2.3)
# Hugging Face models: scripts/export_hf.py builds them, the oracle trains them, export --format hf
# output is loaded back by from_pretrained (tests/hf); peft wraps models with LoRA adapters
# (export_hf.py --lora-r), trains them in the oracle and loads the adapters mfsdp writes.
HF_PACKAGES=(transformers==5.24.0 safetensors==0.8.0 peft==0.21.2)
have_torch() { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, numpy, yaml, tensorboard, tokenizers, tiktoken, sentencepiece, transformers, safetensors, peft, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' or tokenizers.__version__ != '0.23.3' or transformers.__version__ != '5.24.0' or peft.__version__ != '0.21.2')" 2>/dev/null; }
if ! have_torch; then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  echo "setup: installing torch==$TORCH_VERSION into $VENV (about 4 GB with its CUDA libraries)"
  # tensorboard: its reader checks mfsdp's event files (tests); not needed to train.
  # tokenizers, tiktoken, sentencepiece: the references prepare-data's tokenizers are tested against.
  "$VENV/bin/pip" install -q --progress-bar off "torch==$TORCH_VERSION" numpy pyyaml tensorboard "${REF_TOKENIZERS[@]}" "${HF_PACKAGES[@]}"
  have_torch || { echo "setup: $VENV/bin/python cannot import torch $TORCH_VERSION after installing it" >&2; exit 1; }
fi
PY=$(cd "$VENV/bin" && pwd)/python
TORCH_CMAKE=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
TORCH_CUDA=$("$PY" -c 'import torch; print(1 if torch.version.cuda else 0)')

cuda_args=()
if [ "$TORCH_CUDA" = 1 ]; then
  # Torch's CMake package enables the CUDA language when the wheel has CUDA: it needs nvcc.
  CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
  if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
    echo "setup: torch $TORCH_VERSION is CUDA-enabled and its CMake package needs the CUDA toolkit (nvcc);" \
         "none at $CUDA_HOME (set CUDA_HOME)" >&2
    exit 1
  fi
  cuda_args=(-DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" -DCUDAToolkit_ROOT="$CUDA_HOME")
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" -DMFSDP_PYTHON="$PY" "${cuda_args[@]}"
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "setup: built $BUILD_DIR/bin/mfsdp (LibTorch $TORCH_VERSION from $VENV)"
