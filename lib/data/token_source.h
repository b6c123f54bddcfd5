// Memory-mapped token files: Megatron-LM indexed datasets (.bin + .idx) and llm.c token files.
// Both are presented as a list of sequences (token ranges) grouped into documents.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mfsdp {

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // throws UserError naming the file
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Gives back the resident pages of bytes [offset, offset + n) (whole pages inside or touching
  // the range): a read-only shared mapping's pages count in the process's RSS while mapped, and a
  // reader that is done with them (model.init_from, tensor by tensor) need not hold them. The
  // bytes stay readable (the kernel reads them again from the page cache).
  void drop_pages(size_t offset, size_t n) const;

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

class TokenSource {
 public:
  // `path`: a Megatron prefix (path.bin + path.idx; a trailing .bin or .idx is accepted) or an
  // llm.c .bin file. format: auto | megatron | llmc.
  static std::unique_ptr<TokenSource> open(const std::string& path, const std::string& format);

  const std::string& name() const { return name_; }
  const std::string& kind() const { return kind_; }
  int64_t num_sequences() const { return static_cast<int64_t>(seq_offsets_.size()); }
  int64_t seq_offset(int64_t s) const { return seq_offsets_[s]; }  // in tokens from the start of the data
  int64_t seq_length(int64_t s) const { return seq_lengths_[s]; }
  // Sequence-index boundaries of documents: doc d is sequences [doc_bounds[d], doc_bounds[d+1]).
  const std::vector<int64_t>& doc_bounds() const { return doc_bounds_; }
  int64_t num_tokens() const { return num_tokens_; }
  // Copies tokens [offset, offset + n) of the data, widened to int64.
  void read(int64_t offset, int64_t n, int64_t* out) const;

 private:
  std::string name_, kind_;
  std::unique_ptr<MappedFile> bin_;
  size_t data_start_ = 0;  // byte offset of token 0 in bin_
  int dtype_code_ = 0;     // Megatron dtype codes; llm.c uses 8 (uint16) or 9 (uint32)
  int elem_size_ = 0;
  int64_t num_tokens_ = 0;
  std::vector<int64_t> seq_offsets_, seq_lengths_, doc_bounds_;

  void open_megatron(const std::string& prefix);
  void open_llmc(const std::string& path);
};

// Writes a Megatron indexed dataset (prefix.bin + prefix.idx) atomically: temporary files renamed
// into place once complete. One sequence per document.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(std::string prefix, int dtype_code);  // 8 (uint16) or 4 (int32)
  void add_document(const std::vector<int64_t>& tokens);
  void add_document(const int32_t* tokens, size_t n);
  void finish();
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_documents() const { return static_cast<int64_t>(lengths_.size()); }
  ~IndexedDatasetWriter();

 private:
  std::string prefix_;
  int dtype_code_;
  FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  int64_t num_tokens_ = 0;
  bool finished_ = false;
};

int megatron_dtype_size(int code);  // 0 for unknown codes

}  // namespace mfsdp
