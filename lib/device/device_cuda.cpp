// device.h with the CUDA runtime and c10's CUDA allocator: the CUDA plugin's side of it (cuda_plugin.h;
// cuda_loader.cpp forwards to these once a run needs a GPU).
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include "device/cuda_plugin.h"
#include "util/error.h"

namespace mfsdp {

int cuda_plugin::device_count() {
  // c10's count never throws: no driver, or no device, is 0.
  return int(c10::cuda::device_count());
}

c10::Device cuda_plugin::select_device(const std::string& want, int local_rank, const std::string& where) {
  if (want == "cpu") return c10::Device(c10::kCPU);
  const int n = device_count();
  if (n == 0) {
    if (want == "auto") return c10::Device(c10::kCPU);
    throw_no_usable_gpu(where);  // the driver sees a GPU the runtime cannot use
  }
  // One GPU per local rank; more local ranks than GPUs share them round-robin (NCCL then refuses
  // two ranks of one communicator on a GPU: distributed.backend auto picks the staged MPI path).
  const auto index = c10::DeviceIndex(local_rank % n);
  c10::cuda::set_device(index);
  return c10::Device(c10::kCUDA, index);
}

void cuda_plugin::synchronize(c10::Device d) {
  if (!d.is_cuda()) return;
  c10::cuda::device_synchronize();
}

DeviceMemory cuda_plugin::device_memory(c10::Device d) {
  if (!d.is_cuda()) return {};
  const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
  const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return {st.allocated_bytes[agg].current, st.reserved_bytes[agg].current, st.allocated_bytes[agg].peak,
          st.reserved_bytes[agg].peak};
}

void cuda_plugin::reset_device_peak(c10::Device d) {
  if (d.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
}

std::string cuda_plugin::describe_device(c10::Device d) {
  if (!d.is_cuda()) return "cpu";
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, d.index()) != cudaSuccess) return d.str();
  return fmt::format("{} {} (sm_{}{}, {:.1f} GiB)", d.str(), p.name, p.major, p.minor,
                     double(p.totalGlobalMem) / double(1ULL << 30));
}

}  // namespace mfsdp
