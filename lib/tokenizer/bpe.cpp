// BPE engines: see bpe.h.
#include "tokenizer/bpe.h"

#include <cstdio>
#include <cstring>
#include <queue>

#include "tokenizer/text.h"
#include "util/error.h"

namespace mfsdp::text {

// --- StrMap --------------------------------------------------------------------------------------

uint64_t StrMap::hash(std::string_view s) {
  // Eight bytes per multiply-xorshift round: the keys are short (pre-tokens, vocabulary entries).
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (s.size() * 0x100000001B3ull);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xFF51AFD7ED558CCDull;
    h ^= h >> 32;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 29;
  return h;
}

void StrMap::reserve(size_t n) {
  size_t cap = 16;
  while (cap < 2 * n) cap *= 2;
  if (cap <= slots_.size()) return;
  std::vector<Slot> old;
  old.swap(slots_);
  slots_.assign(cap, Slot{});
  const size_t mask = cap - 1;
  for (const auto& s : old) {
    if (s.len == kEmpty) continue;
    size_t i = s.hash & mask;
    while (slots_[i].len != kEmpty) i = (i + 1) & mask;
    slots_[i] = s;
  }
}

void StrMap::grow() { reserve(slots_.empty() ? 8 : slots_.size()); }

void StrMap::set(std::string_view key, uint64_t value) {
  if (2 * (count_ + 1) > slots_.size()) grow();
  const uint64_t h = hash(key);
  const size_t mask = slots_.size() - 1;
  for (size_t i = h & mask;; i = (i + 1) & mask) {
    Slot& s = slots_[i];
    if (s.len == kEmpty) {
      s.hash = h;
      s.value = value;
      s.off = static_cast<uint32_t>(arena_.size());
      s.len = static_cast<uint32_t>(key.size());
      arena_.append(key.data(), key.size());
      ++count_;
      return;
    }
    if (s.hash == h && s.len == key.size() && std::memcmp(arena_.data() + s.off, key.data(), key.size()) == 0) {
      s.value = value;
      return;
    }
  }
}

uint64_t StrMap::get(std::string_view key) const {
  if (slots_.empty()) return kAbsent;
  const uint64_t h = hash(key);
  const size_t mask = slots_.size() - 1;
  for (size_t i = h & mask;; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.len == kEmpty) return kAbsent;
    if (s.hash == h && s.len == key.size() && std::memcmp(arena_.data() + s.off, key.data(), key.size()) == 0)
      return s.value;
  }
}

void StrMap::clear() {
  for (auto& s : slots_) s.len = kEmpty;
  arena_.clear();
  count_ = 0;
}

// --- BpeModel ------------------------------------------------------------------------------------

namespace {
struct Sym {
  int32_t id, prev, next;
  uint32_t len;  // bytes of the word this symbol covers; 0: merged away
};
struct Cand {
  uint32_t rank, pos;
  int32_t new_id;
  bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};
using MinHeap = std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>>;
}  // namespace

BpeModel::BpeModel(const std::vector<std::pair<std::string, int32_t>>& vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, Options opts, const std::string& what)
    : opts_(std::move(opts)) {
  vocab_.reserve(vocab.size());
  for (const auto& [tok, id] : vocab) {
    if (id < 0) throw UserError(what + ": vocabulary entry \"" + tok + "\" has a negative id");
    vocab_.set(tok, static_cast<uint64_t>(id));
    if (id > max_id_) max_id_ = id;
  }
  if (!opts_.unk_token.empty()) {
    unk_id_ = token_id(opts_.unk_token);
    if (unk_id_ < 0) throw UserError(what + ": the unknown token \"" + opts_.unk_token + "\" is not in the vocabulary");
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    byte_ids_[b] = token_id(name);
  }
  const size_t prefix_len = opts_.continuing_subword_prefix.size();
  merges_.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& [a, b] = merges[r];
    int32_t ia = token_id(a), ib = token_id(b);
    if (ia < 0 || ib < 0 || b.size() < prefix_len)
      throw UserError(what + "[" + std::to_string(r) + "]: merge \"" + a + " " + b + "\" names a token that is not in the vocabulary");
    std::string merged = a + b.substr(prefix_len);
    int32_t im = token_id(merged);
    if (im < 0)
      throw UserError(what + "[" + std::to_string(r) + "]: merge \"" + a + " " + b + "\" makes \"" + merged +
                      "\", which is not in the vocabulary");
    // A repeated pair keeps its last rank, as tokenizers' HashMap collect does.
    merges_[(uint64_t(uint32_t(ia)) << 32) | uint32_t(ib)] = (uint64_t(r) << 32) | uint32_t(im);
  }
}

int32_t BpeModel::token_id(std::string_view token) const {
  uint64_t v = vocab_.get(token);
  return v == StrMap::kAbsent ? -1 : static_cast<int32_t>(v);
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (opts_.ignore_merges) {
    int32_t id = token_id(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  std::vector<Sym> sym;
  sym.reserve(word.size());
  bool pending_unk = false;
  auto push = [&](int32_t id, uint32_t len) {
    int32_t k = static_cast<int32_t>(sym.size());
    sym.push_back({id, k - 1, -1, len});
    if (k > 0) sym[k - 1].next = k;
  };
  std::string buf;
  for (size_t i = 0; i < word.size();) {
    const size_t start = i;
    next_cp(word, i);
    std::string_view ch = word.substr(start, i - start);
    std::string_view s = ch;
    const bool first = start == 0, last = i == word.size();
    if ((!first && !opts_.continuing_subword_prefix.empty()) || (last && !opts_.end_of_word_suffix.empty())) {
      buf.clear();
      if (!first) buf += opts_.continuing_subword_prefix;
      buf += ch;
      if (last) buf += opts_.end_of_word_suffix;
      s = buf;
    }
    int32_t id = token_id(s);
    if (id >= 0) {
      push(id, static_cast<uint32_t>(ch.size()));
      pending_unk = false;
      continue;
    }
    if (opts_.byte_fallback) {
      bool all = true;
      for (unsigned char c : s) all = all && byte_ids_[c] >= 0;
      if (all) {
        for (unsigned char c : s) push(byte_ids_[c], 1);
        pending_unk = false;
        continue;
      }
    }
    if (unk_id_ >= 0) {
      if (opts_.fuse_unk && pending_unk) {
        sym.back().len += static_cast<uint32_t>(ch.size());
      } else {
        push(unk_id_, static_cast<uint32_t>(ch.size()));
      }
      pending_unk = true;
    }
    // No unknown token: the character is dropped, as tokenizers does.
  }
  if (sym.empty()) return;

  MinHeap heap;
  auto candidate = [&](int32_t pos) {
    int32_t nx = sym[pos].next;
    if (nx < 0) return;
    auto it = merges_.find((uint64_t(uint32_t(sym[pos].id)) << 32) | uint32_t(sym[nx].id));
    if (it != merges_.end())
      heap.push({static_cast<uint32_t>(it->second >> 32), static_cast<uint32_t>(pos), static_cast<int32_t>(it->second & 0xFFFFFFFFu)});
  };
  for (int32_t p = 0; p + 1 < static_cast<int32_t>(sym.size()); ++p) candidate(p);
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    Sym& left = sym[c.pos];
    if (left.len == 0 || left.next < 0) continue;
    Sym& right = sym[left.next];
    auto it = merges_.find((uint64_t(uint32_t(left.id)) << 32) | uint32_t(right.id));
    if (it == merges_.end() || static_cast<int32_t>(it->second & 0xFFFFFFFFu) != c.new_id) continue;  // stale
    left.id = c.new_id;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (left.next >= 0) sym[left.next].prev = static_cast<int32_t>(c.pos);
    if (left.prev >= 0) candidate(left.prev);
    candidate(static_cast<int32_t>(c.pos));
  }
  for (int32_t p = 0; p >= 0; p = sym[p].next) out.push_back(sym[p].id);
}

// --- RankBpe -------------------------------------------------------------------------------------

void RankBpe::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  uint64_t whole = ranks_.get(piece);
  if (whole != StrMap::kAbsent) {
    out.push_back(static_cast<int32_t>(whole));
    return;
  }
  const int32_t n = static_cast<int32_t>(piece.size());
  // One part per byte to start with; a part is [start, start + len).
  std::vector<Sym> part(n);
  for (int32_t i = 0; i < n; ++i) part[i] = {i, i - 1, i + 1 < n ? i + 1 : -1, 1};
  auto pair_rank = [&](int32_t i) -> uint64_t {
    int32_t nx = part[i].next;
    if (nx < 0) return StrMap::kAbsent;
    return ranks_.get(piece.substr(part[i].id, part[i].len + part[nx].len));
  };
  MinHeap heap;
  auto candidate = [&](int32_t i) {
    uint64_t r = pair_rank(i);
    if (r != StrMap::kAbsent) heap.push({static_cast<uint32_t>(r), static_cast<uint32_t>(i), 0});
  };
  for (int32_t i = 0; i + 1 < n; ++i) candidate(i);
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    Sym& left = part[c.pos];
    // Stale entries: the part was merged away, or its right neighbour changed (its pair's rank
    // then differs; an equal rank at the same position is the same candidate).
    if (left.len == 0 || left.next < 0 || pair_rank(static_cast<int32_t>(c.pos)) != c.rank) continue;
    Sym& right = part[left.next];
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (left.next >= 0) part[left.next].prev = static_cast<int32_t>(c.pos);
    if (left.prev >= 0) candidate(left.prev);
    candidate(static_cast<int32_t>(c.pos));
  }
  for (int32_t p = 0; p >= 0; p = part[p].next) {
    uint64_t r = ranks_.get(piece.substr(part[p].id, part[p].len));
    if (r == StrMap::kAbsent) throw UserError("tiktoken: the byte sequence of a piece has no rank (the rank file lacks single bytes)");
    out.push_back(static_cast<int32_t>(r));
  }
}

// --- WordCache -----------------------------------------------------------------------------------

bool WordCache::lookup(std::string_view word, std::vector<int32_t>& out) const {
  uint64_t v = index_.get(word);
  if (v == StrMap::kAbsent) return false;
  const size_t off = v >> 16, n = v & 0xFFFF;
  out.insert(out.end(), ids_.begin() + static_cast<ptrdiff_t>(off), ids_.begin() + static_cast<ptrdiff_t>(off + n));
  return true;
}

void WordCache::store(std::string_view word, const int32_t* ids, size_t n) {
  if (n >= 0xFFFF || word.size() > 256) return;  // long words are rare: not worth the memory
  if (index_.size() >= max_) {
    index_.clear();
    ids_.clear();
  }
  index_.set(word, (uint64_t(ids_.size()) << 16) | n);
  ids_.insert(ids_.end(), ids, ids + n);
}

}  // namespace mfsdp::text
