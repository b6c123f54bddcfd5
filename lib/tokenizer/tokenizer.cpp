// Tokenizer formats other than tokenizer.json (hf_tokenizer.cpp), and the detection of a format
// from a path: see tokenizer.h.
#include "tokenizer/tokenizer.h"

#include <climits>
#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tokenizer/bpe.h"
#include "tokenizer/json_ids.h"
#include "tokenizer/text.h"
#include "util/error.h"
#include "util/strings.h"

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

namespace tok_detail {
namespace {

// --- byte level ----------------------------------------------------------------------------------

class ByteSession final : public TokenizerSession {
 public:
  void encode(std::string_view text, std::vector<int32_t>& out) override {
    for (unsigned char c : text) out.push_back(c);
  }
};
class ByteTokenizer final : public Tokenizer {
 public:
  ByteTokenizer() {
    info_ = {"byte", "", "byte-level (0..255 bytes, 256 end-of-document)", 257, 256, -1};
  }
  std::unique_ptr<TokenizerSession> session() const override { return std::make_unique<ByteSession>(); }
  bool needs_utf8() const override { return false; }
};

// --- tiktoken ------------------------------------------------------------------------------------

int b64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}
bool b64_decode(std::string_view s, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  size_t i = 0;
  for (; i < s.size() && s[i] != '='; ++i) {
    int v = b64_value(s[i]);
    if (v < 0) return false;
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  for (; i < s.size(); ++i)
    if (s[i] != '=') return false;
  return true;
}

// The pre-tokenizer patterns of tiktoken's encodings (tiktoken_ext/openai_public.py) and of
// Whisper's gpt2/multilingual rank files (the original GPT-2 pattern).
struct TiktokenEncoding {
  const char* name;
  const char* pattern;
  int64_t eod;  // <|endoftext|>; -1: the number of ranks (Whisper's files)
};
const char* kR50k = R"('(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s)";
const char* kCl100k =
    R"('(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s)";
const char* kO200k =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* kWhisper = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const TiktokenEncoding kEncodings[] = {
    {"gpt2", kR50k, 50256},          {"r50k_base", kR50k, 50256},     {"p50k_base", kR50k, 50256},
    {"cl100k_base", kCl100k, 100257}, {"o200k_base", kO200k, 199999}, {"whisper", kWhisper, -1},
};

class RankSession final : public TokenizerSession {
 public:
  RankSession(const text::Regex& re, const text::RankBpe& bpe, int32_t offset) : m_(re), bpe_(bpe), offset_(offset) {}
  void encode(std::string_view s, std::vector<int32_t>& out) override {
    found_.clear();
    m_.find_all(s, found_);
    for (auto [b, e] : found_) {
      std::string_view piece = s.substr(b, e - b);
      if (piece.empty()) continue;
      if (cache_.lookup(piece, out)) continue;
      size_t n0 = out.size();
      bpe_.encode_piece(piece, out);
      if (offset_)
        for (size_t i = n0; i < out.size(); ++i) out[i] += offset_;
      cache_.store(piece, out.data() + n0, out.size() - n0);
    }
  }

 private:
  text::Regex::Matcher m_;
  const text::RankBpe& bpe_;
  int32_t offset_;
  std::vector<std::pair<size_t, size_t>> found_;
  text::WordCache cache_;
};

// tiktoken rank files and Tekken: byte strings ranked, a pattern, ids = rank + offset. Special
// tokens in the text are encoded as text (tiktoken's encode_ordinary; Tekken's default).
class RankTokenizer final : public Tokenizer {
 public:
  RankTokenizer(text::StrMap ranks, const std::string& pattern, const std::string& what, int32_t offset)
      : re_(pattern, what), bpe_(std::move(ranks)), offset_(offset) {}
  std::unique_ptr<TokenizerSession> session() const override { return std::make_unique<RankSession>(re_, bpe_, offset_); }
  TokenizerInfo& mutable_info() { return info_; }

 private:
  text::Regex re_;
  text::RankBpe bpe_;
  int32_t offset_;
};

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(path + ": cannot open the " + what);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

#ifdef MFSDP_HAVE_SENTENCEPIECE
class SpSession final : public TokenizerSession {
 public:
  SpSession(const sentencepiece::SentencePieceProcessor& sp, const std::string& path) : sp_(sp), path_(path) {}
  void encode(std::string_view text, std::vector<int32_t>& out) override {
    ids_.clear();
    auto st = sp_.Encode(text, &ids_);
    if (!st.ok()) throw UserError(path_ + ": SentencePiece encoding failed: " + st.ToString());
    out.insert(out.end(), ids_.begin(), ids_.end());
  }

 private:
  const sentencepiece::SentencePieceProcessor& sp_;
  const std::string& path_;
  std::vector<int> ids_;
};
// SentencePieceProcessor::Encode is const and safe to call from several threads.
class SpTokenizer final : public Tokenizer {
 public:
  explicit SpTokenizer(const std::string& path) : path_(path) {
    auto st = sp_.Load(path);
    if (!st.ok()) throw UserError(path + ": not a SentencePiece model: " + st.ToString());
    info_.kind = "sentencepiece";
    info_.path = path;
    info_.vocab_size = sp_.GetPieceSize();
    info_.eod = sp_.eos_id();
    info_.bos = sp_.bos_id();
    info_.describe = "SentencePiece " + path + " (vocabulary " + std::to_string(info_.vocab_size) +
                     (info_.eod >= 0 ? ", end of document \"" + sp_.IdToPiece(int(info_.eod)) + "\" = " + std::to_string(info_.eod) : "") + ")";
  }
  std::unique_ptr<TokenizerSession> session() const override { return std::make_unique<SpSession>(sp_, path_); }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};
#endif

bool is_dir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool is_file(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path, const TokenizerOptions& opts) {
  std::string enc = opts.tiktoken_encoding;
  if (enc.empty()) {
    std::string base = path.substr(path.find_last_of('/') + 1);
    for (const char* n : {"cl100k_base", "o200k_base", "p50k_base", "r50k_base"})
      if (base.find(n) != std::string::npos) enc = n;
    if (enc.empty() && (base == "gpt2.tiktoken" || base == "multilingual.tiktoken")) enc = "whisper";
    if (enc.empty())
      throw UserError(path + ": a tiktoken rank file carries no pre-tokenizer pattern and its name names no encoding; "
                             "give --tiktoken-encoding (gpt2, r50k_base, p50k_base, cl100k_base, o200k_base or whisper)");
  }
  const TiktokenEncoding* e = nullptr;
  for (const auto& k : kEncodings)
    if (enc == k.name) e = &k;
  if (!e)
    throw UserError("--tiktoken-encoding " + enc + ": unknown (expected gpt2, r50k_base, p50k_base, cl100k_base, o200k_base or whisper)");
  std::string data = read_file(path, "tiktoken rank file");
  text::StrMap ranks;
  ranks.reserve(data.size() / 12);
  std::string bytes;
  int64_t max_rank = -1, lineno = 0;
  size_t pos = 0;
  while (pos < data.size()) {
    size_t end = data.find('\n', pos);
    if (end == std::string::npos) end = data.size();
    std::string_view line(data.data() + pos, end - pos);
    pos = end + 1;
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    size_t sp = line.find(' ');
    char* stop = nullptr;
    std::string rank_str(sp == std::string_view::npos ? "" : line.substr(sp + 1));
    long long rank = rank_str.empty() ? -1 : std::strtoll(rank_str.c_str(), &stop, 10);
    if (sp == std::string_view::npos || rank < 0 || *stop != '\0' || !b64_decode(line.substr(0, sp), bytes))
      throw UserError(path + ":" + std::to_string(lineno) + ": expected \"<base64 token> <rank>\"");
    // Token ids are stored as int32 (prepare-data's .bin), and the end-of-text id is max + 1.
    if (rank >= INT32_MAX)
      throw UserError(path + ":" + std::to_string(lineno) + ": rank " + rank_str + " is out of range (token ids are below " +
                      std::to_string(INT32_MAX) + ")");
    // Whisper's multilingual file ranks the empty string ("="): it can never match; it counts
    // towards the vocabulary only.
    if (!bytes.empty()) ranks.set(bytes, static_cast<uint64_t>(rank));
    max_rank = std::max<int64_t>(max_rank, rank);
  }
  if (max_rank < 0) throw UserError(path + ": the tiktoken rank file is empty");
  auto t = std::make_unique<RankTokenizer>(std::move(ranks), e->pattern, path + " (" + enc + " pattern)", 0);
  TokenizerInfo& info = t->mutable_info();
  info.kind = "tiktoken";
  info.path = path;
  info.eod = e->eod >= 0 ? e->eod : max_rank + 1;
  info.vocab_size = std::max(max_rank, info.eod) + 1;
  info.describe = "tiktoken " + path + " (" + enc + " pattern, vocabulary " + std::to_string(info.vocab_size) +
                  ", <|endoftext|> = " + std::to_string(info.eod) + ")";
  return t;
}

std::unique_ptr<Tokenizer> load_tekken(const std::string& path, const TokenizerOptions& opts) {
  using json = nlohmann::json;
  json j;
  try {
    j = json::parse(read_file(path, "Tekken tokenizer"));
    const json& cfg = j.at("config");
    const int64_t vocab = json_int(cfg.at("default_vocab_size"), 1, INT32_MAX, path + ": config.default_vocab_size");
    const int64_t nspecial = json_int(cfg.at("default_num_special_tokens"), 0, vocab, path + ": config.default_num_special_tokens");
    const int64_t inner = vocab - nspecial;
    text::StrMap ranks;
    std::string bytes;
    const json& v = j.at("vocab");
    for (size_t i = 0; i < v.size() && int64_t(i) < inner; ++i) {
      if (!b64_decode(v[i].at("token_bytes").get<std::string>(), bytes))
        throw UserError(path + ": vocab[" + std::to_string(i) + "].token_bytes is not base64");
      ranks.set(bytes, uint64_t(json_int(v[i].at("rank"), 0, INT32_MAX - nspecial, path + ": vocab[].rank")));
    }
    // Mistral's special tokens: <unk> 0, <s> 1, </s> 2 unless the file lists them.
    int64_t eod = 2, bos = 1;
    if (j.contains("special_tokens")) {
      for (const auto& s : j["special_tokens"]) {
        std::string name = s.value("token_str", "");
        if (name == "</s>") eod = json_int(s.at("rank"), 0, vocab - 1, path + ": special_tokens[].rank");
        if (name == "<s>") bos = json_int(s.at("rank"), 0, vocab - 1, path + ": special_tokens[].rank");
      }
    }
    auto t = std::make_unique<RankTokenizer>(std::move(ranks), cfg.at("pattern").get<std::string>(), path + ": config.pattern",
                                             static_cast<int32_t>(nspecial));
    TokenizerInfo& info = t->mutable_info();
    info = {"tekken", path, "", vocab, eod, bos};
    info.describe = "Tekken " + path + " (vocabulary " + std::to_string(vocab) + ", " + std::to_string(nspecial) +
                    " special tokens, </s> = " + std::to_string(eod) + ")";
    (void)opts;
    return t;
  } catch (const json::exception& e) {
    throw UserError(path + ": not a Tekken tokenizer file (config.pattern, config.default_vocab_size, "
                           "config.default_num_special_tokens, vocab[].token_bytes): " + e.what());
  }
}

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path, const TokenizerOptions&) {
#ifdef MFSDP_HAVE_SENTENCEPIECE
  return std::make_unique<SpTokenizer>(path);
#else
  throw UserError(path + ": this build has no SentencePiece (libsentencepiece-dev was not found when it was configured)");
#endif
}

}  // namespace tok_detail

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec, const TokenizerOptions& opts) {
  using namespace tok_detail;
  std::unique_ptr<Tokenizer> t;
  if (spec.empty() || spec == "byte") return make_byte_tokenizer();
  if (is_dir(spec)) {
    std::string d = spec.back() == '/' ? spec : spec + "/";
    if (is_file(d + "tokenizer.json")) t = load_hf_json(d + "tokenizer.json", opts);
    else if (is_file(d + "vocab.json") && is_file(d + "merges.txt")) t = load_gpt2_dir(d + "vocab.json", d + "merges.txt", opts);
    else if (is_file(d + "encoder.json") && is_file(d + "vocab.bpe")) t = load_gpt2_dir(d + "encoder.json", d + "vocab.bpe", opts);
    else if (is_file(d + "tokenizer.model")) t = load_sentencepiece(d + "tokenizer.model", opts);
    else
      throw UserError(spec + ": a tokenizer directory holds tokenizer.json, vocab.json + merges.txt, encoder.json + "
                             "vocab.bpe, or tokenizer.model; none is there");
  } else if (!is_file(spec)) {
    throw UserError(spec + ": no such tokenizer file or directory (give a tokenizer.json, .tiktoken, .model, Tekken "
                           ".json, a directory holding one, or \"byte\")");
  } else if (ends_with(spec, ".tiktoken")) {
    t = load_tiktoken(spec, opts);
  } else if (ends_with(spec, ".json")) {
    // tokenizer.json has a "model"; Tekken files a "config" and a "vocab" list.
    std::ifstream in(spec);
    std::string head(4096, '\0');
    in.read(&head[0], static_cast<std::streamsize>(head.size()));
    head.resize(static_cast<size_t>(in.gcount()));
    bool tekken = head.find("\"default_num_special_tokens\"") != std::string::npos ||
                  (head.find("\"config\"") != std::string::npos && head.find("\"token_bytes\"") != std::string::npos);
    t = tekken ? load_tekken(spec, opts) : load_hf_json(spec, opts);
  } else if (ends_with(spec, ".model") || spec.find(".model.") != std::string::npos) {
    t = load_sentencepiece(spec, opts);
  } else {
    // A rank file by content: the first line is "<base64> <integer>".
    std::ifstream in(spec);
    std::string line;
    std::getline(in, line);
    size_t sp = line.find(' ');
    bool ranks = sp != std::string::npos && sp > 0 && line.find_first_not_of("0123456789\r", sp + 1) == std::string::npos;
    if (!ranks)
      throw UserError(spec + ": cannot tell the tokenizer format (expected tokenizer.json, a Tekken .json, a .tiktoken "
                             "rank file or a SentencePiece .model)");
    t = load_tiktoken(spec, opts);
  }
  if (!opts.eod_token.empty() && t->info().kind != "huggingface" && t->info().kind != "gpt2-bpe")
    throw UserError("--eod-token applies to tokenizer.json and GPT-2 vocabularies; " + t->info().kind +
                    " tokenizers have a fixed end-of-document token");
  return t;
}

}  // namespace mfsdp
