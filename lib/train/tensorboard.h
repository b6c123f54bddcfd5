// TensorBoard event files without TensorFlow or protobuf (logging.tensorboard): scalars only.
// An event file is a sequence of TFRecords (u64 length, masked CRC-32C of the length, the bytes,
// masked CRC-32C of the bytes), each an `Event` protobuf; the first carries file_version
// "brain.Event:2", the others a step, a wall time and a `Summary` of (tag, simple_value) pairs.
// The few protobuf fields needed are encoded by hand (varints and fixed-width little-endian).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace mfsdp {

// CRC-32C (Castagnoli), as TFRecord uses it, and its masked form.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

class TensorBoardWriter {
 public:
  // Creates DIR (one level) and DIR/events.out.tfevents.<seconds>.<host>.<pid>.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  // One event: every (tag, value) at `step`; flushed, so TensorBoard sees it while training runs.
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);
  std::string path_;
  FILE* f_ = nullptr;
};

}  // namespace mfsdp
