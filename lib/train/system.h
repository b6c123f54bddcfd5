// The process's share of the machine: threads per rank, BLAS set-up, peak FLOP/s, memory.
#pragma once
#include <string>

namespace mfsdp {

// Before anything loads libopenblas: on AVX-512 CPUs OpenBLAS may misdetect the core and use slow
// kernels unless OPENBLAS_CORETYPE is set when the library loads, so re-execute this program once
// with it set (argv unchanged). Returns only when no re-exec was needed or it failed.
void maybe_reexec_for_blas(int argc, char** argv);

// Cores this process may run on (its CPU affinity mask).
int cores_available();
// Sets LibTorch's intra-op threads and OpenBLAS's threads to n (inter-op threads to 1).
void set_threads(int n);
// Resident-set high-water mark of this process, in MiB.
double peak_memory_mib();
// Dense matmul throughput of this rank with its threads, in TFLOP/s, for MFU.
double measure_peak_tflops(bool bf16);
std::string blas_description();

}  // namespace mfsdp
