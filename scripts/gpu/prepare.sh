#!/usr/bin/env bash
# Step 1 of the GPU check, on this (CPU) machine: gather into gpu_bundle/ (git-ignored) what the GPU
# machine lacks and cannot download (it has torch, nvcc, CMake and ninja, but no Debian packages and
# no network; ../shared/reference/gpu.md):
#   gpu_bundle/root/   Open MPI, yaml-cpp, CLI11, nlohmann-json, PCRE2, utf8proc, zstd, SentencePiece, jemalloc,
#                      pkgconf (and their runtime libraries) as
#                      files: the .deb packages unpacked with dpkg -x, docs and man pages dropped;
#   gpu_bundle/bin/    the mfsdp built here (and its CUDA plugin libmfsdp_cuda.so) against torch 2.11.0+cu130 (same LibTorch ABI as the
#                      GPU machine's wheel, so it may run there as is; check.sh tries it first and
#                      builds there when it does not).
# Then run the check with the device tool, carrying the bundle:
#   carry: ["gpu_bundle"]   command: bash scripts/gpu/check.sh "$OUT"
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=$here/gpu_bundle
build=${MFSDP_BUILD_DIR:-$here/build}
pkgs=(libyaml-cpp0.7 libyaml-cpp-dev libcli11-dev nlohmann-json3-dev
      libopenmpi3 libopenmpi-dev openmpi-bin openmpi-common
      libpmix2 libhwloc15 libhwloc-plugins libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1 libucx0
      libibverbs1 librdmacm1 libpsm2-2 libpsm-infinipath1 libnl-3-200 libnl-route-3-200 libltdl7 libmunge2
      libgfortran5 libnuma1 libatomic1 libjemalloc2 libjemalloc-dev
      libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 libutf8proc-dev libutf8proc2
      libzstd-dev zlib1g-dev libsentencepiece-dev libsentencepiece0 pkgconf pkgconf-bin libpkgconf3)
[ -x "$build/bin/mfsdp" ] || { echo "prepare.sh: $build/bin/mfsdp not found: build first (scripts/setup.sh)" >&2; exit 1; }
rm -rf "$out.tmp"
mkdir -p "$out.tmp/debs" "$out.tmp/root" "$out.tmp/bin"
(cd "$out.tmp/debs" && apt-get download "${pkgs[@]}" >/dev/null)
for d in "$out.tmp"/debs/*.deb; do dpkg -x "$d" "$out.tmp/root"; done
rm -rf "$out.tmp/debs" "$out.tmp/root/usr/share/doc" "$out.tmp/root/usr/share/man" "$out.tmp/root/usr/share/lintian" \
       "$out.tmp/root/usr/share/locale"
# jemalloc's static archives: the build links the shared library (apps/mfsdp/CMakeLists.txt).
rm -f "$out.tmp"/root/usr/lib/x86_64-linux-gnu/libjemalloc*.a
# dpkg -x runs no maintainer scripts, so the alternatives (mpirun, mpicc) are not there: link the
# Open MPI names CMake and the scripts use.
for tool in mpicc mpirun mpiexec; do
  [ -e "$out.tmp/root/usr/bin/$tool.openmpi" ] && ln -sfn "$tool.openmpi" "$out.tmp/root/usr/bin/$tool"
done
# pkg-config files say prefix=/usr: make them relative to where they lie (pkgconf's ${pcfiledir}).
for pc in "$out.tmp"/root/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc; do
  sed -i 's|^prefix=/usr$|prefix=${pcfiledir}/../../..|' "$pc"
done
for pc in "$out.tmp"/root/usr/share/pkgconfig/*.pc; do
  [ -e "$pc" ] && sed -i 's|^prefix=/usr$|prefix=${pcfiledir}/../..|' "$pc"
done
strip --strip-debug -o "$out.tmp/bin/mfsdp" "$build/bin/mfsdp"
# The CUDA plugin the executable loads on a GPU (lib/device/cuda_loader.cpp: found beside it).
[ -e "$build/bin/libmfsdp_cuda.so" ] && strip --strip-debug -o "$out.tmp/bin/libmfsdp_cuda.so" "$build/bin/libmfsdp_cuda.so"
git -C "$here" rev-parse HEAD > "$out.tmp/commit"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "prepare.sh: $(du -sh "$out" | cut -f1) in $out (commit $(cut -c1-12 "$out/commit")); carry it: [\"gpu_bundle\"]"
