#include "data/token_source.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fmt/format.h>

#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {

namespace {
bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}
template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
}  // namespace

int megatron_dtype_size(int code) {
  switch (code) {
    case 1: case 2: return 1;
    case 3: case 8: return 2;
    case 4: case 7: case 9: return 4;
    case 5: case 6: return 8;
  }
  return 0;
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw UserError(path + ": cannot open: " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw UserError(path + ": cannot stat: " + std::strerror(errno));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw UserError(path + ": cannot map into memory: " + std::strerror(errno));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

void MappedFile::drop_pages(size_t offset, size_t n) const {
  if (!data_ || n == 0 || offset >= size_) return;
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  const size_t begin = offset / page * page, end = std::min(size_, offset + n);
  // Advice only: a failure leaves the pages resident, which is what happened before the call.
  ::madvise(const_cast<uint8_t*>(data_) + begin, end - begin, MADV_DONTNEED);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

std::unique_ptr<TokenSource> TokenSource::open(const std::string& path, const std::string& format) {
  auto src = std::make_unique<TokenSource>();
  std::string prefix = path;
  if (ends_with(prefix, ".idx")) prefix = prefix.substr(0, prefix.size() - 4);
  const bool megatron_files = exists(prefix + ".idx") || (ends_with(prefix, ".bin") && exists(prefix.substr(0, prefix.size() - 4) + ".idx"));
  std::string fmt = format;
  if (fmt == "auto") {
    if (exists(prefix + ".idx") && exists(prefix + ".bin")) fmt = "megatron";
    else if (ends_with(path, ".bin") && megatron_files) fmt = "megatron";
    else if (ends_with(path, ".bin") && exists(path)) fmt = "llmc";
    else if (exists(prefix + ".idx")) fmt = "megatron";  // reports the missing .bin
    else
      throw UserError(path + ": no dataset here (data.train/data.valid): expected a Megatron prefix with " + path +
                      ".bin and " + path + ".idx, or an llm.c .bin token file");
  }
  if (fmt == "megatron") {
    if (ends_with(prefix, ".bin")) prefix = prefix.substr(0, prefix.size() - 4);
    src->open_megatron(prefix);
  } else {
    src->open_llmc(path);
  }
  return src;
}

void TokenSource::open_megatron(const std::string& prefix) {
  name_ = prefix;
  kind_ = "megatron";
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  if (!exists(idx_path)) throw UserError(idx_path + ": missing (the Megatron dataset " + prefix + " needs .bin and .idx)");
  if (!exists(bin_path)) throw UserError(bin_path + ": missing (the Megatron dataset " + prefix + " needs .bin and .idx)");
  MappedFile idx(idx_path);
  auto bad = [&](const std::string& why) { throw UserError(idx_path + ": not a valid Megatron index: " + why); };
  const uint8_t* p = idx.data();
  if (idx.size() < 34) bad(fmt::format("{} bytes, shorter than the 34-byte header", idx.size()));
  if (std::memcmp(p, "MMIDIDX\x00\x00", 9) != 0) bad("wrong magic (expected MMIDIDX)");
  const uint64_t version = load<uint64_t>(p + 9);
  if (version != 1) bad(fmt::format("version {} (expected 1)", version));
  dtype_code_ = p[17];
  elem_size_ = megatron_dtype_size(dtype_code_);
  if (elem_size_ == 0 || dtype_code_ == 9) bad(fmt::format("unknown dtype code {} (expected 1..8)", dtype_code_));
  const uint64_t S = load<uint64_t>(p + 18), D = load<uint64_t>(p + 26);
  const uint64_t need = 34 + 12 * S + 8 * D;
  if (S > (idx.size() / 12) || D > idx.size() / 8 || (idx.size() != need && idx.size() != need + S))
    bad(fmt::format("{} sequences and {} document indices need {} bytes (or {} with modes), the file has {}: "
                    "truncated or from another dataset",
                    S, D, need, need + S, idx.size()));
  if (D < 1) bad("no document indices");
  bin_ = std::make_unique<MappedFile>(bin_path);
  const int32_t* lengths = reinterpret_cast<const int32_t*>(p + 34);
  const uint8_t* ptrs = p + 34 + 4 * S;
  const uint8_t* docs = p + 34 + 12 * S;
  seq_offsets_.resize(S);
  seq_lengths_.resize(S);
  int64_t expected_ptr = 0;
  for (uint64_t i = 0; i < S; ++i) {
    int32_t len;
    std::memcpy(&len, lengths + i, 4);
    const int64_t ptr = load<int64_t>(ptrs + 8 * i);
    if (len < 0) bad(fmt::format("sequence {} has negative length {}", i, len));
    if (ptr < 0 || ptr % elem_size_ != 0) bad(fmt::format("sequence {} has a bad byte offset {}", i, ptr));
    if (uint64_t(ptr) + uint64_t(len) * elem_size_ > bin_->size())
      throw UserError(fmt::format("{}: truncated or mismatched: sequence {} ends at byte {} but the file has {} bytes "
                                  "(does it belong to {}?)",
                                  bin_path, i, uint64_t(ptr) + uint64_t(len) * elem_size_, bin_->size(), idx_path));
    seq_offsets_[i] = ptr / elem_size_;
    seq_lengths_[i] = len;
    expected_ptr = ptr + int64_t(len) * elem_size_;
  }
  num_tokens_ = int64_t(bin_->size()) / elem_size_;
  if (S > 0 && uint64_t(expected_ptr) != bin_->size())
    throw UserError(fmt::format("{}: {} bytes, but {} says its sequences end at byte {}: mismatched .bin/.idx pair",
                                bin_path, bin_->size(), idx_path, expected_ptr));
  doc_bounds_.resize(D);
  for (uint64_t d = 0; d < D; ++d) {
    doc_bounds_[d] = load<int64_t>(docs + 8 * d);
    if (d == 0 && doc_bounds_[0] != 0) bad("document indices must start with 0");
    if (d > 0 && doc_bounds_[d] < doc_bounds_[d - 1]) bad(fmt::format("document index {} decreases", d));
  }
  if (uint64_t(doc_bounds_.back()) != S)
    bad(fmt::format("the last document index is {}, expected the number of sequences {}", doc_bounds_.back(), S));
}

void TokenSource::open_llmc(const std::string& path) {
  name_ = path;
  kind_ = "llmc";
  bin_ = std::make_unique<MappedFile>(path);
  if (bin_->size() < 1024) throw UserError(path + ": not an llm.c token file: shorter than the 1024-byte header");
  const int32_t magic = load<int32_t>(bin_->data()), version = load<int32_t>(bin_->data() + 4);
  const int64_t n = load<int32_t>(bin_->data() + 8);
  if (magic == 20240520) {
    if (version != 1) throw UserError(fmt::format("{}: llm.c GPT-2 token file with version {} (expected 1)", path, version));
    dtype_code_ = 8;
    elem_size_ = 2;
  } else if (magic == 20240801) {
    if (version != 7) throw UserError(fmt::format("{}: llm.c Llama 3 token file with version {} (expected 7)", path, version));
    dtype_code_ = 9;
    elem_size_ = 4;
  } else {
    throw UserError(fmt::format("{}: not an llm.c token file (magic {}, expected 20240520 or 20240801); "
                                "for a Megatron dataset give the prefix without .bin",
                                path, magic));
  }
  if (n < 0 || uint64_t(1024 + n * elem_size_) != bin_->size())
    throw UserError(fmt::format("{}: the header says {} tokens ({} bytes with the header) but the file has {} bytes: "
                                "truncated or corrupt",
                                path, n, 1024 + n * elem_size_, bin_->size()));
  data_start_ = 1024;
  num_tokens_ = n;
  seq_offsets_ = {0};
  seq_lengths_ = {n};
  doc_bounds_ = {0, 1};
}

void TokenSource::read(int64_t offset, int64_t n, int64_t* out) const {
  const uint8_t* p = bin_->data() + data_start_ + size_t(offset) * elem_size_;
  switch (dtype_code_) {
    case 1: for (int64_t i = 0; i < n; ++i) out[i] = p[i]; break;
    case 2: for (int64_t i = 0; i < n; ++i) out[i] = int8_t(p[i]); break;
    case 3: for (int64_t i = 0; i < n; ++i) out[i] = load<int16_t>(p + 2 * i); break;
    case 4: for (int64_t i = 0; i < n; ++i) out[i] = load<int32_t>(p + 4 * i); break;
    case 5: for (int64_t i = 0; i < n; ++i) out[i] = load<int64_t>(p + 8 * i); break;
    case 6: for (int64_t i = 0; i < n; ++i) out[i] = int64_t(load<double>(p + 8 * i)); break;
    case 7: for (int64_t i = 0; i < n; ++i) out[i] = int64_t(load<float>(p + 4 * i)); break;
    case 8: for (int64_t i = 0; i < n; ++i) out[i] = load<uint16_t>(p + 2 * i); break;
    case 9: for (int64_t i = 0; i < n; ++i) out[i] = load<uint32_t>(p + 4 * i); break;
  }
}

// ---------------------------------------------------------------------------------------------
IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, int dtype_code)
    : prefix_(std::move(prefix)), dtype_code_(dtype_code) {
  if (dtype_code != 8 && dtype_code != 4) throw std::invalid_argument("IndexedDatasetWriter: dtype code 8 or 4");
  bin_ = std::fopen((prefix_ + ".bin.tmp").c_str(), "wb");
  if (!bin_) throw UserError(prefix_ + ".bin.tmp: cannot create: " + std::strerror(errno));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_) std::fclose(bin_);
  if (!finished_) {
    std::remove((prefix_ + ".bin.tmp").c_str());
    std::remove((prefix_ + ".idx.tmp").c_str());
  }
}

void IndexedDatasetWriter::add_document(const std::vector<int64_t>& tokens) {
  if (dtype_code_ == 8) {
    std::vector<uint16_t> buf(tokens.begin(), tokens.end());
    if (std::fwrite(buf.data(), 2, buf.size(), bin_) != buf.size())
      throw UserError(prefix_ + ".bin.tmp: write failed: " + std::strerror(errno));
  } else {
    std::vector<int32_t> buf(tokens.begin(), tokens.end());
    if (std::fwrite(buf.data(), 4, buf.size(), bin_) != buf.size())
      throw UserError(prefix_ + ".bin.tmp: write failed: " + std::strerror(errno));
  }
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  num_tokens_ += static_cast<int64_t>(tokens.size());
}

void IndexedDatasetWriter::add_document(const int32_t* tokens, size_t n) {
  size_t written;
  if (dtype_code_ == 8) {
    std::vector<uint16_t> buf(tokens, tokens + n);
    written = std::fwrite(buf.data(), 2, n, bin_);
  } else {
    written = std::fwrite(tokens, 4, n, bin_);
  }
  if (written != n) throw UserError(prefix_ + ".bin.tmp: write failed: " + std::strerror(errno));
  lengths_.push_back(static_cast<int32_t>(n));
  num_tokens_ += static_cast<int64_t>(n);
}

void IndexedDatasetWriter::finish() {
  if (std::fclose(bin_) != 0) {
    bin_ = nullptr;
    throw UserError(prefix_ + ".bin.tmp: write failed: " + std::strerror(errno));
  }
  bin_ = nullptr;
  const int esize = megatron_dtype_size(dtype_code_);
  std::string idx_tmp = prefix_ + ".idx.tmp";
  FILE* f = std::fopen(idx_tmp.c_str(), "wb");
  if (!f) throw UserError(idx_tmp + ": cannot create: " + std::strerror(errno));
  const uint64_t S = lengths_.size(), D = S + 1, version = 1;
  const uint8_t code = static_cast<uint8_t>(dtype_code_);
  bool ok = std::fwrite("MMIDIDX\x00\x00", 1, 9, f) == 9 && std::fwrite(&version, 8, 1, f) == 1 &&
            std::fwrite(&code, 1, 1, f) == 1 && std::fwrite(&S, 8, 1, f) == 1 && std::fwrite(&D, 8, 1, f) == 1 &&
            std::fwrite(lengths_.data(), 4, S, f) == S;
  std::vector<int64_t> ptrs(S), docs(D);
  int64_t off = 0;
  for (uint64_t i = 0; i < S; ++i) {
    ptrs[i] = off;
    off += int64_t(lengths_[i]) * esize;
  }
  for (uint64_t d = 0; d < D; ++d) docs[d] = int64_t(d);
  ok = ok && std::fwrite(ptrs.data(), 8, S, f) == S && std::fwrite(docs.data(), 8, D, f) == D;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) throw UserError(idx_tmp + ": write failed: " + std::strerror(errno));
  if (std::rename((prefix_ + ".bin.tmp").c_str(), (prefix_ + ".bin").c_str()) != 0 ||
      std::rename(idx_tmp.c_str(), (prefix_ + ".idx").c_str()) != 0)
    throw UserError(prefix_ + ": cannot rename the finished dataset into place: " + std::strerror(errno));
  finished_ = true;
}

}  // namespace mfsdp
