// device.h and the NCCL half of communicator.h for CUDA builds, forwarding to the CUDA plugin
// (cuda_plugin.h; DESIGN.md section 11, "The CUDA plugin").
//
// The plugin is loaded the first time a run asks for a GPU, never on a CPU run: a node without the
// CUDA driver (no libcuda.so.1), or whose driver sees no device, answers "0 GPUs" from the driver
// itself, which costs a millisecond, where loading libtorch_cuda.so and its CUDA libraries would
// cost 350 MB of resident memory and 0.2 s in every rank.
#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "device/cuda_plugin.h"
#include "device/device.h"
#include "util/error.h"

namespace mfsdp {
namespace {

// GPUs the CUDA driver sees (CUDA_VISIBLE_DEVICES applies), through the driver API looked up by
// hand: the driver library is part of the GPU driver, present exactly where a GPU can be used.
int driver_device_count() {
  static const int count = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
    using InitFn = int (*)(unsigned);
    using CountFn = int (*)(int*);
    auto init = reinterpret_cast<InitFn>(dlsym(lib, "cuInit"));
    auto get_count = reinterpret_cast<CountFn>(dlsym(lib, "cuDeviceGetCount"));
    int n = 0;
    if (!init || !get_count || init(0) != 0 || get_count(&n) != 0) return 0;  // 0 is CUDA_SUCCESS
    return n;
  }();
  return count;
}

// Where the plugin is: MFSDP_CUDA_PLUGIN, else beside the executable (bin/libmfsdp_cuda.so of a
// build, or of a copied bin/), else the build tree this binary came from (tests run from there).
std::vector<std::string> plugin_candidates() {
  std::vector<std::string> c;
  if (const char* env = std::getenv("MFSDP_CUDA_PLUGIN"); env && *env) {
    c.push_back(env);
    return c;
  }
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) c.push_back((exe.parent_path() / "libmfsdp_cuda.so").string());
  c.push_back(MFSDP_CUDA_PLUGIN_BUILD_PATH);
  return c;
}

struct Loaded {
  const CudaPluginApi* api = nullptr;
  std::string path, error;
};

Loaded& plugin_state() {
  static Loaded state;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string tried;
    for (const auto& path : plugin_candidates()) {
      if (access(path.c_str(), R_OK) != 0) {
        tried += (tried.empty() ? "" : ", ") + path + " (absent)";
        continue;
      }
      void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!lib) {
        state.error = "cannot load the CUDA plugin " + path + ": " + dlerror();
        return;
      }
      using EntryFn = const CudaPluginApi* (*)();
      auto entry = reinterpret_cast<EntryFn>(dlsym(lib, "mfsdp_cuda_plugin_api"));
      const CudaPluginApi* api = entry ? entry() : nullptr;
      if (!api || api->abi != kCudaPluginAbi) {
        state.error = "the CUDA plugin " + path + " is from another mfsdp build (interface " +
                      (api ? std::to_string(api->abi) : std::string("missing")) + ", this mfsdp expects " +
                      std::to_string(kCudaPluginAbi) + "): rebuild, or set MFSDP_CUDA_PLUGIN to the one beside this binary";
        return;
      }
      state.api = api;
      state.path = path;
      // The fused ops' GPU kernels (model/device_fast_ops.h), checked on the GPU before first use.
      set_device_fast_ops(api->fast_ops());
      return;
    }
    state.error = "the CUDA plugin libmfsdp_cuda.so was not found (looked at " + tried +
                  "): copy it beside the mfsdp executable, or set MFSDP_CUDA_PLUGIN";
  });
  return state;
}

const CudaPluginApi& plugin(const std::string& why) {
  Loaded& s = plugin_state();
  if (!s.api) throw UserError(why + ": " + s.error);
  return *s.api;
}

}  // namespace

void throw_no_usable_gpu(const std::string& where) {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  throw ConfigError(where + ": training.device is cuda but this node has no usable GPU (the CUDA driver found none" +
                    (visible ? std::string(", CUDA_VISIBLE_DEVICES=") + visible : std::string()) +
                    "); set training.device: cpu or auto");
}

std::string cuda_plugin_status(bool load) {
  const int gpus = driver_device_count();
  if (!load && gpus == 0) return "not loaded (the CUDA driver sees no GPU)";
  Loaded& s = plugin_state();
  if (!s.api) return "not usable: " + s.error;
  return "loaded from " + s.path + "; " + std::to_string(s.api->device_count()) + " GPU(s) visible";
}

int cuda_device_count() {
  if (driver_device_count() == 0) return 0;
  return plugin("the node's driver reports " + std::to_string(driver_device_count()) + " GPU(s)").device_count();
}

bool cuda_usable() { return cuda_device_count() > 0; }

c10::Device select_device(const std::string& want, int local_rank, const std::string& where) {
  if (want == "cpu") return c10::Device(c10::kCPU);
  if (driver_device_count() == 0) {
    if (want == "auto") return c10::Device(c10::kCPU);
    throw_no_usable_gpu(where);
  }
  return plugin(where + ": training.device " + want).select_device(want, local_rank, where);
}

void synchronize(c10::Device d) {
  if (d.is_cuda()) plugin("synchronize").synchronize(d);
}

DeviceMemory device_memory(c10::Device d) {
  return d.is_cuda() ? plugin("device memory").device_memory(d) : DeviceMemory{};
}

void reset_device_peak(c10::Device d) {
  if (d.is_cuda()) plugin("device memory").reset_device_peak(d);
}

std::string describe_device(c10::Device d) { return d.is_cuda() ? plugin("device").describe_device(d) : "cpu"; }

// The NCCL backend is in this build; whether it loads is the plugin's question (asked when a
// communicator is made, with its error).
bool nccl_available() { return true; }

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, std::string name, int rank, int size,
                                                     std::vector<int> world_ranks) {
  return plugin("communicator '" + name + "'").make_nccl_communicator(comm, name, rank, size, std::move(world_ranks));
}

std::unique_ptr<Communicator> make_nccl_world(std::string name) {
  return plugin("communicator '" + name + "'").make_nccl_world(name);
}

std::unique_ptr<Communicator> make_nccl_split(Communicator& world, int color, int key, std::string name,
                                              std::vector<int> members) {
  return plugin("communicator '" + name + "'").make_nccl_split(world, color, key, name, std::move(members));
}

std::unique_ptr<Communicator> make_staged_communicator(Communicator& host) {
  return plugin("communicator '" + host.name() + "'").make_staged_communicator(host);
}

}  // namespace mfsdp
