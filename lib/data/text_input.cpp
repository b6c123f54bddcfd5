// Compressed and plain input streams: see text_input.h.
#include "data/text_input.h"

#include <sys/stat.h>
#include <zlib.h>
#include <zstd.h>

#include <cerrno>
#include <cstring>

#include "util/error.h"

namespace mfsdp {

namespace {
constexpr size_t kChunk = 1 << 20;
}

InputStream::InputStream(const std::string& path) : path_(path) {
  if (path == "-") {
    f_ = stdin;
    own_ = false;
    path_ = "<stdin>";
  } else {
    f_ = std::fopen(path.c_str(), "rb");
    if (!f_) throw UserError(path + ": cannot open the input: " + std::strerror(errno));
    struct stat st;
    if (::fstat(fileno(f_), &st) == 0) {
      if (S_ISDIR(st.st_mode)) {
        std::fclose(f_);
        f_ = nullptr;
        throw UserError(path + ": is a directory, expected a text, JSONL, .gz or .zst file");
      }
      raw_size_ = static_cast<uint64_t>(st.st_size);
    }
  }
  inbuf_.resize(kChunk);
  fill();
  const auto* p = reinterpret_cast<const unsigned char*>(inbuf_.data());
  if (in_len_ >= 2 && p[0] == 0x1F && p[1] == 0x8B) {
    kind_ = Kind::Gzip;
    auto* z = new z_stream{};
    // 15 + 32: a gzip (or zlib) header, detected by inflate itself.
    if (inflateInit2(z, 15 + 32) != Z_OK) {
      delete z;
      throw UserError(path_ + ": cannot start gzip decompression");
    }
    z_ = z;
  } else if (in_len_ >= 4 && p[0] == 0x28 && p[1] == 0xB5 && p[2] == 0x2F && p[3] == 0xFD) {
    kind_ = Kind::Zstd;
    zstd_ = ZSTD_createDStream();
    ZSTD_initDStream(static_cast<ZSTD_DStream*>(zstd_));
  }
}

InputStream::~InputStream() {
  if (z_) {
    inflateEnd(static_cast<z_stream*>(z_));
    delete static_cast<z_stream*>(z_);
  }
  if (zstd_) ZSTD_freeDStream(static_cast<ZSTD_DStream*>(zstd_));
  if (f_ && own_) std::fclose(f_);
}

const char* InputStream::compression() const {
  return kind_ == Kind::Gzip ? "gzip" : kind_ == Kind::Zstd ? "zstd" : "none";
}

bool InputStream::fill() {
  if (eof_) return false;
  size_t n = std::fread(&inbuf_[0], 1, inbuf_.size(), f_);
  if (n == 0) {
    if (std::ferror(f_)) throw UserError(path_ + ": read error: " + std::strerror(errno));
    eof_ = true;
    in_pos_ = in_len_ = 0;
    return false;
  }
  raw_read_ += n;
  in_pos_ = 0;
  in_len_ = n;
  return true;
}

size_t InputStream::read(char* buf, size_t n) {
  switch (kind_) {
    case Kind::Plain: return read_plain(buf, n);
    case Kind::Gzip: return read_gzip(buf, n);
    case Kind::Zstd: return read_zstd(buf, n);
  }
  return 0;
}

size_t InputStream::read_plain(char* buf, size_t n) {
  if (in_pos_ == in_len_ && !fill()) return 0;
  size_t k = std::min(n, in_len_ - in_pos_);
  std::memcpy(buf, inbuf_.data() + in_pos_, k);
  in_pos_ += k;
  return k;
}

size_t InputStream::read_gzip(char* buf, size_t n) {
  auto* z = static_cast<z_stream*>(z_);
  size_t produced = 0;
  while (produced == 0) {
    if (in_pos_ == in_len_ && !fill()) {
      if (!stream_end_) throw UserError(path_ + ": truncated gzip data (the stream ends before its trailer)");
      return 0;
    }
    if (stream_end_) {
      // Another gzip member follows (concatenated .gz files are one stream to gzip -d).
      inflateReset(z);
      stream_end_ = false;
    }
    z->next_in = reinterpret_cast<Bytef*>(&inbuf_[in_pos_]);
    z->avail_in = static_cast<uInt>(in_len_ - in_pos_);
    z->next_out = reinterpret_cast<Bytef*>(buf);
    z->avail_out = static_cast<uInt>(n);
    int rc = inflate(z, Z_NO_FLUSH);
    in_pos_ = in_len_ - z->avail_in;
    produced = n - z->avail_out;
    if (rc == Z_STREAM_END) stream_end_ = true;
    else if (rc != Z_OK && rc != Z_BUF_ERROR)
      throw UserError(path_ + ": corrupt gzip data: " + (z->msg ? z->msg : "inflate failed"));
  }
  return produced;
}

size_t InputStream::read_zstd(char* buf, size_t n) {
  auto* d = static_cast<ZSTD_DStream*>(zstd_);
  size_t produced = 0;
  while (produced == 0) {
    if (in_pos_ == in_len_ && !fill()) {
      if (!stream_end_) throw UserError(path_ + ": truncated zstd data (the last frame is incomplete)");
      return 0;
    }
    ZSTD_inBuffer in{inbuf_.data(), in_len_, in_pos_};
    ZSTD_outBuffer out{buf, n, 0};
    size_t rc = ZSTD_decompressStream(d, &out, &in);
    if (ZSTD_isError(rc)) throw UserError(path_ + ": corrupt zstd data: " + ZSTD_getErrorName(rc));
    in_pos_ = in.pos;
    produced = out.pos;
    stream_end_ = rc == 0;  // 0: a frame is complete (another may follow)
  }
  return produced;
}

bool LineReader::next(std::string& line) {
  size_t scan = pos_;  // where the search for '\n' resumes (a long line is scanned once)
  while (true) {
    size_t nl = buf_.find('\n', scan);
    if (nl != std::string::npos) {
      line.assign(buf_, pos_, nl - pos_);
      pos_ = nl + 1;
      ++line_no_;
      return true;
    }
    if (eof_) {
      if (pos_ >= buf_.size()) return false;
      line.assign(buf_, pos_, std::string::npos);
      pos_ = buf_.size();
      ++line_no_;
      return true;
    }
    buf_.erase(0, pos_);
    pos_ = 0;
    size_t old = buf_.size();
    if (old > max_line_)
      throw UserError(in_.path() + ":" + std::to_string(line_no_ + 1) + ": a line longer than " + std::to_string(max_line_ >> 20) +
                      " MiB (is this a text or JSONL file?)");
    scan = old;
    buf_.resize(old + kChunk);
    size_t k = in_.read(&buf_[old], kChunk);
    buf_.resize(old + k);
    if (k == 0) eof_ = true;
  }
}

}  // namespace mfsdp
