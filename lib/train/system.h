// The process's share of the machine: threads per rank, the BLAS it runs, peak FLOP/s, memory.
#pragma once
#include <c10/core/Device.h>
#include <string>

namespace mfsdp {

// Cores this process may run on (its CPU affinity mask).
int cores_available();
// The same of this process's parent (the launcher's daemon on this node, or the shell that started it).
int launcher_cores_available();
// Whether Open MPI (4.x) bound this rank at launch by its own default policy: bound
// (OMPI_MCA_orte_bound_at_launch) with none of the MCA parameters that --bind-to, --map-by, --cpu-set
// or a rankfile put into a rank's environment. A policy from an mca-params.conf file leaves no trace
// there and reads as the default.
bool openmpi_default_binding();
// Gives every thread of this process its share of the launcher's cores on this node: the launcher's
// affinity split by physical core (sysfs topology; one group per CPU where unreadable) into
// local_size equal slices in CPU order, slice local_rank. Returns that slice's CPUs as a list
// ("0-7,16-23"), or "" where it would not widen the current affinity (fewer cores than local ranks,
// a slice no larger than the binding, an unreadable affinity) or setting it failed: then nothing
// changed.
std::string widen_to_share(int local_rank, int local_size);
// Physical cores among the CPUs this process may run on (its affinity; a core's hardware threads
// count once, as PyTorch's default thread count, MKL's, does).
int physical_cores_available();
// The thread count the environment asks for, as PyTorch reads it (OMP_NUM_THREADS, then
// MKL_NUM_THREADS over it; a list such as "8,2" gives its first entry), 0 when neither is set or
// they are empty; `which` names the variable that gave it. Throws UserError naming the variable on
// anything but a positive integer. `mfsdp train` checks it first thing.
int env_threads(std::string* which = nullptr);
// Sets LibTorch's intra-op threads and OpenBLAS's threads to n (inter-op threads to 1).
void set_threads(int n);
// Threads that an at::parallel_for in mfsdp's own code reaches with the intra-op threads set now:
// at::get_num_threads() when mfsdp was compiled with ATen's threading (OpenMP: lib/CMakeLists.txt),
// 1 when the loop's `#pragma omp parallel` was compiled away.
int parallel_loop_threads();
// Resident-set high-water mark of this process, in MiB.
double peak_memory_mib();
// Dense matmul throughput of this rank with its threads, in TFLOP/s, for MFU.
double measure_peak_tflops(bool bf16, c10::Device device = c10::Device(c10::kCPU));
// "MKL (...), CPU kernels AVX2, malloc ...": what runs this rank's CPU products and kernels. Throws
// on a bad MFSDP_MKL_DISPATCH (isa or vendor).
std::string blas_description();
// Throws UserError unless MFSDP_MKL_DISPATCH (how MKL chooses its kernels on a CPU not made by
// Intel, system.cpp) is unset, empty, "isa" or "vendor", and MFSDP_ATTENTION_BF16 (how bf16
// attention multiplies, model/cpu_attention.h) unset, empty, "bf16" or "fp32". `mfsdp train`
// checks them first thing.
void check_cpu_knobs();
// "malloc jemalloc 5.3.0-..." or "malloc glibc": the allocator this process's malloc is.
std::string malloc_description();

}  // namespace mfsdp
