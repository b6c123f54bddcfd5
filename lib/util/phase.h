// A named range of mfsdp's work ("mfsdp::forward", "mfsdp::optimizer", a wait for a collective) for
// PyTorch's profiler: an event in the trace and a row of the phase table that train/profiler.h
// writes. A RecordFunction of the user scope, as torch.profiler.record_function makes one: when no
// profiler is on, a thread-local check and nothing else. Names are string literals (kept by
// pointer).
#pragma once
#include <ATen/record_function.h>

#include <string_view>

namespace mfsdp {

class Phase {
 public:
  explicit Phase(const char* name) : rf_(at::RecordScope::USER_SCOPE) {
    if (rf_.isActive()) rf_.before(std::string_view(name), c10::ArrayRef<const c10::IValue>{});
  }
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;

 private:
  at::RecordFunction rf_;
};

}  // namespace mfsdp
