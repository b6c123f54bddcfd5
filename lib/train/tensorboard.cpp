#include "train/tensorboard.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>

#include "util/error.h"

namespace mfsdp {
namespace {

struct Crc32cTable {
  uint32_t t[256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli
      t[i] = c;
    }
  }
};

// Protobuf wire format: key = field << 3 | type (0 varint, 1 64-bit, 2 length-delimited, 5 32-bit).
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(v & 0x7f) | char(0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}
void key(std::string& out, int field, int type) { varint(out, uint64_t(field) << 3 | uint64_t(type)); }
template <class T>
void fixed(std::string& out, T v) {  // little-endian, as on every machine mfsdp builds for
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
void bytes_field(std::string& out, int field, const std::string& v) {
  key(out, field, 2);
  varint(out, v.size());
  out += v;
}

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const Crc32cTable table;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table.t[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
    throw UserError(dir + ": cannot create the TensorBoard directory (logging.tensorboard): " + std::strerror(errno));
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  path_ = dir + "/events.out.tfevents." + std::to_string(int64_t(wall_time())) + "." + host + "." +
          std::to_string(getpid());
  f_ = std::fopen(path_.c_str(), "wb");
  if (!f_) throw UserError(path_ + ": cannot create (logging.tensorboard): " + std::strerror(errno));
  std::string ev;  // Event{wall_time = 1, file_version = 3}
  key(ev, 1, 1);
  fixed(ev, wall_time());
  bytes_field(ev, 3, "brain.Event:2");
  record(ev);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;  // Summary{repeated Value value = 1}, Value{tag = 1, simple_value = 2 (float)}
  for (const auto& [tag, x] : values) {
    if (!std::isfinite(x)) continue;  // as metrics.jsonl writes null: no point rather than NaN
    std::string v;
    bytes_field(v, 1, tag);
    key(v, 2, 5);
    fixed(v, float(x));
    bytes_field(summary, 1, v);
  }
  std::string ev;  // Event{wall_time = 1, step = 2, summary = 5}
  key(ev, 1, 1);
  fixed(ev, wall_time());
  key(ev, 2, 0);
  varint(ev, uint64_t(step));
  bytes_field(ev, 5, summary);
  record(ev);
}

void TensorBoardWriter::record(const std::string& event) {
  std::string rec;
  const uint64_t len = event.size();
  fixed(rec, len);
  fixed(rec, masked_crc32c(&len, sizeof len));
  rec += event;
  fixed(rec, masked_crc32c(event.data(), event.size()));
  if (std::fwrite(rec.data(), 1, rec.size(), f_) != rec.size() || std::fflush(f_) != 0)
    throw UserError(path_ + ": write failed: " + std::strerror(errno));
}

}  // namespace mfsdp
