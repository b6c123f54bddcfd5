// Input files for prepare-data: plain or compressed (gzip, zstd; told apart by their magic bytes,
// not their names), read as a stream of lines with their numbers for error messages.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

namespace mfsdp {

class InputStream {
 public:
  explicit InputStream(const std::string& path);  // "-": standard input
  ~InputStream();
  InputStream(const InputStream&) = delete;
  InputStream& operator=(const InputStream&) = delete;
  // Reads up to n decompressed bytes; 0 at the end. Corrupt or truncated compressed data is a
  // UserError naming the file.
  size_t read(char* buf, size_t n);
  const std::string& path() const { return path_; }
  const char* compression() const;   // "none", "gzip" or "zstd"
  uint64_t raw_bytes_read() const { return raw_read_; }  // bytes of the file consumed so far
  uint64_t raw_size() const { return raw_size_; }        // the file's size (0: unknown, stdin)

 private:
  enum class Kind { Plain, Gzip, Zstd } kind_ = Kind::Plain;
  std::string path_;
  FILE* f_ = nullptr;
  bool own_ = true;
  uint64_t raw_read_ = 0, raw_size_ = 0;
  std::string inbuf_;
  size_t in_pos_ = 0, in_len_ = 0;
  bool eof_ = false, stream_end_ = false;
  void* z_ = nullptr;     // z_stream
  void* zstd_ = nullptr;  // ZSTD_DStream
  bool fill();
  size_t read_plain(char* buf, size_t n);
  size_t read_gzip(char* buf, size_t n);
  size_t read_zstd(char* buf, size_t n);
};

// Lines of an InputStream (without their '\n'), numbered from 1.
class LineReader {
 public:
  // A line longer than max_line bytes is a UserError naming the file and line (a file without
  // newlines read as JSONL, a decompression bomb), not an unbounded buffer.
  explicit LineReader(InputStream& in, size_t max_line = size_t(1) << 30) : in_(in), max_line_(max_line) {}
  bool next(std::string& line);
  int64_t line_number() const { return line_no_; }

 private:
  InputStream& in_;
  size_t max_line_;
  std::string buf_;
  size_t pos_ = 0;
  bool eof_ = false;
  int64_t line_no_ = 0;
};

}  // namespace mfsdp
