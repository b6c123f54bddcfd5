#!/usr/bin/env bash
# Step 2 of the GPU check, on the GPU machine, from the repository root, with gpu_bundle/ (made by
# scripts/gpu/prepare.sh here) beside it:   bash scripts/gpu/check.sh RESULTS_DIR
# 1. facts (GPU, driver, torch, its NCCL); Open MPI and the libraries from the bundle;
# 2. the mfsdp built on the CPU machine if it runs here, else a build here against this torch;
# 3. the GPU tests (tests/gpu/gpu_tests.py): 1-rank NCCL and 2-4 ranks sharing the GPU against CPU
#    runs of the same model and data, checkpoints across devices, bench-comm on NCCL;
# 4. the benchmark (bench/gpu_llama.py): a ~1B Llama in bf16 against PyTorch eager, same run, then
#    mfsdp's steps 6-7 under PyTorch's profiler (a run of its own): kernels by device time, how
#    busy the GPU was, mfsdp's phases (README "Profiling").
# Writes at most 8 files into RESULTS_DIR: check.log, gpu_tests.md, gpu_tests.log, results_gpu.md,
# bench.log, bench_metrics.jsonl, profile_gpu.txt. Budget: under 8 minutes (each stage has its own
# timeout).
set -uo pipefail
res=${1:?usage: scripts/gpu/check.sh RESULTS_DIR}
here=$(cd "$(dirname "$0")/../.." && pwd)
bundle=$here/gpu_bundle
mkdir -p "$res"
exec > >(tee "$res/check.log") 2>&1
t0=$(date +%s)
stamp() { echo "[check +$(( $(date +%s) - t0 ))s] $*"; }
[ -d "$bundle/root" ] || { echo "check.sh: $bundle missing: run scripts/gpu/prepare.sh on the CPU machine and carry gpu_bundle"; exit 2; }

PY=${MFSDP_PYTHON:-$(command -v python3)}
torch_dir=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
site=$(dirname "$torch_dir")
root=$bundle/root/usr
libarch=$root/lib/x86_64-linux-gnu
export OPAL_PREFIX=$root                       # Open MPI unpacked away from /usr
export PATH=$root/bin:$PATH
# pkgconf finds the bundle's .pc files (prepare.sh made their prefix relative to their place).
export PKG_CONFIG_PATH=$root/lib/x86_64-linux-gnu/pkgconfig:$root/share/pkgconfig
# The wheel's CUDA runtime (nvidia/cu13) and NCCL: the libraries the binary built here names.
export LD_LIBRARY_PATH=$libarch:$libarch/openmpi/lib:$torch_dir/lib:$site/nvidia/nccl/lib:$site/nvidia/cu13/lib:${LD_LIBRARY_PATH:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One node: shared memory only, no UCX/OFI probing, and no cross-memory attach (containers often
# forbid process_vm_readv).
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
export MFSDP_PYTHON=$PY

stamp "facts"
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | head -3
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
(command -v nvcc >/dev/null && nvcc --version | tail -1) || echo "nvcc: not on PATH"
echo "bundle commit $(cat "$bundle/commit" 2>/dev/null), checkout $(git -C "$here" rev-parse HEAD 2>/dev/null || echo '?')"
mpirun --version 2>&1 | head -1

stamp "binary"
bin=$bundle/bin/mfsdp
# --check-cuda: the executable and its CUDA plugin (bin/libmfsdp_cuda.so) load together here.
if ! "$bin" validate -n 1 --check-cuda -q >/dev/null 2>"$res/.bin_err"; then
  echo "the mfsdp built on the CPU machine does not run here: $(head -3 "$res/.bin_err")"
  echo "building here against $torch_dir"
  nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  timeout 300 cmake -S "$here" -B "$here/build-gpu" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMFSDP_BUILD_TESTS=OFF \
      -DCMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)');$root" \
      -Dyaml-cpp_DIR="$libarch/cmake/yaml-cpp" -DCLI11_DIR="$root/share/cmake/CLI11" \
      -Dnlohmann_json_DIR="$root/share/cmake/nlohmann_json" -DMPI_C_COMPILER="$root/bin/mpicc" \
      -DMFSDP_PYTHON="$PY" -DCMAKE_CUDA_COMPILER="$nvcc_bin" \
      -DPKG_CONFIG_EXECUTABLE="$root/bin/pkgconf" > "$res/.cmake.log" 2>&1 &&
    timeout 300 ninja -C "$here/build-gpu" -j "$(nproc)" mfsdp_cli > "$res/.ninja.log" 2>&1
  rc=$?
  tail -20 "$res/.cmake.log" "$res/.ninja.log"
  [ $rc -eq 0 ] || { stamp "build failed (rc $rc)"; exit 1; }
  bin=$here/build-gpu/bin/mfsdp
fi
rm -f "$res"/.bin_err "$res"/.cmake.log "$res"/.ninja.log
"$bin" validate -n 1 --check-cuda -q training.device=cuda | tail -2
stamp "mfsdp: $bin"

# MFSDP_GPU_STAGES=tests or =bench: one stage alone (e.g. a benchmark rerun with MFSDP_BENCH_ARGS="--micro 8").
stages=${MFSDP_GPU_STAGES:-tests,bench}
tests_rc=0 bench_rc=0
if [[ $stages == *tests* ]]; then
stamp "GPU tests"
timeout 210 "$PY" "$here/tests/gpu/gpu_tests.py" --bin "$bin" --work /tmp/mfsdp_gpu_tests --report "$res/gpu_tests.md" ${MFSDP_GPU_TESTS_ARGS:-} \
    > "$res/gpu_tests.log" 2>&1
tests_rc=$?
tail -40 "$res/gpu_tests.md" 2>/dev/null || tail -40 "$res/gpu_tests.log"
stamp "GPU tests: rc $tests_rc"
fi

if [[ $stages == *bench* ]]; then
stamp "benchmark"
timeout 270 "$PY" "$here/bench/gpu_llama.py" --bin "$bin" --work /tmp/mfsdp_gpu_bench --results "$res/results_gpu.md" \
    --metrics "$res/bench_metrics.jsonl" --profile "$res/profile_gpu.txt" ${MFSDP_BENCH_ARGS:-} > "$res/bench.log" 2>&1
bench_rc=$?
cat "$res/results_gpu.md" 2>/dev/null || tail -40 "$res/bench.log"
sed -n '1,/^### Kernels/p' "$res/profile_gpu.txt" 2>/dev/null | head -40
stamp "benchmark: rc $bench_rc"
fi
stamp "done"
[ $tests_rc -eq 0 ] && [ $bench_rc -eq 0 ]
