// Where a rank computes: the CPU, or one GPU chosen from its local rank (DESIGN.md section 11).
// Everything CUDA-specific that is not a collective lives behind this header: the current device,
// synchronisation, the caching allocator's statistics, the device's name. device_cuda.cpp
// implements it with the CUDA runtime inside the CUDA plugin, which cuda_loader.cpp loads when a
// run needs a GPU; device_cpu.cpp for LibTorch builds without CUDA.
#pragma once
#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace mfsdp {

// True when this build's LibTorch has CUDA and the node has at least one GPU.
bool cuda_usable();
int cuda_device_count();

// training.device: "cpu" -> CPU; "cuda" -> GPU (local_rank % GPUs), an error naming `where` when
// there is none; "auto" -> CUDA when cuda_usable(). Makes the chosen GPU the current device of
// this process (every later CUDA call, NCCL's included, runs there).
c10::Device select_device(const std::string& want, int local_rank, const std::string& where);

// Blocks the host until the device finished everything queued (timers, the peak measurement).
void synchronize(c10::Device d);

// The CUDA caching allocator's view of this process (zeros on the CPU).
struct DeviceMemory {
  int64_t allocated = 0, reserved = 0, peak_allocated = 0, peak_reserved = 0;
};
DeviceMemory device_memory(c10::Device d);
void reset_device_peak(c10::Device d);

// "cpu", or "cuda:0 NVIDIA H200 (sm_90, 139.8 GiB)".
std::string describe_device(c10::Device d);
// The CUDA plugin (cuda_plugin.h): "loaded from PATH; N GPU(s) visible", why it is not loaded or
// cannot be, or that this build has none. `load`: load it even where the driver sees no GPU (a
// check that the plugin and this executable fit together).
std::string cuda_plugin_status(bool load);

}  // namespace mfsdp
