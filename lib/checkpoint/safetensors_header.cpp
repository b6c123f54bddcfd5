// See safetensors_header.h.
#include "checkpoint/safetensors_header.h"

#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace mfsdp {

size_t safetensors_element_size(const std::string& d) {
  if (d == "F64" || d == "I64") return 8;
  if (d == "F32" || d == "I32") return 4;
  if (d == "BF16" || d == "F16") return 2;
  if (d == "U8" || d == "I8" || d == "BOOL") return 1;
  return 0;
}

SafetensorsHeader parse_safetensors_header(const uint8_t* data, size_t size, const std::string& path) {
  auto bad = [&](const std::string& why) { throw UserError(path + ": not a valid safetensors file: " + why); };
  if (size < 8) bad("shorter than 8 bytes");
  uint64_t hlen;
  std::memcpy(&hlen, data, 8);
  if (hlen > size - 8) bad("the header length runs past the end of the file (truncated?)");
  SafetensorsHeader h;
  h.data_start = 8 + size_t(hlen);
  const size_t data_size = size - h.data_start;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(reinterpret_cast<const char*>(data + 8), reinterpret_cast<const char*>(data + 8 + hlen));
  } catch (const std::exception& e) {
    bad(std::string("header is not JSON: ") + e.what());
  }
  if (!header.is_object()) bad("the header is not a JSON object");
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) bad("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) bad("__metadata__." + m.key() + " is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) bad("entry " + name + " is not an object");
    SafetensorsEntry e;
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto of = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) bad("entry " + name + ": no dtype string");
    e.dtype = dt->get<std::string>();
    e.element_size = safetensors_element_size(e.dtype);
    if (e.element_size == 0) bad("entry " + name + ": unsupported dtype " + e.dtype);
    if (sh == v.end() || !sh->is_array()) bad("entry " + name + ": no shape list");
    // The element count must not overflow: the product is checked against the data size as it grows.
    uint64_t n = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) bad("entry " + name + ": shape holds " + d.dump());
      const uint64_t k = d.get<uint64_t>();
      if (k != 0 && n > data_size / k) n = std::numeric_limits<uint64_t>::max() / 2;  // too large: caught below
      else n *= k;
      e.shape.push_back(int64_t(k));
    }
    if (of == v.end() || !of->is_array() || of->size() != 2 || !(*of)[0].is_number_unsigned() || !(*of)[1].is_number_unsigned())
      bad("entry " + name + ": data_offsets is not [begin, end]");
    const uint64_t b = (*of)[0].get<uint64_t>(), en = (*of)[1].get<uint64_t>();
    if (b > en || en > data_size) bad("tensor " + name + " lies outside the data");
    if (n > data_size || n * e.element_size != en - b) bad("tensor " + name + " has the wrong size");
    e.begin = size_t(b);
    e.end = size_t(en);
    h.entries[name] = std::move(e);
  }
  return h;
}

}  // namespace mfsdp
