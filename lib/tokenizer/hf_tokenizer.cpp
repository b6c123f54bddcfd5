// Hugging Face tokenizer.json (and GPT-2's vocab.json + merges.txt, which become the same
// pipeline): added tokens -> normalizer -> pre-tokenizer -> BPE model -> post-processor template.
// Semantics follow the tokenizers crate (0.2x), which the tests hold us to id for id:
//   - added tokens are cut out of the raw text first (leftmost-longest; lstrip/rstrip swallow
//     whitespace, single_word needs non-word neighbours), the normalized=true ones again from each
//     normalized segment;
//   - normalizers and pre-tokenizers run per segment between added tokens, so Llama 2's legacy
//     Prepend("▁") also prefixes the text after a special token, as it does in Python;
//   - Metaspace's prepend_scheme "first" prefixes only a piece that starts at the text's offset 0;
//   - empty pieces vanish after every split.
#include <algorithm>
#include <array>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tokenizer/bpe.h"
#include "tokenizer/json_ids.h"
#include "tokenizer/text.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace mfsdp::tok_detail {
namespace {
using json = nlohmann::json;
using text::Regex;

struct Piece {
  std::string text;
  bool first;  // starts at offset 0 of the original text
};

// Matchers for every regex of a tokenizer, one set per session.
struct Scratch {
  std::vector<std::unique_ptr<Regex::Matcher>> matchers;
  std::vector<std::pair<size_t, size_t>> found;
};

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct Seg {
  size_t b, e;
  bool match;
};

// Applies a split behaviour to segments that cover a string (tokenizers' SplitDelimiterBehavior).
void apply_behavior(std::vector<Seg>& segs, Behavior how) {
  std::vector<Seg> out;
  bool prev_match = false;
  switch (how) {
    case Behavior::Removed:
      for (auto& s : segs)
        if (!s.match) out.push_back(s);
      break;
    case Behavior::Isolated:
      out = segs;
      break;
    case Behavior::MergedWithPrevious:
      for (auto& s : segs) {
        if (s.match && !prev_match && !out.empty()) out.back().e = s.e;
        else out.push_back(s);
        prev_match = s.match;
      }
      break;
    case Behavior::MergedWithNext:
      for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
        if (it->match && !prev_match && !out.empty()) out.back().b = it->b;
        else out.push_back(*it);
        prev_match = it->match;
      }
      std::reverse(out.begin(), out.end());
      break;
    case Behavior::Contiguous:
      for (auto& s : segs) {
        if (s.match == prev_match && !out.empty()) out.back().e = s.e;
        else out.push_back(s);
        prev_match = s.match;
      }
      break;
  }
  segs.swap(out);
}

// Segments of s around the given (sorted, non-overlapping) matches.
void segments_from_matches(size_t n, const std::vector<std::pair<size_t, size_t>>& m, bool invert, std::vector<Seg>& segs) {
  segs.clear();
  size_t pos = 0;
  for (auto [b, e] : m) {
    if (b > pos) segs.push_back({pos, b, invert});
    segs.push_back({b, e, !invert});
    pos = e;
  }
  if (pos < n || segs.empty()) segs.push_back({pos, n, invert});
}

// Replaces pieces by their splits; a split is `first` when its parent was and it starts at 0.
template <class SplitFn>
void split_pieces(std::vector<Piece>& pieces, SplitFn fn) {
  std::vector<Piece> out;
  out.reserve(pieces.size() * 2);
  std::vector<Seg> segs;
  for (auto& p : pieces) {
    segs.clear();
    fn(p, segs);
    for (const auto& s : segs) {
      if (s.e <= s.b) continue;
      out.push_back({p.text.substr(s.b, s.e - s.b), p.first && s.b == 0});
    }
  }
  pieces.swap(out);
}

Behavior parse_behavior(const json& j, const std::string& where) {
  std::string b = j.is_string() ? j.get<std::string>() : "";
  if (b == "Removed") return Behavior::Removed;
  if (b == "Isolated") return Behavior::Isolated;
  if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::MergedWithNext;
  if (b == "Contiguous") return Behavior::Contiguous;
  throw UserError(where + ": unknown split behavior " + j.dump() +
                  " (expected Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous)");
}

// GPT-2's byte -> printable character table (printable Latin-1 maps to itself; the other bytes to
// U+0100 onwards), as UTF-8 strings.
const std::array<std::string, 256>& byte_chars() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      text::append_cp(t[b], keep ? char32_t(b) : char32_t(256 + n++));
    }
    return t;
  }();
  return table;
}

const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// A pattern: a literal string or a regex (an index into the tokenizer's regex list).
struct Pattern {
  std::string literal;
  int regex = -1;
  void find(const std::string& s, Scratch& sc, std::vector<std::pair<size_t, size_t>>& out) const {
    out.clear();
    if (regex >= 0) {
      sc.matchers[regex]->find_all(s, out);
      return;
    }
    if (literal.empty()) return;
    for (size_t pos = s.find(literal); pos != std::string::npos; pos = s.find(literal, pos + literal.size()))
      out.emplace_back(pos, pos + literal.size());
  }
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void apply(std::string& s, Scratch& sc) const = 0;
};
class Pretok {
 public:
  virtual ~Pretok() = default;
  virtual void apply(std::vector<Piece>& pieces, Scratch& sc) const = 0;
};

struct AddedToken {
  std::string content;
  int32_t id;
  bool single_word, lstrip, rstrip, normalized, special;
};

class HfTokenizer;

class Loader {
 public:
  Loader(const std::string& path, std::vector<std::unique_ptr<Regex>>& regexes) : path_(path), regexes_(regexes) {}

  Pattern pattern(const json& j, const std::string& where) {
    Pattern p;
    if (j.is_object() && j.contains("String")) {
      p.literal = j["String"].get<std::string>();
    } else if (j.is_object() && j.contains("Regex")) {
      p.regex = add_regex(j["Regex"].get<std::string>(), where);
    } else {
      throw UserError(where + ": expected {\"String\": ...} or {\"Regex\": ...}, got " + j.dump());
    }
    return p;
  }
  int add_regex(const std::string& re, const std::string& where) {
    regexes_.push_back(std::make_unique<Regex>(re, where));
    return static_cast<int>(regexes_.size()) - 1;
  }
  std::unique_ptr<Normalizer> normalizer(const json& j, const std::string& where);
  std::unique_ptr<Pretok> pretok(const json& j, const std::string& where);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<std::unique_ptr<Regex>>& regexes_;
};

bool get_bool(const json& j, const char* key, bool dflt) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? dflt : it->get<bool>();
}
std::string get_str(const json& j, const char* key, const std::string& dflt = "") {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? dflt : it->get<std::string>();
}

// --- normalizers -----------------------------------------------------------------------------------

class UnicodeNorm final : public Normalizer {
 public:
  explicit UnicodeNorm(text::Form f) : f_(f) {}
  void apply(std::string& s, Scratch&) const override { s = text::normalize(s, f_); }

 private:
  text::Form f_;
};
class LowercaseNorm final : public Normalizer {
 public:
  void apply(std::string& s, Scratch&) const override { s = text::lowercase(s); }
};
class StripNorm final : public Normalizer {
 public:
  StripNorm(bool l, bool r) : l_(l), r_(r) {}
  void apply(std::string& s, Scratch&) const override {
    size_t b = 0, e = s.size();
    if (l_) {
      while (b < e) {
        size_t i = b;
        if (!text::is_whitespace(text::next_cp(s, i))) break;
        b = i;
      }
    }
    if (r_) {
      while (e > b) {
        size_t st = e - 1;
        while (st > b && (static_cast<unsigned char>(s[st]) & 0xC0) == 0x80) --st;
        size_t i = st;
        if (!text::is_whitespace(text::next_cp(s, i))) break;
        e = st;
      }
    }
    s = s.substr(b, e - b);
  }

 private:
  bool l_, r_;
};
class StripAccentsNorm final : public Normalizer {
 public:
  void apply(std::string& s, Scratch&) const override {
    std::string r;
    r.reserve(s.size());
    for (size_t i = 0; i < s.size();) {
      size_t st = i;
      char32_t c = text::next_cp(s, i);
      if (!text::is_mark(c)) r.append(s, st, i - st);
    }
    s.swap(r);
  }
};
class ReplaceNorm final : public Normalizer {
 public:
  ReplaceNorm(Pattern p, std::string content) : p_(std::move(p)), content_(std::move(content)) {}
  void apply(std::string& s, Scratch& sc) const override {
    std::vector<std::pair<size_t, size_t>> m;
    p_.find(s, sc, m);
    if (m.empty()) return;
    std::string r;
    r.reserve(s.size() + m.size() * content_.size());
    size_t pos = 0;
    for (auto [b, e] : m) {
      r.append(s, pos, b - pos);
      r += content_;
      pos = e;
    }
    r.append(s, pos, std::string::npos);
    s.swap(r);
  }

 private:
  Pattern p_;
  std::string content_;
};
class PrependNorm final : public Normalizer {
 public:
  explicit PrependNorm(std::string p) : p_(std::move(p)) {}
  void apply(std::string& s, Scratch&) const override {
    if (!s.empty()) s.insert(0, p_);
  }

 private:
  std::string p_;
};
class SequenceNorm final : public Normalizer {
 public:
  std::vector<std::unique_ptr<Normalizer>> items;
  void apply(std::string& s, Scratch& sc) const override {
    for (const auto& n : items) n->apply(s, sc);
  }
};

std::unique_ptr<Normalizer> Loader::normalizer(const json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  std::string type = get_str(j, "type");
  if (type == "NFC") return std::make_unique<UnicodeNorm>(text::Form::NFC);
  if (type == "NFD") return std::make_unique<UnicodeNorm>(text::Form::NFD);
  if (type == "NFKC") return std::make_unique<UnicodeNorm>(text::Form::NFKC);
  if (type == "NFKD") return std::make_unique<UnicodeNorm>(text::Form::NFKD);
  if (type == "Lowercase") return std::make_unique<LowercaseNorm>();
  if (type == "Strip") return std::make_unique<StripNorm>(get_bool(j, "strip_left", true), get_bool(j, "strip_right", true));
  if (type == "StripAccents") return std::make_unique<StripAccentsNorm>();
  if (type == "Replace") return std::make_unique<ReplaceNorm>(pattern(j.at("pattern"), where + ".pattern"), get_str(j, "content"));
  if (type == "Prepend") return std::make_unique<PrependNorm>(get_str(j, "prepend"));
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceNorm>();
    const json& items = j.at("normalizers");
    for (size_t i = 0; i < items.size(); ++i)
      if (auto n = normalizer(items[i], where + ".normalizers[" + std::to_string(i) + "]")) seq->items.push_back(std::move(n));
    return seq;
  }
  throw UserError(where + ": unsupported normalizer type \"" + type +
                  "\" (supported: NFC, NFD, NFKC, NFKD, Lowercase, Strip, StripAccents, Replace, Prepend, Sequence)");
}

// --- pre-tokenizers --------------------------------------------------------------------------------

class ByteLevelPretok final : public Pretok {
 public:
  ByteLevelPretok(bool add_prefix_space, int regex) : add_prefix_space_(add_prefix_space), regex_(regex) {}
  void apply(std::vector<Piece>& pieces, Scratch& sc) const override {
    if (add_prefix_space_)
      for (auto& p : pieces)
        if (p.text.empty() || p.text[0] != ' ') p.text.insert(0, " ");
    if (regex_ >= 0) {
      split_pieces(pieces, [&](const Piece& p, std::vector<Seg>& segs) {
        sc.found.clear();
        sc.matchers[regex_]->find_all(p.text, sc.found);
        segments_from_matches(p.text.size(), sc.found, false, segs);
      });
    }
    const auto& table = byte_chars();
    for (auto& p : pieces) {
      std::string r;
      r.reserve(p.text.size() * 2);
      for (unsigned char c : p.text) r += table[c];
      p.text.swap(r);
    }
  }

 private:
  bool add_prefix_space_;
  int regex_;
};

class SplitPretok final : public Pretok {
 public:
  SplitPretok(Pattern p, Behavior b, bool invert) : p_(std::move(p)), b_(b), invert_(invert) {}
  void apply(std::vector<Piece>& pieces, Scratch& sc) const override {
    split_pieces(pieces, [&](const Piece& p, std::vector<Seg>& segs) {
      p_.find(p.text, sc, sc.found);
      segments_from_matches(p.text.size(), sc.found, invert_, segs);
      apply_behavior(segs, b_);
    });
  }

 private:
  Pattern p_;
  Behavior b_;
  bool invert_;
};

class MetaspacePretok final : public Pretok {
 public:
  enum class Prepend { Always, First, Never };
  MetaspacePretok(std::string rep, Prepend scheme, bool split) : rep_(std::move(rep)), scheme_(scheme), split_(split) {}
  void apply(std::vector<Piece>& pieces, Scratch&) const override {
    for (auto& p : pieces) {
      std::string r;
      r.reserve(p.text.size() + 8);
      for (char c : p.text) {
        if (c == ' ') r += rep_;
        else r.push_back(c);
      }
      const bool starts = r.compare(0, rep_.size(), rep_) == 0;
      if (!starts && (scheme_ == Prepend::Always || (scheme_ == Prepend::First && p.first))) r.insert(0, rep_);
      p.text.swap(r);
    }
    if (!split_) return;
    split_pieces(pieces, [&](const Piece& p, std::vector<Seg>& segs) {
      std::vector<std::pair<size_t, size_t>> m;
      for (size_t pos = p.text.find(rep_); pos != std::string::npos; pos = p.text.find(rep_, pos + rep_.size()))
        m.emplace_back(pos, pos + rep_.size());
      segments_from_matches(p.text.size(), m, false, segs);
      apply_behavior(segs, Behavior::MergedWithNext);
    });
  }

 private:
  std::string rep_;
  Prepend scheme_;
  bool split_;
};

// Splits by a per-code-point predicate (Digits, Punctuation, WhitespaceSplit, CharDelimiterSplit).
template <class Pred>
void split_by_char(std::vector<Piece>& pieces, Pred pred, Behavior how, bool each_char) {
  split_pieces(pieces, [&](const Piece& p, std::vector<Seg>& segs) {
    std::vector<std::pair<size_t, size_t>> m;
    for (size_t i = 0; i < p.text.size();) {
      size_t st = i;
      char32_t c = text::next_cp(p.text, i);
      if (!pred(c)) continue;
      if (!each_char && !m.empty() && m.back().second == st) m.back().second = i;
      else m.emplace_back(st, i);
    }
    segments_from_matches(p.text.size(), m, false, segs);
    apply_behavior(segs, how);
  });
}

class DigitsPretok final : public Pretok {
 public:
  explicit DigitsPretok(bool individual) : individual_(individual) {}
  void apply(std::vector<Piece>& pieces, Scratch&) const override {
    // tokenizers: individual -> Isolated per digit; otherwise Contiguous over digit runs.
    if (individual_) split_by_char(pieces, text::is_numeric, Behavior::Isolated, true);
    else split_by_char(pieces, text::is_numeric, Behavior::Contiguous, true);
  }

 private:
  bool individual_;
};
class PunctuationPretok final : public Pretok {
 public:
  explicit PunctuationPretok(Behavior b) : b_(b) {}
  void apply(std::vector<Piece>& pieces, Scratch&) const override { split_by_char(pieces, text::is_punctuation, b_, true); }

 private:
  Behavior b_;
};
class WhitespaceSplitPretok final : public Pretok {
 public:
  void apply(std::vector<Piece>& pieces, Scratch&) const override {
    split_by_char(pieces, text::is_whitespace, Behavior::Removed, true);
  }
};
class CharDelimiterPretok final : public Pretok {
 public:
  explicit CharDelimiterPretok(char32_t d) : d_(d) {}
  void apply(std::vector<Piece>& pieces, Scratch&) const override {
    split_by_char(pieces, [this](char32_t c) { return c == d_; }, Behavior::Removed, true);
  }

 private:
  char32_t d_;
};
class WhitespacePretok final : public Pretok {
 public:
  explicit WhitespacePretok(int regex) : regex_(regex) {}
  void apply(std::vector<Piece>& pieces, Scratch& sc) const override {
    // tokenizers' Whitespace: the matches of \w+|[^\w\s]+, the rest removed.
    split_pieces(pieces, [&](const Piece& p, std::vector<Seg>& segs) {
      sc.found.clear();
      sc.matchers[regex_]->find_all(p.text, sc.found);
      segments_from_matches(p.text.size(), sc.found, false, segs);
      apply_behavior(segs, Behavior::Isolated);
      std::vector<Seg> keep;
      for (auto& s : segs)
        if (s.match) keep.push_back(s);
      segs.swap(keep);
    });
  }

 private:
  int regex_;
};
class SequencePretok final : public Pretok {
 public:
  std::vector<std::unique_ptr<Pretok>> items;
  void apply(std::vector<Piece>& pieces, Scratch& sc) const override {
    for (const auto& p : items) p->apply(pieces, sc);
  }
};

std::unique_ptr<Pretok> Loader::pretok(const json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  std::string type = get_str(j, "type");
  if (type == "ByteLevel") {
    int re = get_bool(j, "use_regex", true) ? add_regex(kGpt2Pattern, where + " (GPT-2 pattern)") : -1;
    return std::make_unique<ByteLevelPretok>(get_bool(j, "add_prefix_space", true), re);
  }
  if (type == "Split") {
    return std::make_unique<SplitPretok>(pattern(j.at("pattern"), where + ".pattern"),
                                         parse_behavior(j.at("behavior"), where + ".behavior"), get_bool(j, "invert", false));
  }
  if (type == "Metaspace") {
    std::string rep = get_str(j, "replacement", "\xE2\x96\x81");
    MetaspacePretok::Prepend scheme;
    if (j.contains("prepend_scheme") && !j["prepend_scheme"].is_null()) {
      std::string s = j["prepend_scheme"].get<std::string>();
      if (s == "always") scheme = MetaspacePretok::Prepend::Always;
      else if (s == "first") scheme = MetaspacePretok::Prepend::First;
      else if (s == "never") scheme = MetaspacePretok::Prepend::Never;
      else throw UserError(where + ".prepend_scheme: \"" + s + "\" (expected always, first or never)");
    } else {
      // Files written before prepend_scheme existed: add_prefix_space true means always.
      scheme = get_bool(j, "add_prefix_space", true) ? MetaspacePretok::Prepend::Always : MetaspacePretok::Prepend::Never;
    }
    return std::make_unique<MetaspacePretok>(rep, scheme, get_bool(j, "split", true));
  }
  if (type == "Digits") return std::make_unique<DigitsPretok>(get_bool(j, "individual_digits", false));
  if (type == "Punctuation")
    return std::make_unique<PunctuationPretok>(j.contains("behavior") ? parse_behavior(j["behavior"], where + ".behavior")
                                                                      : Behavior::Isolated);
  if (type == "WhitespaceSplit") return std::make_unique<WhitespaceSplitPretok>();
  if (type == "Whitespace") return std::make_unique<WhitespacePretok>(add_regex(R"(\w+|[^\w\s]+)", where));
  if (type == "CharDelimiterSplit") {
    std::string d = get_str(j, "delimiter");
    size_t i = 0;
    if (d.empty() || text::invalid_utf8_at(d) != std::string::npos) throw UserError(where + ".delimiter: expected one character");
    return std::make_unique<CharDelimiterPretok>(text::next_cp(d, i));
  }
  if (type == "Sequence") {
    auto seq = std::make_unique<SequencePretok>();
    const json& items = j.at("pretokenizers");
    for (size_t i = 0; i < items.size(); ++i)
      if (auto p = pretok(items[i], where + ".pretokenizers[" + std::to_string(i) + "]")) seq->items.push_back(std::move(p));
    return seq;
  }
  throw UserError(where + ": unsupported pre-tokenizer type \"" + type +
                  "\" (supported: ByteLevel, Split, Metaspace, Digits, Punctuation, Whitespace, WhitespaceSplit, "
                  "CharDelimiterSplit, Sequence)");
}

// --- the tokenizer ---------------------------------------------------------------------------------

// Leftmost-longest matching of added tokens (tokenizers uses Aho-Corasick with that match kind).
class AddedMatcher {
 public:
  void add(const AddedToken* t) {
    if (t->content.empty()) return;
    auto& v = by_first_[static_cast<unsigned char>(t->content[0])];
    v.push_back(t);
    std::sort(v.begin(), v.end(), [](auto* a, auto* b) { return a->content.size() > b->content.size(); });
    any_ = true;
  }
  bool empty() const { return !any_; }
  struct Hit {
    size_t b, e;
    int32_t id;
  };
  void find(const std::string& s, std::vector<Hit>& out) const {
    out.clear();
    size_t pos = 0;
    while (pos < s.size()) {
      const auto& cands = by_first_[static_cast<unsigned char>(s[pos])];
      const AddedToken* hit = nullptr;
      for (const AddedToken* t : cands) {
        if (s.compare(pos, t->content.size(), t->content) != 0) continue;
        if (t->single_word && !word_bounded(s, pos, pos + t->content.size())) continue;
        hit = t;
        break;
      }
      if (!hit) {
        ++pos;
        continue;
      }
      size_t b = pos, e = pos + hit->content.size();
      if (hit->lstrip) {
        size_t floor = out.empty() ? 0 : out.back().e;
        while (b > floor) {
          size_t st = b - 1;
          while (st > floor && (static_cast<unsigned char>(s[st]) & 0xC0) == 0x80) --st;
          size_t i = st;
          if (!text::is_whitespace(text::next_cp(s, i))) break;
          b = st;
        }
      }
      if (hit->rstrip) {
        while (e < s.size()) {
          size_t i = e;
          if (!text::is_whitespace(text::next_cp(s, i))) break;
          e = i;
        }
      }
      out.push_back({b, e, hit->id});
      pos = e;
    }
  }

 private:
  static bool is_word(char32_t c) { return text::is_alphanumeric(c) || c == '_'; }
  static bool word_bounded(const std::string& s, size_t b, size_t e) {
    if (b > 0) {
      size_t st = b - 1;
      while (st > 0 && (static_cast<unsigned char>(s[st]) & 0xC0) == 0x80) --st;
      size_t i = st;
      if (is_word(text::next_cp(s, i))) return false;
    }
    if (e < s.size()) {
      size_t i = e;
      if (is_word(text::next_cp(s, i))) return false;
    }
    return true;
  }
  std::array<std::vector<const AddedToken*>, 256> by_first_;
  bool any_ = false;
};

class HfTokenizer final : public Tokenizer {
 public:
  HfTokenizer(const json& j, const std::string& path, const std::string& kind, const TokenizerOptions& opts);
  std::unique_ptr<TokenizerSession> session() const override;

  void encode(std::string_view text, std::vector<int32_t>& out, Scratch& sc, text::WordCache& cache) const;

 private:
  std::vector<std::unique_ptr<Regex>> regexes_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<Pretok> pretok_;
  std::unique_ptr<text::BpeModel> model_;
  std::vector<AddedToken> added_;
  AddedMatcher raw_added_, norm_added_;
  // Post-processor: ids before and after the sequence (a template's single form, or cls/sep).
  std::vector<int32_t> prefix_ids_, suffix_ids_;

  void encode_segment(std::string seg, bool first, std::vector<int32_t>& out, Scratch& sc, text::WordCache& cache) const;
  void parse_post(const json& j, const std::string& where);
  int32_t token_id(const std::string& tok) const {
    for (const auto& a : added_)
      if (a.content == tok) return a.id;
    return model_->token_id(tok);
  }
};

class HfSession final : public TokenizerSession {
 public:
  explicit HfSession(const HfTokenizer& t, const std::vector<std::unique_ptr<Regex>>& regexes) : t_(t) {
    for (const auto& r : regexes) sc_.matchers.push_back(std::make_unique<Regex::Matcher>(*r));
  }
  void encode(std::string_view text, std::vector<int32_t>& out) override { t_.encode(text, out, sc_, cache_); }

 private:
  const HfTokenizer& t_;
  Scratch sc_;
  text::WordCache cache_;
};

std::unique_ptr<TokenizerSession> HfTokenizer::session() const { return std::make_unique<HfSession>(*this, regexes_); }

HfTokenizer::HfTokenizer(const json& j, const std::string& path, const std::string& kind, const TokenizerOptions& opts) {
  info_.kind = kind;
  info_.path = path;
  Loader ld(path, regexes_);
  const json& m = j.at("model");
  std::string mtype = get_str(m, "type", m.contains("merges") ? "BPE" : "");
  if (mtype != "BPE")
    throw UserError(path + ": model.type \"" + mtype +
                    "\" is not supported (prepare-data reads BPE tokenizers: byte-level as GPT-2, Llama 3, Qwen; "
                    "byte-fallback as Llama 2, Mistral; use the SentencePiece .model for Unigram models)");
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0)
    throw UserError(path + ": model.dropout is set: BPE dropout makes tokenization random; remove it for data preparation");
  std::vector<std::pair<std::string, int32_t>> vocab;
  for (const auto& [tok, id] : m.at("vocab").items()) vocab.emplace_back(tok, json_id(id, path + ": model.vocab[\"" + tok + "\"]"));
  std::vector<std::pair<std::string, std::string>> merges;
  const json& mj = m.contains("merges") ? m["merges"] : json::array();
  merges.reserve(mj.size());
  for (size_t i = 0; i < mj.size(); ++i) {
    const json& e = mj[i];
    if (e.is_string()) {
      const std::string& s = e.get_ref<const std::string&>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        throw UserError(path + ": model.merges[" + std::to_string(i) + "]: \"" + s + "\" is not two tokens separated by one space");
      merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else if (e.is_array() && e.size() == 2) {
      merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
    } else {
      throw UserError(path + ": model.merges[" + std::to_string(i) + "]: expected \"a b\" or [\"a\", \"b\"]");
    }
  }
  text::BpeModel::Options mo;
  mo.unk_token = get_str(m, "unk_token");
  mo.fuse_unk = get_bool(m, "fuse_unk", false);
  mo.byte_fallback = get_bool(m, "byte_fallback", false);
  mo.ignore_merges = get_bool(m, "ignore_merges", false);
  mo.continuing_subword_prefix = get_str(m, "continuing_subword_prefix");
  mo.end_of_word_suffix = get_str(m, "end_of_word_suffix");
  model_ = std::make_unique<text::BpeModel>(vocab, merges, mo, path + ": model.merges");

  if (j.contains("added_tokens")) {
    for (const auto& a : j["added_tokens"]) {
      added_.push_back({a.at("content").get<std::string>(), json_id(a.at("id"), path + ": added_tokens[].id"), get_bool(a, "single_word", false),
                        get_bool(a, "lstrip", false), get_bool(a, "rstrip", false), get_bool(a, "normalized", true),
                        get_bool(a, "special", false)});
    }
  }
  for (const auto& a : added_) (a.normalized ? norm_added_ : raw_added_).add(&a);
  normalizer_ = ld.normalizer(j.value("normalizer", json()), path + ": normalizer");
  pretok_ = ld.pretok(j.value("pre_tokenizer", json()), path + ": pre_tokenizer");
  parse_post(j.value("post_processor", json()), path + ": post_processor");

  int64_t max_id = model_->max_id();
  for (const auto& a : added_) max_id = std::max<int64_t>(max_id, a.id);
  info_.vocab_size = max_id + 1;

  // The end-of-document token: --eod-token, else tokenizer_config.json's eos_token beside the
  // file, else the usual names among the added tokens.
  std::string dir = path.substr(0, path.find_last_of('/') + 1);
  std::string eos_name = opts.eod_token, bos_name;
  {
    std::ifstream cfg(dir + "tokenizer_config.json");
    if (cfg) {
      try {
        json c = json::parse(cfg);
        auto name_of = [&](const char* k) -> std::string {
          if (!c.contains(k) || c[k].is_null()) return "";
          return c[k].is_string() ? c[k].get<std::string>() : get_str(c[k], "content");
        };
        if (eos_name.empty()) eos_name = name_of("eos_token");
        bos_name = name_of("bos_token");
      } catch (const json::exception& e) {
        throw UserError(dir + "tokenizer_config.json: not valid JSON: " + e.what());
      }
    }
  }
  auto first_known = [&](std::initializer_list<const char*> names) -> std::string {
    for (const char* n : names)
      if (token_id(n) >= 0) return n;
    return "";
  };
  if (eos_name.empty()) eos_name = first_known({"<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>"});
  if (bos_name.empty()) bos_name = first_known({"<s>", "<|begin_of_text|>", "<bos>"});
  if (!eos_name.empty()) {
    info_.eod = token_id(eos_name);
    if (info_.eod < 0) throw UserError(path + ": the end-of-document token \"" + eos_name + "\" is not in the vocabulary");
  }
  if (!bos_name.empty()) info_.bos = token_id(bos_name);
  info_.describe = kind + " " + path + " (vocabulary " + std::to_string(info_.vocab_size) +
                   (info_.eod >= 0 ? ", end of document \"" + eos_name + "\" = " + std::to_string(info_.eod) : "") + ")";
}

void HfTokenizer::parse_post(const json& j, const std::string& where) {
  if (j.is_null()) return;
  std::string type = get_str(j, "type");
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    for (size_t i = 0; i < j.at("processors").size(); ++i) parse_post(j["processors"][i], where + ".processors[" + std::to_string(i) + "]");
    return;
  }
  if (type == "TemplateProcessing") {
    const json& single = j.at("single");
    const json& specials = j.contains("special_tokens") ? j["special_tokens"] : json::object();
    bool seen_seq = false;
    for (const auto& item : single) {
      if (item.contains("Sequence")) {
        if (item["Sequence"].value("id", "A") != "A") throw UserError(where + ".single: the single template names sequence B");
        seen_seq = true;
        continue;
      }
      std::string name = item.at("SpecialToken").at("id").get<std::string>();
      if (!specials.contains(name)) throw UserError(where + ".single: special token \"" + name + "\" is not in special_tokens");
      auto& dst = seen_seq ? suffix_ids_ : prefix_ids_;
      for (const auto& id : specials[name].at("ids")) dst.push_back(json_id(id, where + ".special_tokens." + name));
    }
    return;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    prefix_ids_.push_back(json_id(j.at("cls").at(1), where + ".cls"));
    suffix_ids_.push_back(json_id(j.at("sep").at(1), where + ".sep"));
    return;
  }
  throw UserError(where + ": unsupported post-processor type \"" + type +
                  "\" (supported: TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, Sequence)");
}

void HfTokenizer::encode_segment(std::string seg, bool first, std::vector<int32_t>& out, Scratch& sc,
                                 text::WordCache& cache) const {
  if (normalizer_) normalizer_->apply(seg, sc);
  auto run = [&](std::string part, bool part_first) {
    std::vector<Piece> pieces;
    pieces.push_back({std::move(part), part_first});
    if (pretok_) pretok_->apply(pieces, sc);
    for (const auto& q : pieces) {
      if (cache.lookup(q.text, out)) continue;
      size_t n0 = out.size();
      model_->encode_word(q.text, out);
      cache.store(q.text, out.data() + n0, out.size() - n0);
    }
  };
  if (norm_added_.empty()) {
    run(std::move(seg), first);
    return;
  }
  // Added tokens with normalized=true are found in the normalized text.
  std::vector<AddedMatcher::Hit> hits;
  norm_added_.find(seg, hits);
  size_t pos = 0;
  for (const auto& h : hits) {
    if (h.b > pos) run(seg.substr(pos, h.b - pos), first && pos == 0);
    out.push_back(h.id);
    pos = h.e;
  }
  if (pos < seg.size()) run(seg.substr(pos), first && pos == 0);
}

void HfTokenizer::encode(std::string_view text_in, std::vector<int32_t>& out, Scratch& sc, text::WordCache& cache) const {
  out.insert(out.end(), prefix_ids_.begin(), prefix_ids_.end());
  std::string text(text_in);
  std::vector<AddedMatcher::Hit> hits;
  if (!raw_added_.empty()) raw_added_.find(text, hits);
  size_t pos = 0;
  for (const auto& h : hits) {
    if (h.b > pos) encode_segment(text.substr(pos, h.b - pos), pos == 0, out, sc, cache);
    out.push_back(h.id);
    pos = h.e;
  }
  if (pos < text.size()) encode_segment(text.substr(pos), pos == 0, out, sc, cache);
  out.insert(out.end(), suffix_ids_.begin(), suffix_ids_.end());
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(path + ": cannot open the tokenizer file");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json parse_json_file(const std::string& path) {
  std::string s = slurp(path);
  try {
    return json::parse(s);
  } catch (const json::parse_error& e) {
    size_t line = 1 + std::count(s.begin(), s.begin() + static_cast<ptrdiff_t>(std::min(e.byte, s.size())), '\n');
    throw UserError(path + ":" + std::to_string(line) + ": not valid JSON: " + e.what());
  }  catch (const json::exception& e) {  // a number too large for any type ("1e99999"), ...
    throw UserError(path + ": not valid JSON: " + e.what());
  }
}

}  // namespace

std::unique_ptr<Tokenizer> load_hf_json(const std::string& path, const TokenizerOptions& opts) {
  json j = parse_json_file(path);
  if (!j.is_object() || !j.contains("model"))
    throw UserError(path + ": not a Hugging Face tokenizer.json (no \"model\" object)");
  try {
    return std::make_unique<HfTokenizer>(j, path, "huggingface", opts);
  } catch (const json::exception& e) {
    throw UserError(path + ": unexpected tokenizer.json structure: " + e.what());
  }
}

std::unique_ptr<Tokenizer> load_gpt2_dir(const std::string& vocab_path, const std::string& merges_path, const TokenizerOptions& opts) {
  // GPT-2's files become the tokenizer.json GPT2TokenizerFast would build from them: byte-level
  // pre-tokenizer (no prefix space), the BPE model, <|endoftext|> as a special token.
  json vocab = parse_json_file(vocab_path);
  if (!vocab.is_object()) throw UserError(vocab_path + ": expected a JSON object of token -> id");
  std::ifstream in(merges_path);
  if (!in) throw UserError(merges_path + ": cannot open the merges file");
  json merges = json::array();
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (lineno == 1 && line.rfind("#version", 0) == 0)) continue;
    size_t sp = line.find(' ');
    if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
      throw UserError(merges_path + ":" + std::to_string(lineno) + ": expected two tokens separated by one space, got \"" + line + "\"");
    merges.push_back(line);
  }
  json j;
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}};
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  j["added_tokens"] = json::array();
  if (vocab.contains("<|endoftext|>"))
    j["added_tokens"].push_back({{"id", vocab["<|endoftext|>"]}, {"content", "<|endoftext|>"}, {"special", true},
                                 {"normalized", false}});
  try {
    return std::make_unique<HfTokenizer>(j, vocab_path, "gpt2-bpe", opts);
  } catch (const json::exception& e) {
    throw UserError(vocab_path + ": unexpected vocabulary structure (token -> integer id): " + e.what());
  }
}

}  // namespace mfsdp::tok_detail
