#include "train/system.h"

#include "device/device.h"
#include "model/cpu_attention.h"
#include "util/error.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <set>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace mfsdp {

// MKL's kernels on a CPU not made by Intel (DESIGN.md section 7, "MKL's dispatch"). MKL picks its
// code path by vendor first: on other vendors' CPUs it runs its generic ("def") kernels, AVX2 at
// most, whatever the CPU has. It asks through mkl_serv_intel_cpu_true(), which the torch wheel's
// LibTorch exports and calls through its PLT, so the definition below, exported by the mfsdp
// executable (ENABLE_EXPORTS), is the one every MKL call sees. Answering 1 makes MKL choose by the
// instruction set it then reads with CPUID, as on an Intel CPU: on an AMD EPYC (Zen 4) its AVX-512
// sgemm, 4-11% faster than the generic kernels for the products of a step
// (bench/results_mkl_dispatch.md). mfsdp answers so only on CPUs with AVX-512 (cpu_has_avx512).
// MFSDP_MKL_DISPATCH=vendor keeps MKL's own answer. In executables that do not export it (the unit
// tests) the definition is not seen and MKL keeps its own.
namespace {
std::atomic<int> mkl_vendor_questions{0};

// MKL's AVX-512 kernels need F, CD, BW, DQ and VL. Only there does mfsdp answer for MKL: that is
// where it was measured to gain. On AVX2-only CPUs of other vendors MKL's generic kernels include
// ones tuned for them (`_zen`), against which its Intel AVX2 path was not measured.
bool cpu_has_avx512() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

bool mkl_dispatch_by_vendor() {
  const char* knob = std::getenv("MFSDP_MKL_DISPATCH");
  return knob && std::string(knob) == "vendor";
}
}  // namespace
}  // namespace mfsdp

extern "C" __attribute__((visibility("default"), used)) int mkl_serv_intel_cpu_true() {
  mfsdp::mkl_vendor_questions.fetch_add(1, std::memory_order_relaxed);
  static const int answer = [] {
    if (!mfsdp::mkl_dispatch_by_vendor() && mfsdp::cpu_has_avx512()) return 1;
    using Fn = int (*)();
    auto own = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "mkl_serv_intel_cpu_true"));
    return own ? own() : 0;
  }();
  return answer;
}

namespace mfsdp {

namespace {
// The CPUID vendor string ("GenuineIntel", "AuthenticAMD"), "" off x86-64.
std::string cpu_vendor() {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx)) {
    char v[13];
    std::memcpy(v, &ebx, 4);
    std::memcpy(v + 4, &edx, 4);
    std::memcpy(v + 8, &ecx, 4);
    v[12] = 0;
    return v;
  }
#endif
  return "";
}

}  // namespace

void check_cpu_knobs() {
  check_attention_bf16_knob();
  const char* knob = std::getenv("MFSDP_MKL_DISPATCH");
  if (knob && *knob && std::string(knob) != "vendor" && std::string(knob) != "isa")
    throw UserError(std::string("environment variable MFSDP_MKL_DISPATCH=") + knob +
                    ": expected \"isa\" (MKL's kernels by instruction set, the default) or \"vendor\" (MKL's own "
                    "choice by CPU vendor)");
}

namespace {
// How MKL chooses its kernels on this CPU ("" on Intel's, or without MKL): by instruction set
// (mfsdp's answer above) or by vendor (MFSDP_MKL_DISPATCH=vendor, or a CPU without AVX-512).
std::string mkl_dispatch_description() {
  const std::string vendor = cpu_vendor();
  if (!at::hasMKL() || vendor.empty() || vendor == "GenuineIntel") return "";
  // One small product makes MKL choose its code path, if it has not yet in this process; then
  // mkl_serv_cpu_detect() (exported by LibTorch) says which: 0 is its generic one.
  (void)at::mm(at::ones({8, 8}), at::ones({8, 8}));
  using DetectFn = int (*)();
  auto detect = reinterpret_cast<DetectFn>(dlsym(RTLD_DEFAULT, "mkl_serv_cpu_detect"));
  const bool asked = mkl_vendor_questions.load() > 0;
  const bool by_isa = detect ? detect() != 0 : asked && !mkl_dispatch_by_vendor() && cpu_has_avx512();
  if (by_isa)
    return "kernels by instruction set on this " + vendor + " CPU" +
           (mkl_dispatch_by_vendor() ? std::string(" (MKL's own choice)") : "; MFSDP_MKL_DISPATCH=vendor: MKL's own choice");
  if (mkl_dispatch_by_vendor()) return "its generic kernels on this " + vendor + " CPU (MFSDP_MKL_DISPATCH=vendor)";
  if (!cpu_has_avx512()) return "its own choice on this " + vendor + " CPU without AVX-512";
  if (!asked) return "its generic kernels on this " + vendor + " CPU (this LibTorch does not let mfsdp answer MKL's vendor check)";
  return "its generic kernels on this " + vendor + " CPU (MKL has no others for its instruction set)";
}
// Cores process `pid` may run on (its CPU affinity mask; 0: this process), or 0 if unreadable.
int affinity_cores(pid_t pid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(pid, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
}
}  // namespace

int cores_available() {
  if (const int n = affinity_cores(0)) return n;
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? int(n) : 1;
}

int launcher_cores_available() {
  // The parent is the launcher's daemon on this node (Open MPI's prted or orted, slurmstepd) or a
  // shell: its affinity is what this node gives the job, before any binding of the rank itself.
  if (const int n = affinity_cores(getppid())) return n;
  return cores_available();
}

bool openmpi_default_binding() {
  const char* bound = std::getenv("OMPI_MCA_orte_bound_at_launch");
  if (!bound || std::string(bound) != "1") return false;
  for (const char* explicit_placement : {"OMPI_MCA_hwloc_base_binding_policy", "OMPI_MCA_hwloc_base_cpu_set",
                                         "OMPI_MCA_rmaps_base_mapping_policy", "OMPI_MCA_orte_rankfile"})
    if (std::getenv(explicit_placement)) return false;
  return true;
}

namespace {
// CPU `cpu`'s physical core, as the list of hardware threads that share it (sysfs; the same string
// for each of them), or "cpuN" where unreadable.
std::string physical_core(int cpu) {
  const std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
  for (const char* name : {"core_cpus_list", "thread_siblings_list"}) {
    std::ifstream f(dir + name);
    std::string siblings;
    if (f >> siblings) return siblings;
  }
  return "cpu" + std::to_string(cpu);
}

// "0-3,8,10-11" for the sorted CPUs.
std::string cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    out += (out.empty() ? "" : ",") + std::to_string(cpus[i]) + (j > i ? "-" + std::to_string(cpus[j]) : "");
    i = j + 1;
  }
  return out;
}
}  // namespace

std::string widen_to_share(int local_rank, int local_size) {
  cpu_set_t launcher;
  CPU_ZERO(&launcher);
  if (local_size < 1 || local_rank < 0 || local_rank >= local_size ||
      sched_getaffinity(getppid(), sizeof launcher, &launcher) != 0)
    return "";
  // Physical cores in the order of their first CPU, so that a slice keeps a core's hardware threads
  // together (two ranks never share a core) and stays within a socket where the numbering does
  // (Linux numbers a socket's cores together, their second hardware threads after all first ones).
  std::vector<std::vector<int>> cores;
  std::map<std::string, size_t> index;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &launcher)) continue;
    const auto [it, added] = index.emplace(physical_core(cpu), cores.size());
    if (added) cores.emplace_back();
    cores[it->second].push_back(cpu);
  }
  const int n = int(cores.size());
  if (n < local_size) return "";
  std::vector<int> mine;
  for (int c = local_rank * n / local_size; c < (local_rank + 1) * n / local_size; ++c)
    mine.insert(mine.end(), cores[size_t(c)].begin(), cores[size_t(c)].end());
  std::sort(mine.begin(), mine.end());
  if (int(mine.size()) <= cores_available()) return "";
  cpu_set_t share;
  CPU_ZERO(&share);
  for (int cpu : mine) CPU_SET(cpu, &share);
  // This thread first: where that fails nothing changed. Then every other thread of the process
  // (MPI's and PMIx's run already; threads made later inherit their creator's mask): sched_setaffinity
  // sets one thread's. One that ended since the listing, or that refuses, keeps its binding: they
  // are the library's mostly idle helpers, not the compute.
  if (sched_setaffinity(0, sizeof share, &share) != 0) return "";
  if (DIR* tasks = opendir("/proc/self/task")) {
    while (const dirent* e = readdir(tasks))
      if (e->d_name[0] != '.') sched_setaffinity(pid_t(std::atoi(e->d_name)), sizeof share, &share);
    closedir(tasks);
  }
  return cpu_list(mine);
}

namespace {
int physical_cores_in(const cpu_set_t& set) {
  std::set<std::string> cores;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) cores.insert(physical_core(cpu));
  return int(cores.size());
}
}  // namespace

int physical_cores_available() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cores_available();
  return std::max(1, physical_cores_in(set));
}

int env_threads(std::string* which) {
  int threads = 0;
  for (const char* name : {"OMP_NUM_THREADS", "MKL_NUM_THREADS"}) {  // MKL's over OpenMP's, as PyTorch reads them
    const char* value = std::getenv(name);
    if (!value || !*value) continue;
    const std::string v(value), first = v.substr(0, v.find(','));
    const bool digits = !first.empty() && first.size() <= 6 &&
                        std::all_of(first.begin(), first.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!digits || std::atoi(first.c_str()) < 1)
      throw UserError("environment variable " + std::string(name) + "=" + v +
                      ": expected a positive integer (threads per rank; training.threads sets them in the YAML)");
    threads = std::atoi(first.c_str());
    if (which) *which = name;
  }
  return threads;
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
  if (const std::string d = mkl_dispatch_description(); !d.empty()) blas += " (" + d + ")";
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
