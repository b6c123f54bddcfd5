// Text primitives the tokenizers share: UTF-8 walking and validation, Unicode properties and
// normalisation (utf8proc), and regular expressions (PCRE2 with its JIT).
//
// Why PCRE2: the pre-tokenizer patterns of GPT-2, cl100k, o200k, Llama 3 and Qwen use lookahead
// (`\s+(?!\S)`), possessive quantifiers and `(?i:...)`; RE2 has none of these. PCRE2 with
// PCRE2_UTF|PCRE2_UCP gives \s, \p{L} and \p{N} their Unicode meaning, as Python's `regex`,
// Oniguruma (tokenizers) and fancy-regex (tiktoken) do.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace mfsdp::text {

// Decodes the code point at s[i] (s must be valid UTF-8) and advances i past it.
inline char32_t next_cp(std::string_view s, size_t& i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) { ++i; return c; }
  if (c < 0xE0) { char32_t r = ((c & 0x1F) << 6) | (s[i + 1] & 0x3F); i += 2; return r; }
  if (c < 0xF0) {
    char32_t r = ((c & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
    i += 3;
    return r;
  }
  char32_t r = ((c & 0x07) << 18) | ((s[i + 1] & 0x3F) << 12) | ((s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F);
  i += 4;
  return r;
}
// Length in bytes of the UTF-8 sequence that starts with byte c (valid UTF-8 assumed).
inline size_t cp_len(unsigned char c) { return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; }
void append_cp(std::string& out, char32_t cp);

// Offset of the first byte that is not well-formed UTF-8 (overlongs, surrogates and code points
// above U+10FFFF included), or npos when all of s is valid.
size_t invalid_utf8_at(std::string_view s);

// Unicode properties (utf8proc's tables).
bool is_whitespace(char32_t c);   // White_Space, as Rust's char::is_whitespace
bool is_alphanumeric(char32_t c); // Alphabetic or Numeric (L*, N*), as Rust's char::is_alphanumeric
bool is_punctuation(char32_t c);  // ASCII punctuation or Unicode P*
bool is_mark(char32_t c);         // M* (combining marks)
bool is_numeric(char32_t c);      // N*, as Rust's char::is_numeric

enum class Form { NFC, NFD, NFKC, NFKD };
std::string normalize(std::string_view s, Form form);
// Lower-cases each code point with its full, context-free mapping (Rust's char::to_lowercase).
std::string lowercase(std::string_view s);

// A compiled pattern. Thread-safe: each thread matches with its own Matcher.
class Regex {
 public:
  // `what` names the pattern's origin in errors ("tokenizer.json: pre_tokenizer.pattern").
  Regex(const std::string& pattern, const std::string& what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  const std::string& pattern() const { return pattern_; }

  // Per-thread match state (PCRE2 match data and JIT stack).
  class Matcher {
   public:
    explicit Matcher(const Regex& re);
    ~Matcher();
    Matcher(const Matcher&) = delete;
    Matcher& operator=(const Matcher&) = delete;
    // The non-overlapping matches of the pattern in s, left to right, as [start, end) byte
    // ranges. An empty match is reported (a boundary) and the search goes on one code point later,
    // as Rust's and Python's iterators do.
    void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out);

   private:
    const Regex& re_;
    void* match_data_ = nullptr;
    void* jit_stack_ = nullptr;
    void* context_ = nullptr;
  };

 private:
  std::string pattern_, what_;
  void* code_ = nullptr;
  bool jit_ = false;
};

}  // namespace mfsdp::text
