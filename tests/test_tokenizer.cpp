// Tokenizer primitives: the heap-based BPE merges against the textbook loop, tie-breaking, the
// string table, regex iteration, UTF-8 validation, compressed streams. (The tokenizers as a whole
// are held to their reference libraries by tests/tokenizer/check_tokenizers.py.)
#include <zlib.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <fstream>
#include <random>
#include <unistd.h>

#include "catch.h"
#include "data/text_input.h"
#include "tokenizer/bpe.h"
#include "tokenizer/text.h"
#include "util/error.h"

using namespace mfsdp;
using namespace mfsdp::text;

namespace {

// tiktoken's rule written the slow, obvious way: rescan for the lowest-ranked adjacent pair after
// every merge, leftmost on ties.
std::vector<int32_t> naive_rank_bpe(const std::map<std::string, int32_t>& ranks, const std::string& piece) {
  std::vector<std::string> parts;
  for (char c : piece) parts.emplace_back(1, c);
  while (true) {
    int best = -1;
    int32_t best_rank = INT32_MAX;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      auto it = ranks.find(parts[i] + parts[i + 1]);
      if (it != ranks.end() && it->second < best_rank) {
        best_rank = it->second;
        best = int(i);
      }
    }
    if (best < 0) break;
    parts[best] += parts[best + 1];
    parts.erase(parts.begin() + best + 1);
  }
  std::vector<int32_t> out;
  for (auto& p : parts) out.push_back(ranks.at(p));
  return out;
}

}  // namespace

TEST_CASE("RankBpe: the heap merges equal the textbook loop on random words and rank tables") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    // An alphabet of 3 letters, and random multi-letter strings with random ranks (ties of
    // overlapping pairs are common: "aaa" has two "aa").
    std::map<std::string, int32_t> ranks;
    int32_t next = 0;
    for (char c : std::string("abc")) ranks[std::string(1, c)] = next++;
    for (int k = 0; k < 30; ++k) {
      std::string s;
      int len = 2 + int(rng() % 4);
      for (int i = 0; i < len; ++i) s.push_back("abc"[rng() % 3]);
      if (!ranks.count(s)) ranks[s] = next++;
    }
    StrMap m;
    for (auto& [k, v] : ranks) m.set(k, uint64_t(v));
    RankBpe bpe(m);
    for (int w = 0; w < 50; ++w) {
      std::string word;
      int len = 1 + int(rng() % 40);
      for (int i = 0; i < len; ++i) word.push_back("abc"[rng() % 3]);
      std::vector<int32_t> got;
      bpe.encode_piece(word, got);
      if (ranks.count(word)) {  // a whole-piece hit is one token, as tiktoken
        CHECK(got == std::vector<int32_t>{ranks[word]});
      } else {
        INFO(word);
        CHECK(got == naive_rank_bpe(ranks, word));
      }
    }
  }
}

TEST_CASE("BpeModel: merges by rank, leftmost on ties, byte fallback, fused unknowns") {
  std::vector<std::pair<std::string, int32_t>> vocab = {{"a", 0}, {"b", 1}, {"aa", 2}, {"ab", 3}, {"aab", 4}, {"<unk>", 5},
                                                        {"<0x7A>", 6}};
  std::vector<std::pair<std::string, std::string>> merges = {{"a", "a"}, {"a", "b"}, {"aa", "b"}};
  BpeModel::Options o;
  o.unk_token = "<unk>";
  o.fuse_unk = true;
  BpeModel m(vocab, merges, o, "test");
  std::vector<int32_t> out;
  m.encode_word("aaa", out);  // "aa" at 0 first (leftmost), then "a"
  CHECK(out == std::vector<int32_t>{2, 0});
  out.clear();
  m.encode_word("aab", out);  // aa (rank 0) then aa+b (rank 2)
  CHECK(out == std::vector<int32_t>{4});
  out.clear();
  m.encode_word("axyb", out);  // x and y unknown: fused into one <unk>
  CHECK(out == std::vector<int32_t>{0, 5, 1});
  o.fuse_unk = false;
  o.byte_fallback = true;
  BpeModel fb(vocab, merges, o, "test");
  out.clear();
  fb.encode_word("azq", out);  // z has a byte token, q does not: <unk>
  CHECK(out == std::vector<int32_t>{0, 6, 5});
  CHECK_THROWS_WITH(BpeModel(vocab, {{"a", "q"}}, {}, "file.json: model.merges"),
                    Catch::Contains("file.json: model.merges[0]: merge \"a q\" names a token"));
}

TEST_CASE("StrMap: insert, overwrite, lookup by view, growth") {
  StrMap m;
  for (int i = 0; i < 5000; ++i) m.set("k" + std::to_string(i), uint64_t(i));
  m.set("k7", 70);
  CHECK(m.size() == 5000);
  CHECK(m.get("k7") == 70);
  CHECK(m.get("k4999") == 4999);
  CHECK(m.get("nope") == StrMap::kAbsent);
  CHECK(m.get(std::string_view("k12345", 3)) == 12);
}

TEST_CASE("Regex: Unicode classes, lookahead, empty matches as boundaries; bad patterns name their origin") {
  Regex re(R"(\s+(?!\S)|\s+|\p{L}+)", "test pattern");
  Regex::Matcher m(re);
  std::vector<std::pair<size_t, size_t>> found;
  std::string s = "héllo   мир";
  m.find_all(s, found);
  REQUIRE(found.size() == 4);  // "héllo", "  " (lookahead leaves one space), " ", "мир"
  CHECK(s.substr(found[1].first, found[1].second - found[1].first) == "  ");
  Regex empty("x*", "empty");
  Regex::Matcher me(empty);
  found.clear();
  me.find_all("ab", found);
  CHECK(found.size() == 3);  // boundaries at 0, 1 and 2
  CHECK_THROWS_WITH(Regex("(unclosed", "tokenizer.json: pre_tokenizer.pattern"),
                    Catch::Contains("tokenizer.json: pre_tokenizer.pattern: cannot compile"));
}

TEST_CASE("UTF-8 validation: overlongs, surrogates, truncation, above U+10FFFF") {
  CHECK(invalid_utf8_at("plain ascii and ünïcödé 東京 😀") == std::string::npos);
  CHECK(invalid_utf8_at("ab\xC0\xAF") == 2);          // overlong '/'
  CHECK(invalid_utf8_at("a\xED\xA0\x80") == 1);       // surrogate U+D800
  CHECK(invalid_utf8_at("abcdefghij\xE6\x9D") == 10);  // truncated
  CHECK(invalid_utf8_at("\xF4\x90\x80\x80") == 0);     // U+110000
  CHECK(lowercase("İSTANBUL Ǆ") == "i\xCC\x87stanbul ǆ");
  CHECK(normalize("e\xCC\x81", Form::NFC) == "é");
  CHECK(normalize("ﬁ", Form::NFKC) == "fi");
}

TEST_CASE("InputStream: gzip with two members equals the plain bytes; corrupt data is named") {
  std::string dir = "/tmp/mfsdp_test_tok_" + std::to_string(::getpid());
  std::string cmd = "mkdir -p " + dir;
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::string text;
  for (int i = 0; i < 20000; ++i) text += "line " + std::to_string(i) + "\n";
  auto gz = [](const std::string& s) {
    z_stream z{};
    deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
    std::string out(s.size() + 1024, '\0');
    z.next_in = (Bytef*)s.data();
    z.avail_in = uInt(s.size());
    z.next_out = (Bytef*)&out[0];
    z.avail_out = uInt(out.size());
    deflate(&z, Z_FINISH);
    out.resize(out.size() - z.avail_out);
    deflateEnd(&z);
    return out;
  };
  std::ofstream(dir + "/a.gz", std::ios::binary) << gz(text.substr(0, 50000)) << gz(text.substr(50000));
  InputStream in(dir + "/a.gz");
  CHECK(std::string(in.compression()) == "gzip");
  LineReader lines(in);
  std::string line, all;
  while (lines.next(line)) all += line + "\n";
  CHECK(all == text);
  CHECK(lines.line_number() == 20000);
  std::string bad = gz(text);
  bad[bad.size() / 2] ^= 0x55;
  std::ofstream(dir + "/b.gz", std::ios::binary) << bad;
  InputStream in2(dir + "/b.gz");
  char buf[4096];
  CHECK_THROWS_WITH([&] { while (in2.read(buf, sizeof buf) > 0) {} }(), Catch::Contains("b.gz: corrupt gzip data"));
  std::system(("rm -rf " + dir).c_str());
}
