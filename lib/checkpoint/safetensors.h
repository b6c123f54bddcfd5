// The safetensors layout (shared/reference/formats.md): u64 little-endian header length N, N bytes
// of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}} padded
// with spaces to 8-byte alignment, then the raw little-endian data.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace mfsdp {

class MappedFile;

// Writes tensors (contiguous CPU) to `path` through a temporary file renamed on success, with
// fsync. Throws UserError naming the file on any write failure (a full disk included). Returns the
// FNV-1a 64 checksum of the bytes written.
uint64_t write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                           const std::map<std::string, std::string>& metadata = {});

// The same from specs, each tensor made by produce(i) just before its bytes are written (converted
// to the spec's dtype): a file larger than memory, one tensor held at a time.
struct SafetensorsSpec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};
uint64_t write_safetensors_streamed(const std::string& path, const std::vector<SafetensorsSpec>& specs,
                                    const std::function<at::Tensor(size_t)>& produce,
                                    const std::map<std::string, std::string>& metadata = {});

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // throws UserError on malformed files
  ~SafetensorsFile();
  std::vector<std::string> names() const;
  bool has(const std::string& name) const { return entries_.count(name) > 0; }
  // A tensor viewing the mapped bytes (valid while this object lives); clone() to keep it.
  at::Tensor get(const std::string& name) const;
  // The tensor's pages leave this process's resident memory (MappedFile::drop_pages); get() still
  // reads it.
  void release(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  struct Entry {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    size_t begin, end;
  };
  std::string path_;
  std::unique_ptr<MappedFile> file_;
  size_t data_start_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// FNV-1a 64 of a whole file (for checkpoint checksums).
uint64_t checksum_file(const std::string& path);
uint64_t fnv1a64(const void* data, size_t n, uint64_t h = 1469598103934665603ULL);

const char* safetensors_dtype(at::ScalarType t);

}  // namespace mfsdp
