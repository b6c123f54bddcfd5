#include "data/prepare.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>

#include "data/token_source.h"
#include "util/error.h"

#ifdef MFSDP_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

namespace mfsdp {

bool sentencepiece_available() {
#ifdef MFSDP_HAVE_SENTENCEPIECE
  return true;
#else
  return false;
#endif
}

namespace {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual void encode(const std::string& text, std::vector<int64_t>& out) = 0;
  virtual int64_t eod() const = 0;  // -1: none
  virtual int64_t vocab_size() const = 0;
  virtual std::string name() const = 0;
};

class ByteTokenizer final : public Tokenizer {
 public:
  void encode(const std::string& text, std::vector<int64_t>& out) override {
    for (unsigned char c : text) out.push_back(c);
  }
  int64_t eod() const override { return kByteEod; }
  int64_t vocab_size() const override { return kByteVocab; }
  std::string name() const override { return "byte-level (0..255 bytes, 256 end-of-document)"; }
};

#ifdef MFSDP_HAVE_SENTENCEPIECE
class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    auto status = sp_.Load(path);
    if (!status.ok()) throw UserError(path + ": cannot load the SentencePiece model: " + status.ToString());
  }
  void encode(const std::string& text, std::vector<int64_t>& out) override {
    std::vector<int> ids;
    auto status = sp_.Encode(text, &ids);
    if (!status.ok()) throw UserError(path_ + ": SentencePiece encoding failed: " + status.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  }
  int64_t eod() const override { return sp_.eos_id(); }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::string name() const override { return "SentencePiece " + path_; }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};
#endif

std::string read_all(const std::string& path) {
  if (path == "-") {
    std::stringstream ss;
    ss << std::cin.rdbuf();
    return ss.str();
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(path + ": cannot open the input text: " + std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

PrepareResult prepare_data(const PrepareOptions& o) {
  if (o.inputs.empty()) throw UserError("prepare-data: give at least one --input text file");
  std::unique_ptr<Tokenizer> tok;
  if (o.tokenizer_model.empty()) {
    tok = std::make_unique<ByteTokenizer>();
  } else {
#ifdef MFSDP_HAVE_SENTENCEPIECE
    tok = std::make_unique<SentencePieceTokenizer>(o.tokenizer_model);
#else
    throw UserError("prepare-data --tokenizer-model: this build has no SentencePiece tokenizer (Debian's "
                    "libsentencepiece and LibTorch load conflicting protobuf copies into one process); tokenize "
                    "with SentencePiece outside mfsdp and write a Megatron dataset, or use the byte-level tokenizer");
#endif
  }
  // Megatron's rule: uint16 tokens when the vocabulary fits, else int32.
  IndexedDatasetWriter writer(o.output_prefix, tok->vocab_size() < 65500 ? 8 : 4);
  std::vector<int64_t> ids;
  auto add = [&](const std::string& text) {
    ids.clear();
    tok->encode(text, ids);
    if (o.append_eod && tok->eod() >= 0) ids.push_back(tok->eod());
    if (!ids.empty()) writer.add_document(ids);
  };
  for (const auto& path : o.inputs) {
    std::string text = read_all(path);
    if (o.split_lines) {
      size_t start = 0;
      while (start < text.size()) {
        size_t end = text.find('\n', start);
        if (end == std::string::npos) end = text.size();
        std::string line = text.substr(start, end - start);
        if (line.find_first_not_of(" \t\r") != std::string::npos) add(line + "\n");
        start = end + 1;
      }
    } else if (!text.empty()) {
      add(text);
    }
  }
  if (writer.num_documents() == 0) throw UserError("prepare-data: the inputs hold no text");
  writer.finish();
  return {writer.num_documents(), writer.num_tokens(), tok->vocab_size(), tok->name()};
}

}  // namespace mfsdp
