// Integers out of JSON, checked: nlohmann's get<int64_t>() of a float or of a number beyond int64
// is undefined behaviour (the fuzzer found 1.4e70 as a vocabulary id), so every integer read from a
// user's file goes through json_int, which throws a UserError naming `where` instead.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace mfsdp {

inline int64_t json_int(const nlohmann::json& j, int64_t lo, int64_t hi, const std::string& where) {
  bool ok = false;
  int64_t v = 0;
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    ok = u <= uint64_t(INT64_MAX);
    v = int64_t(u);
  } else if (j.is_number_integer()) {
    v = j.get<int64_t>();
    ok = true;
  }
  if (!ok || v < lo || v > hi)
    throw UserError(where + ": expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + j.dump());
  return v;
}

}  // namespace mfsdp
