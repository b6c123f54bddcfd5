// Shared by the fuzz targets: a scratch file per process, and the rule that the only exception a
// parser may throw on bad input is UserError (anything else is "internal error" for the user, so the
// fuzzer treats it as a crash).
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "util/error.h"

namespace fuzz {

inline std::string scratch(const char* suffix) {
  return "/tmp/mfsdp_fuzz_" + std::to_string(::getpid()) + suffix;
}

inline void write_file(const std::string& path, const uint8_t* d, size_t n) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) __builtin_trap();
  if (n) std::fwrite(d, 1, n, f);
  std::fclose(f);
}

// Runs f; UserError is the expected outcome of bad input.
template <class F>
void expect_user_errors_only(F f) {
  try {
    f();
  } catch (const mfsdp::UserError&) {
  }
}

}  // namespace fuzz
