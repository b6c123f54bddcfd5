#include "train/system.h"

#include "device/device.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace mfsdp {

int cores_available() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? int(n) : 1;
}

void set_threads(int n) {
  const char* intra = std::getenv("MFSDP_INTRAOP_THREADS");  // for measurements (bench/)
  at::set_num_threads(intra ? std::max(1, std::atoi(intra)) : n);
  // OpenBLAS reads its thread count at load time; set it again through its own API when present.
  using SetFn = void (*)(int);
  if (auto fn = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(n);
  if (auto fn = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "goto_set_num_threads"))) fn(n);
}

int parallel_loop_threads() {
  // One chunk per thread: at::parallel_for splits [0, threads) with grain 1 into one index each,
  // which each thread marks with its own number.
  const int n = at::get_num_threads();
  std::vector<char> seen(size_t(n), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    if (t >= 0 && t < n) seen[size_t(t)] = 1;
  });
  return int(std::count(seen.begin(), seen.end(), 1));
}

double peak_memory_mib() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) / 1024.0;
}

double measure_peak_tflops(bool bf16, c10::Device device) {
  // On a GPU, GEMMs big enough to reach the tensor cores' rate (8192^3 bf16 runs at ~790 TFLOP/s
  // on an H200, gpu.md); timed between device synchronisations. On the CPU, 512^3 with this
  // rank's threads.
  const int64_t n = device.is_cuda() ? 8192 : 512;
  auto opts = at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat).device(device);
  at::Tensor a = at::randn({n, n}, opts), b = at::randn({n, n}, opts), c;
  for (int i = 0; i < 3; ++i) c = at::mm(a, b);
  synchronize(device);
  int iters = 0;
  auto t0 = std::chrono::steady_clock::now();
  double secs = 0;
  while (secs < 0.25) {
    const int batch = device.is_cuda() ? 10 : 1;
    for (int i = 0; i < batch; ++i) c = at::mm(a, b);
    synchronize(device);
    iters += batch;
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return 2.0 * double(n) * double(n) * double(n) * iters / secs / 1e12;
}

std::string blas_description() {
  // The torch wheel links MKL statically on x86-64 (OpenBLAS elsewhere); name what this process
  // runs and the ATen kernels' vector width, which decides CPU throughput (bf16 GEMMs without
  // AVX-512 BF16 or AMX are emulated and ~70x slower than fp32 on an AVX2 machine: measured).
  std::string blas = at::hasMKL() ? "MKL" : "BLAS of the torch build";
  using CfgFn = char* (*)();
  if (!at::hasMKL())
    if (auto fn = reinterpret_cast<CfgFn>(dlsym(RTLD_DEFAULT, "openblas_get_config"))) blas = std::string("OpenBLAS ") + fn();
  return blas + ", CPU kernels " + at::get_cpu_capability() + ", " + malloc_description();
}

std::string malloc_description() {
  // jemalloc answers mallctl("version"); glibc has no mallctl. Found by name, so that a jemalloc
  // put in by LD_PRELOAD is named too.
  using MallctlFn = int (*)(const char*, void*, size_t*, void*, size_t);
  if (auto fn = reinterpret_cast<MallctlFn>(dlsym(RTLD_DEFAULT, "mallctl"))) {
    const char* version = nullptr;
    size_t len = sizeof(version);
    if (fn("version", &version, &len, nullptr, 0) == 0 && version) return std::string("malloc jemalloc ") + version;
    return "malloc jemalloc";
  }
  return "malloc glibc";
}

}  // namespace mfsdp
