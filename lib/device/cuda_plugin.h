// The boundary between mfsdp and its CUDA half (DESIGN.md section 11, "The CUDA plugin").
//
// Everything that needs libtorch_cuda.so, the CUDA runtime or NCCL (device_cuda.cpp,
// nccl_communicator.cpp, staged_communicator.cpp) is built into libmfsdp_cuda.so, which the
// executable loads with dlopen only when a run needs a GPU (cuda_loader.cpp). The plugin exports one
// C function returning this table; mfsdp's own symbols it uses (Communicator, MpiEnv, the flight
// recorder) resolve against the executable, so the process keeps one copy of each.
//
// The plugin's functions live in namespace mfsdp::cuda_plugin, not under the names of device.h and
// communicator.h: the executable exports those names (its forwarding versions), and a plugin
// function of the same name would bind to them and call itself.
#pragma once
#include <c10/core/Device.h>
#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "device/device.h"
#include "model/device_fast_ops.h"

namespace mfsdp {

// Raised when the table's layout changes; the loader refuses a plugin of another build.
inline constexpr int kCudaPluginAbi = 2;

struct CudaPluginApi {
  int abi;
  int (*device_count)();
  c10::Device (*select_device)(const std::string& want, int local_rank, const std::string& where);
  void (*synchronize)(c10::Device d);
  DeviceMemory (*device_memory)(c10::Device d);
  void (*reset_device_peak)(c10::Device d);
  std::string (*describe_device)(c10::Device d);
  std::unique_ptr<Communicator> (*make_nccl_communicator)(MPI_Comm comm, std::string name, int rank, int size,
                                                          std::vector<int> world_ranks);
  std::unique_ptr<Communicator> (*make_nccl_world)(std::string name);
  std::unique_ptr<Communicator> (*make_nccl_split)(Communicator& world, int color, int key, std::string name,
                                                   std::vector<int> members);
  std::unique_ptr<Communicator> (*make_staged_communicator)(Communicator& host);
  // The GPU kernels of mfsdp's fused ops; nullptr when the plugin was built without nvcc.
  const DeviceFastOps* (*fast_ops)();
};

// training.device cuda on a node without a usable GPU: the ConfigError naming `where`. Defined by
// the executable (cuda_loader.cpp), called by both sides.
[[noreturn]] void throw_no_usable_gpu(const std::string& where);

namespace cuda_plugin {
int device_count();
c10::Device select_device(const std::string& want, int local_rank, const std::string& where);
void synchronize(c10::Device d);
DeviceMemory device_memory(c10::Device d);
void reset_device_peak(c10::Device d);
std::string describe_device(c10::Device d);
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, std::string name, int rank, int size,
                                                     std::vector<int> world_ranks);
std::unique_ptr<Communicator> make_nccl_world(std::string name);
std::unique_ptr<Communicator> make_nccl_split(Communicator& world, int color, int key, std::string name,
                                              std::vector<int> members);
std::unique_ptr<Communicator> make_staged_communicator(Communicator& host);
const DeviceFastOps* fast_ops();
}  // namespace cuda_plugin

}  // namespace mfsdp

// The plugin's one exported entry point (cuda_plugin.cpp).
extern "C" const mfsdp::CudaPluginApi* mfsdp_cuda_plugin_api();
