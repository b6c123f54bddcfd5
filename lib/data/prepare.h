// `mfsdp prepare-data`: text, JSONL, gzip- or zstd-compressed files to Megatron indexed datasets
// (.bin + .idx), tokenized by the built-in byte-level tokenizer or a real one (tokenizer/), on
// N worker threads with output identical whatever N (DESIGN.md section 12).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace mfsdp {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files; "-" is standard input
  std::string output_prefix;        // text: PREFIX.bin/.idx; JSONL: PREFIX_<key>_document.bin/.idx
  bool split_lines = false;         // text: one document per non-empty line instead of per file
  std::vector<std::string> json_keys;  // JSONL: the keys whose strings are documents (default "text")
  std::string tokenizer = "byte";   // see load_tokenizer()
  TokenizerOptions tokenizer_options;
  int append_eod = -1;              // -1: the tokenizer's default (byte-level yes, others no); 0 or 1
  int workers = 1;
  bool skip_bad = false;            // skip and count bad records instead of stopping at the first
  int progress = -1;                // -1: when stderr is a terminal; 0 never; 1 always
};

struct PrepareOutput {
  std::string key, prefix;  // key: the JSON key ("" for text inputs)
  int64_t documents = 0, tokens = 0;
};

struct PrepareResult {
  std::vector<PrepareOutput> outputs;
  int64_t documents = 0, tokens = 0, skipped = 0;
  uint64_t bytes = 0;  // text bytes tokenized
  double seconds = 0;
  TokenizerInfo tokenizer;
  const char* dtype = "uint16";
};

constexpr int64_t kByteEod = 256;
constexpr int64_t kByteVocab = 257;

PrepareResult prepare_data(const PrepareOptions& opts);

}  // namespace mfsdp
