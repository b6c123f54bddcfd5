// How a parameter is cut across the tensor-parallel group; no torch here, so that engine.h and
// the checkpoint code can carry it cheaply.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace mfsdp {

// How a parameter is split across the tensor-parallel group (DESIGN.md section 5, TP). The global
// tensor, viewed as [outer, D, inner] around dimension `dim`, has D = sum(parts) rows along it; each
// part is cut into `size` equal slices and rank r holds slice r of every part, packed in order. A
// rank's local flat elements therefore map to contiguous runs of the global flat tensor.
struct TpSplit {
  int dim = -1;                       // -1: not split (replicated over TP, or tp_size 1)
  std::vector<int64_t> parts;         // sizes along dim of the packed parts (one part: {D})
  int64_t size = 1, rank = 0;
  std::vector<int64_t> global_shape;  // the parameter's shape in the model file
  bool split() const { return dim >= 0 && size > 1; }
  // Calls fn(global_offset, local_offset, length) for every run of local elements [from, to).
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
        const int64_t len = p / size * inner, g = (o * D + part_start + rank * (p / size)) * inner;
        const int64_t lo = std::max(from, local), hi = std::min(to, local + len);
        if (hi > lo) fn(g + (lo - local), lo, hi - lo);
        local += len;
        part_start += p;
      }
    }
  }
};

}  // namespace mfsdp
