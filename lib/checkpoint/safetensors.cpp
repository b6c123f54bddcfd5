#include "checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors_header.h"
#include "data/token_source.h"
#include "util/error.h"

namespace mfsdp {

const char* safetensors_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kDouble: return "F64";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kByte: return "U8";
    case at::kChar: return "I8";
    case at::kBool: return "BOOL";
    default: throw std::invalid_argument(std::string("no safetensors dtype for ") + c10::toString(t));
  }
}

namespace {
at::ScalarType dtype_of(const std::string& s, const std::string& path) {
  static const std::map<std::string, at::ScalarType> m = {
      {"F32", at::kFloat}, {"F64", at::kDouble}, {"BF16", at::kBFloat16}, {"F16", at::kHalf}, {"I64", at::kLong},
      {"I32", at::kInt},   {"U8", at::kByte},    {"I8", at::kChar},       {"BOOL", at::kBool}};
  auto it = m.find(s);
  if (it == m.end()) throw UserError(path + ": unsupported safetensors dtype " + s);
  return it->second;
}

void write_all(int fd, const void* p, size_t n, const std::string& path) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw UserError(path + ": write failed: " + std::strerror(errno));
    }
    c += w;
    n -= size_t(w);
  }
}
}  // namespace

uint64_t fnv1a64(const void* data, size_t n, uint64_t h) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

uint64_t write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                           const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  return write_safetensors_streamed(path, specs, [&](size_t i) { return tensors[i].second; }, metadata);
}

uint64_t write_safetensors_streamed(const std::string& path, const std::vector<SafetensorsSpec>& specs,
                                    const std::function<at::Tensor(size_t)>& produce,
                                    const std::map<std::string, std::string>& metadata) {
  // The header needs only names, dtypes and shapes, so it goes first and each tensor's bytes follow
  // as `produce` makes them: one tensor in memory at a time.
  nlohmann::json header = nlohmann::json::object();
  size_t offset = 0;
  for (const auto& sp : specs) {
    int64_t n = 1;
    for (int64_t d : sp.shape) n *= d;
    const size_t bytes = size_t(n) * c10::elementSize(sp.dtype);
    header[sp.name] = {{"dtype", safetensors_dtype(sp.dtype)}, {"shape", sp.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string h = header.dump();
  while ((8 + h.size()) % 8) h += ' ';
  const uint64_t hlen = h.size();
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw UserError(tmp + ": cannot create: " + std::strerror(errno));
  uint64_t sum = 1469598103934665603ULL;
  try {
    write_all(fd, &hlen, 8, tmp);
    sum = fnv1a64(&hlen, 8, sum);
    write_all(fd, h.data(), h.size(), tmp);
    sum = fnv1a64(h.data(), h.size(), sum);
    for (size_t i = 0; i < specs.size(); ++i) {
      at::Tensor t = produce(i).to(specs[i].dtype).contiguous();
      if (t.sizes().vec() != specs[i].shape)
        throw std::logic_error("write_safetensors_streamed: tensor " + specs[i].name + " does not have its promised shape");
      write_all(fd, t.data_ptr(), t.nbytes(), tmp);
      sum = fnv1a64(t.data_ptr(), t.nbytes(), sum);
    }
    if (::fsync(fd) != 0) throw UserError(tmp + ": fsync failed: " + std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw UserError(tmp + ": close failed: " + std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw UserError(path + ": rename failed: " + std::strerror(errno));
  }
  return sum;
}

uint64_t checksum_file(const std::string& path) {
  MappedFile f(path);
  return fnv1a64(f.data(), f.size());
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  file_ = std::make_unique<MappedFile>(path);
  SafetensorsHeader h = parse_safetensors_header(file_->data(), file_->size(), path);
  data_start_ = h.data_start;
  metadata_ = std::move(h.metadata);
  for (auto& [name, e] : h.entries) entries_[name] = {dtype_of(e.dtype, path), std::move(e.shape), e.begin, e.end};
}

SafetensorsFile::~SafetensorsFile() = default;

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& kv : entries_) out.push_back(kv.first);
  return out;
}

at::Tensor SafetensorsFile::get(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw UserError(path_ + ": no tensor named " + name);
  const Entry& e = it->second;
  void* p = const_cast<uint8_t*>(file_->data() + data_start_ + e.begin);
  return at::from_blob(p, e.shape, at::TensorOptions().dtype(e.dtype));
}

void SafetensorsFile::release(const std::string& name) const {
  auto it = entries_.find(name);
  if (it != entries_.end()) file_->drop_pages(data_start_ + it->second.begin, it->second.end - it->second.begin);
}

}  // namespace mfsdp
