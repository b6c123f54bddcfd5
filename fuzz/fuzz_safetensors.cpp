// The safetensors header of a whole file.
#include "checkpoint/safetensors_header.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {
  fuzz::expect_user_errors_only([&] {
    auto h = mfsdp::parse_safetensors_header(d, n, "fuzz.safetensors");
    for (const auto& [name, e] : h.entries)
      if (h.data_start + e.end > n) __builtin_trap();  // an accepted entry must lie inside the file
  });
  return 0;
}
