#include "train/system.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <strings.h>

namespace mfsdp {

void maybe_reexec_for_blas(int argc, char** argv) {
  (void)argc;
  if (std::getenv("MFSDP_BLAS_REEXECED") || std::getenv("MFSDP_KEEP_OPENBLAS_CORETYPE")) return;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) return;
  const char* cur = std::getenv("OPENBLAS_CORETYPE");
  // An AVX-512 kernel set is already chosen: nothing to do. Otherwise (unset, or an older core
  // such as Haswell) SKYLAKEX measured 1.9x the fp32 GEMM throughput on this project's machines.
  if (cur && (strcasecmp(cur, "SKYLAKEX") == 0 || strcasecmp(cur, "COOPERLAKE") == 0 ||
              strcasecmp(cur, "SAPPHIRERAPIDS") == 0))
    return;
  if (cur) setenv("MFSDP_REPLACED_OPENBLAS_CORETYPE", cur, 1);
  setenv("OPENBLAS_CORETYPE", "SKYLAKEX", 1);
  // Idle OpenMP workers must sleep, not spin, or they fight OpenBLAS's threads for the cores.
  if (!std::getenv("OMP_WAIT_POLICY")) setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  setenv("MFSDP_BLAS_REEXECED", "1", 1);
  execv("/proc/self/exe", argv);  // returns only on failure: carry on with the default kernels
}

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

double peak_memory_mib() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) / 1024.0;
}

double measure_peak_tflops(bool bf16) {
  const int64_t n = 512;
  auto opts = at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat);
  at::Tensor a = at::randn({n, n}, opts), b = at::randn({n, n}, opts), c;
  for (int i = 0; i < 3; ++i) c = at::mm(a, b);
  int iters = 0;
  auto t0 = std::chrono::steady_clock::now();
  double secs = 0;
  while (secs < 0.25) {
    c = at::mm(a, b);
    ++iters;
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return 2.0 * n * n * n * iters / secs / 1e12;
}

std::string blas_description() {
  using CfgFn = char* (*)();
  if (auto fn = reinterpret_cast<CfgFn>(dlsym(RTLD_DEFAULT, "openblas_get_config"))) {
    const char* core = std::getenv("OPENBLAS_CORETYPE");
    using NameFn = char* (*)();
    auto name = reinterpret_cast<NameFn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
    const char* replaced = std::getenv("MFSDP_REPLACED_OPENBLAS_CORETYPE");
    return std::string("OpenBLAS core ") + (name ? name() : "?") +
           (core ? std::string(" (OPENBLAS_CORETYPE=") + core +
                       (replaced ? std::string(", replacing ") + replaced + " for the AVX-512 kernels" : "") + ")"
                 : "");
  }
  return "reference or unknown BLAS (install libopenblas0-pthread: about 50x faster)";
}

}  // namespace mfsdp
