// Tokenizers for prepare-data, in C++ so that no Python runs at data-preparation time. Formats
// (DESIGN.md section 12):
//   - Hugging Face tokenizer.json: the BPE model (byte-level: GPT-2, Llama 3, Qwen, Mistral Nemo;
//     byte fallback with the ▁ marker: Llama 2, Mistral), its normalizers, pre-tokenizers, added
//     and special tokens, and the post-processor's template (BOS/EOS);
//   - a GPT-2 directory: vocab.json (encoder.json) + merges.txt (vocab.bpe);
//   - tiktoken rank files (`<base64 bytes> <rank>` lines) with their encoder's pattern, and
//     Mistral's Tekken JSON (tiktoken ranks, pattern and special tokens in one file);
//   - SentencePiece .model files (libsentencepiece);
//   - the built-in byte-level tokenizer (ids 0..255 are bytes, 256 ends a document).
// Each is held to its reference Python library (tokenizers, tiktoken, sentencepiece) on genuine
// vocabularies by tests/tokenizer/check_tokenizers.py.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace mfsdp {

struct TokenizerInfo {
  std::string kind;       // "huggingface", "gpt2-bpe", "tiktoken", "tekken", "sentencepiece", "byte"
  std::string path;
  std::string describe;   // one line for logs
  int64_t vocab_size = 0; // max id + 1, added tokens included
  int64_t eod = -1;       // end-of-document token id (-1: none known)
  int64_t bos = -1;
};

// Per-thread encoding state (regex match data, a cache of encoded words). Not thread-safe; make
// one per thread from the (thread-safe, immutable) Tokenizer.
class TokenizerSession {
 public:
  virtual ~TokenizerSession() = default;
  // Appends the ids of `text` (valid UTF-8, except for the byte-level tokenizer) to `out`, with
  // the special tokens the tokenizer's template adds (BOS for Llama's tokenizer.json, say).
  virtual void encode(std::string_view text, std::vector<int32_t>& out) = 0;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::unique_ptr<TokenizerSession> session() const = 0;
  const TokenizerInfo& info() const { return info_; }
  // Whether encode() needs valid UTF-8 (all but the byte-level tokenizer).
  virtual bool needs_utf8() const { return true; }

 protected:
  TokenizerInfo info_;
};

struct TokenizerOptions {
  // tiktoken rank files carry no pattern: gpt2 | r50k_base | p50k_base | cl100k_base | o200k_base,
  // or empty to infer it from the file name.
  std::string tiktoken_encoding;
  // The end-of-document token by its text (overrides what the tokenizer files say).
  std::string eod_token;
};

// `spec`: "byte" (built-in), a tokenizer.json / Tekken .json, a .tiktoken rank file, a
// SentencePiece .model, or a directory holding tokenizer.json, vocab.json + merges.txt, or
// tokenizer.model (looked for in that order). Errors name the file and what was expected.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec, const TokenizerOptions& opts = {});
bool sentencepiece_available();

namespace tok_detail {
std::unique_ptr<Tokenizer> load_hf_json(const std::string& path, const TokenizerOptions& opts);
std::unique_ptr<Tokenizer> load_gpt2_dir(const std::string& vocab, const std::string& merges, const TokenizerOptions& opts);
std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path, const TokenizerOptions& opts);
std::unique_ptr<Tokenizer> load_tekken(const std::string& path, const TokenizerOptions& opts);
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path, const TokenizerOptions& opts);
std::unique_ptr<Tokenizer> make_byte_tokenizer();
}  // namespace tok_detail

}  // namespace mfsdp
