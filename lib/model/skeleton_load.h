// Loading a TorchScript file without reading its parameters' bytes (init_fsdp_with_meta_device):
// the module, its code, constants and buffers as the file has them; each large tensor record of
// the file backed by untouched anonymous pages instead. DESIGN.md section 13 ("Meta-device load").
#pragma once
#include <torch/csrc/jit/api/module.h>

#include <cstdint>
#include <string>

namespace mfsdp {

struct SkeletonStats {
  int64_t records_skipped = 0;  // tensor records whose bytes were not read
  int64_t bytes_skipped = 0;
  int64_t tensors_read_back = 0;  // non-parameter tensors (buffers) among them, read after all
  int64_t bytes_read_back = 0;
};

// Loads `path` on the CPU. Every tensor record of 64 KiB or more is left unread: its storage is
// fresh anonymous memory that nothing touches, so it costs address space, not resident memory.
// Tensors that are not parameters (buffers, tensor attributes) get their bytes read afterwards;
// parameters keep the unread storage, which the caller must replace before anything reads it.
// Throws c10::Error like torch::jit::load.
torch::jit::Module load_skeleton(const std::string& path, torch::jit::ExtraFilesMap& extra, SkeletonStats* stats);

}  // namespace mfsdp
