// `mfsdp prepare-data`: text files to a Megatron indexed dataset, with the built-in byte-level
// tokenizer (ids 0..255 are bytes, 256 is end-of-document) or a SentencePiece model.
#pragma once
#include <string>
#include <vector>

namespace mfsdp {

struct PrepareOptions {
  std::vector<std::string> inputs;  // text files; "-" is standard input
  std::string output_prefix;        // writes PREFIX.bin and PREFIX.idx
  bool split_lines = false;         // one document per non-empty line instead of per file
  std::string tokenizer_model;      // SentencePiece .model; empty: byte-level
  bool append_eod = true;
};

struct PrepareResult {
  int64_t documents = 0, tokens = 0, vocab_size = 0;
  std::string tokenizer;
};

constexpr int64_t kByteEod = 256;
constexpr int64_t kByteVocab = 257;

PrepareResult prepare_data(const PrepareOptions& opts);
bool sentencepiece_available();

}  // namespace mfsdp
