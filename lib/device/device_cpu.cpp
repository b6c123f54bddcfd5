// device.h for LibTorch builds without CUDA: the CPU is the only device.
#include "device/device.h"

#include "util/error.h"

namespace mfsdp {

bool cuda_usable() { return false; }
int cuda_device_count() { return 0; }

c10::Device select_device(const std::string& want, int, const std::string& where) {
  if (want == "cuda")
    throw ConfigError(where + ": training.device is cuda but this mfsdp was built against a LibTorch without CUDA; "
                      "build against a CUDA LibTorch (the torch wheel from PyPI is one) or set training.device: cpu");
  return c10::Device(c10::kCPU);
}

void synchronize(c10::Device) {}
DeviceMemory device_memory(c10::Device) { return {}; }
void reset_device_peak(c10::Device) {}
std::string describe_device(c10::Device) { return "cpu"; }
std::string cuda_plugin_status(bool) { return "none in this build (its LibTorch has no CUDA)"; }

}  // namespace mfsdp
