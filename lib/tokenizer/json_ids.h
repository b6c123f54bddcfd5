// Token ids out of JSON, checked: an id must be an integer in [0, 2^31) (util/json_int.h says why).
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "util/json_int.h"

namespace mfsdp::tok_detail {

using mfsdp::json_int;

inline int32_t json_id(const nlohmann::json& j, const std::string& where) {
  return static_cast<int32_t>(json_int(j, 0, INT32_MAX, where));
}

}  // namespace mfsdp::tok_detail
