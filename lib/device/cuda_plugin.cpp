// libmfsdp_cuda.so's entry point: the table of its functions (cuda_plugin.h).
#include "device/cuda_plugin.h"

extern "C" __attribute__((visibility("default"))) const mfsdp::CudaPluginApi* mfsdp_cuda_plugin_api() {
  namespace p = mfsdp::cuda_plugin;
  static const mfsdp::CudaPluginApi api{
      mfsdp::kCudaPluginAbi, p::device_count,          p::select_device,   p::synchronize,
      p::device_memory,      p::reset_device_peak,     p::describe_device, p::make_nccl_communicator,
      p::make_nccl_world,    p::make_nccl_split,       p::make_staged_communicator,
#ifdef MFSDP_HAVE_CUDA_KERNELS
      p::fast_ops,
#else
      [] { return static_cast<const mfsdp::DeviceFastOps*>(nullptr); },
#endif
  };
  return &api;
}
