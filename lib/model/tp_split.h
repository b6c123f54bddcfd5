// How a parameter is cut across the tensor-parallel group; no torch here, so that engine.h and
// the checkpoint code can carry it cheaply.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace mfsdp {

// How a parameter is split across the tensor-parallel group (DESIGN.md section 5, TP). The global
// tensor, viewed as [outer, D, inner] around dimension `dim`, has D = sum(parts) rows along it; each
// part of p rows is cut as torch.chunk cuts it, into slices of ceil(p / size) rows (the last ones
// shorter or empty when size does not divide p), and rank r holds slice r of every part, packed in
// order, each padded to ceil(p / size) rows. A rank's local flat elements therefore map to
// contiguous runs of the global flat tensor, and the padding rows to none. Only a vocabulary is
// ever padded (a vocab_parallel embedding, the colwise output head whose logits the vocab-parallel
// loss reads with the padding masked): Megatron's padded vocabulary, without its extra rows in the
// model's own shape, so that a checkpoint's tensors keep the file's shape at every layout.
struct TpSplit {
  int dim = -1;                       // -1: not split (replicated over TP, or tp_size 1)
  std::vector<int64_t> parts;         // sizes along dim of the packed parts (one part: {D})
  int64_t size = 1, rank = 0;
  std::vector<int64_t> global_shape;  // the parameter's shape in the model file
  bool split() const { return dim >= 0 && size > 1; }
  // Rows per rank of a part of p rows (the padded slice), and how many of them are real on `r`.
  int64_t slice(int64_t p) const { return (p + size - 1) / size; }
  int64_t real_rows(int64_t p, int64_t r) const { return std::clamp<int64_t>(p - r * slice(p), 0, slice(p)); }
  bool padded() const {
    return split() && std::any_of(parts.begin(), parts.end(), [&](int64_t p) { return p % size != 0; });
  }
  // This rank's rows along dim: the sum of the padded slices.
  int64_t local_rows() const {
    int64_t n = 0;
    for (int64_t p : parts) n += slice(p);
    return n;
  }
  // Calls fn(global_offset, local_offset, length) for every run of local elements [from, to) that
  // holds global elements (padding rows are skipped).
  template <class F>
  void for_each_run(int64_t from, int64_t to, F&& fn) const {
    if (!split()) {
      if (to > from) fn(from, from, to - from);
      return;
    }
    int64_t outer = 1, inner = 1, D = 0;
    for (int i = 0; i < dim; ++i) outer *= global_shape[size_t(i)];
    for (size_t i = size_t(dim) + 1; i < global_shape.size(); ++i) inner *= global_shape[i];
    for (int64_t p : parts) D += p;
    int64_t local = 0;
    for (int64_t o = 0; o < outer && local < to; ++o) {
      int64_t part_start = 0;
      for (int64_t p : parts) {
        const int64_t len = slice(p) * inner, real = real_rows(p, rank) * inner;
        const int64_t g = (o * D + part_start + rank * slice(p)) * inner;
        const int64_t lo = std::max(from, local), hi = std::min(to, local + real);
        if (hi > lo) fn(g + (lo - local), lo, hi - lo);
        local += len;
        part_start += p;
      }
    }
  }
};

}  // namespace mfsdp
