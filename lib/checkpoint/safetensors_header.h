// The safetensors header, parsed without LibTorch (so that the fuzzer can drive it): u64
// little-endian length N, N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [b, e]},
// "__metadata__": {"key": "string"}}, then the data. Every way a file can be malformed is a
// UserError naming the file and what is wrong.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mfsdp {

struct SafetensorsEntry {
  std::string dtype;  // "F32", "BF16", ...
  size_t element_size = 0;
  std::vector<int64_t> shape;
  size_t begin = 0, end = 0;  // byte range within the data section
};

struct SafetensorsHeader {
  size_t data_start = 0;  // offset of the data section in the file
  std::map<std::string, SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
};

// Bytes per element of a safetensors dtype name; 0 when mfsdp does not read that dtype.
size_t safetensors_element_size(const std::string& dtype);

SafetensorsHeader parse_safetensors_header(const uint8_t* data, size_t size, const std::string& path);

}  // namespace mfsdp
