// Byte-pair encoding engines and the hash table they look strings up in.
//   BpeModel: Hugging Face's BPE model (tokenizers' models::bpe): a vocabulary, ranked merges of
//     symbol pairs, byte fallback (<0xNN> tokens), an unknown token, optional subword prefix and
//     end-of-word suffix, ignore_merges (a word in the vocabulary is one token: Llama 3).
//   RankBpe: tiktoken's rule: the ranks of byte strings; repeatedly merge the adjacent pair whose
//     concatenation has the lowest rank.
// Both merge with a heap over the symbol list: O(n log n) in the word's length, where the textbook
// loop (rescan for the best pair after every merge) is O(n^2) and long words (a line of CJK text
// without spaces is one pre-token under the GPT-2 pattern) would dominate the run time. Ties go to
// the leftmost pair, as in both references.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mfsdp::text {

// Open-addressing map from strings to 64-bit values, looked up by string_view without building a
// std::string (std::unordered_map<std::string> cannot do that before C++20).
class StrMap {
 public:
  static constexpr uint64_t kAbsent = ~0ull;
  void reserve(size_t n);
  // Inserts or overwrites.
  void set(std::string_view key, uint64_t value);
  uint64_t get(std::string_view key) const;  // kAbsent when missing
  size_t size() const { return count_; }
  void clear();
  // Visits every entry (unordered).
  template <class F>
  void for_each(F f) const {
    for (const auto& s : slots_)
      if (s.len != kEmpty) f(std::string_view(arena_.data() + s.off, s.len), s.value);
  }
  static uint64_t hash(std::string_view s);

 private:
  static constexpr uint32_t kEmpty = ~0u;
  struct Slot {
    uint64_t hash = 0, value = 0;
    uint32_t off = 0, len = kEmpty;
  };
  std::vector<Slot> slots_;
  std::string arena_;
  size_t count_ = 0;
  void grow();
};

class BpeModel {
 public:
  struct Options {
    std::string unk_token;  // empty: none (characters without a token are dropped, as tokenizers does)
    bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
    std::string continuing_subword_prefix, end_of_word_suffix;
  };
  // `what` names the source in errors ("PATH: model.merges[12]").
  BpeModel(const std::vector<std::pair<std::string, int32_t>>& vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, Options opts, const std::string& what);
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  int32_t token_id(std::string_view token) const;  // -1 when absent
  int64_t max_id() const { return max_id_; }

 private:
  StrMap vocab_;
  std::unordered_map<uint64_t, uint64_t> merges_;  // (a << 32 | b) -> (rank << 32 | merged id)
  Options opts_;
  int32_t unk_id_ = -1;
  int32_t byte_ids_[256];
  int64_t max_id_ = -1;
};

class RankBpe {
 public:
  explicit RankBpe(StrMap ranks) : ranks_(std::move(ranks)) {}
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  int64_t rank(std::string_view bytes) const {
    uint64_t v = ranks_.get(bytes);
    return v == StrMap::kAbsent ? -1 : static_cast<int64_t>(v);
  }

 private:
  StrMap ranks_;
};

// A session's memo of encoded pre-tokens (the same words recur: a cache hit skips the merges).
class WordCache {
 public:
  explicit WordCache(size_t max_entries = 1 << 18) : max_(max_entries) {}
  // True and appends the cached ids to out when `word` was seen.
  bool lookup(std::string_view word, std::vector<int32_t>& out) const;
  void store(std::string_view word, const int32_t* ids, size_t n);

 private:
  size_t max_;
  StrMap index_;               // word -> (offset << 16 | count) into ids_
  std::vector<int32_t> ids_;
};

}  // namespace mfsdp::text
