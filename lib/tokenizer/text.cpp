// Text primitives: see text.h.
#include "tokenizer/text.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <cstdlib>

#include "util/error.h"

namespace mfsdp::text {

void append_cp(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t invalid_utf8_at(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII fast path: eight bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const unsigned char c = p[i];
    if (c < 0x80) { ++i; continue; }
    size_t len;
    char32_t cp, min;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; min = 0x80; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; min = 0x800; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; min = 0x10000; }
    else return i;
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

bool is_whitespace(char32_t c) {
  // Unicode's White_Space property (PropList.txt); utf8proc has categories, not this property.
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

namespace {
utf8proc_category_t cat(char32_t c) { return utf8proc_category(static_cast<utf8proc_int32_t>(c)); }
}  // namespace

bool is_alphanumeric(char32_t c) {
  switch (cat(c)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT: case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

bool is_punctuation(char32_t c) {
  if (c < 0x80) return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) || (c >= 0x7B && c <= 0x7E);
  switch (cat(c)) {
    case UTF8PROC_CATEGORY_PC: case UTF8PROC_CATEGORY_PD: case UTF8PROC_CATEGORY_PS: case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI: case UTF8PROC_CATEGORY_PF: case UTF8PROC_CATEGORY_PO:
      return true;
    default:
      return false;
  }
}

bool is_mark(char32_t c) {
  auto k = cat(c);
  return k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_MC || k == UTF8PROC_CATEGORY_ME;
}

bool is_numeric(char32_t c) {
  auto k = cat(c);
  return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

std::string normalize(std::string_view s, Form form) {
  int opts = UTF8PROC_STABLE;
  switch (form) {
    case Form::NFC: opts |= UTF8PROC_COMPOSE; break;
    case Form::NFD: opts |= UTF8PROC_DECOMPOSE; break;
    case Form::NFKC: opts |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case Form::NFKD: opts |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* out = nullptr;
  auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()), &out,
                        static_cast<utf8proc_option_t>(opts));
  if (n < 0) throw UserError(std::string("Unicode normalisation failed: ") + utf8proc_errmsg(n));
  std::string r(reinterpret_cast<char*>(out), static_cast<size_t>(n));
  std::free(out);
  return r;
}

std::string lowercase(std::string_view s) {
  std::string r;
  r.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    char32_t c = next_cp(s, i);
    if (c == 0x130) {  // İ: the one code point whose unconditional lower case is two (i + U+0307)
      r += "i\xCC\x87";
      continue;
    }
    append_cp(r, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
  }
  return r;
}

// --- Regex ---------------------------------------------------------------------------------------

Regex::Regex(const std::string& pattern, const std::string& what) : pattern_(pattern), what_(what) {
  int err = 0;
  PCRE2_SIZE off = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err, &off,
                        nullptr);
  if (!code_) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw UserError(what + ": cannot compile the regular expression at offset " + std::to_string(off) + ": " +
                    reinterpret_cast<char*>(msg) + " (pattern: " + pattern + ")");
  }
  jit_ = pcre2_jit_compile(static_cast<pcre2_code*>(code_), PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

Regex::Matcher::Matcher(const Regex& re) : re_(re) {
  match_data_ = pcre2_match_data_create_from_pattern(static_cast<pcre2_code*>(re.code_), nullptr);
  if (re.jit_) {
    // Lookahead over long runs of whitespace needs more than the default 32 KiB JIT stack.
    jit_stack_ = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    context_ = pcre2_match_context_create(nullptr);
    pcre2_jit_stack_assign(static_cast<pcre2_match_context*>(context_), nullptr, static_cast<pcre2_jit_stack*>(jit_stack_));
  }
}

Regex::Matcher::~Matcher() {
  pcre2_match_data_free(static_cast<pcre2_match_data*>(match_data_));
  if (context_) pcre2_match_context_free(static_cast<pcre2_match_context*>(context_));
  if (jit_stack_) pcre2_jit_stack_free(static_cast<pcre2_jit_stack*>(jit_stack_));
}

void Regex::Matcher::find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) {
  auto* code = static_cast<pcre2_code*>(re_.code_);
  auto* md = static_cast<pcre2_match_data*>(match_data_);
  auto* ctx = static_cast<pcre2_match_context*>(context_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t pos = 0;
  while (pos <= s.size()) {
    // The caller validated the UTF-8 once per document: skip PCRE2's check on every call.
    int rc = re_.jit_ ? pcre2_jit_match(code, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md, ctx)
                      : pcre2_match(code, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw UserError(re_.what_ + ": matching the regular expression failed: " + reinterpret_cast<char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    size_t b = ov[0], e = ov[1];
    if (e == b) {  // an empty match is a boundary; go on one code point later
      out.emplace_back(b, e);
      if (b >= s.size()) return;
      pos = b + cp_len(static_cast<unsigned char>(s[b]));
      continue;
    }
    out.emplace_back(b, e);
    pos = e;
  }
}

}  // namespace mfsdp::text
