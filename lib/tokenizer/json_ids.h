// Token ids out of JSON, checked: an id must be an integer in [0, 2^31). nlohmann's get<int>() of
// a float or a huge number is undefined behaviour (the fuzzer found 1.4e70 as a vocabulary id).
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace mfsdp::tok_detail {

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

inline int32_t json_id(const nlohmann::json& j, const std::string& where) {
  return static_cast<int32_t>(json_int(j, 0, INT32_MAX, where));
}

}  // namespace mfsdp::tok_detail
