#include "parallel/tp_ops.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "parallel/cross_entropy.h"
#include "util/error.h"

namespace mfsdp {
namespace {

std::atomic<Communicator*> g_tp{nullptr};
std::atomic<bool> g_sp{false};
std::atomic<int64_t> g_seq_len{0};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t wrap_dim(int64_t dim, int64_t ndim) { return dim < 0 ? dim + ndim : dim; }

at::Tensor all_reduced(const at::Tensor& x) {
  at::Tensor y = x.contiguous().clone();
  FlightTag t("tensor-parallel all-reduce");
  g_tp.load()->all_reduce(y, ReduceOp::kSum);
  return y;
}

at::Tensor own_chunk(const at::Tensor& x, int64_t dim) {
  Communicator& c = *g_tp.load();
  dim = wrap_dim(dim, x.dim());
  const int64_t n = x.size(dim) / c.size();
  return x.narrow(dim, c.rank() * n, n).contiguous();
}

// The sequence dimension of an activation under sequence parallelism: 1 of [B, T, H]; 0 of a
// [tokens, H] matrix, the tokens flattened (OPT's MLP reshapes its input to (-1, H) before fc1 and
// views it back after fc2). Gathering and scattering flattened tokens along dim 0 orders them rank
// by rank rather than as the full sequence would; what runs between (token-wise layers) does not
// see the order, and the reduce-scatter after it hands each rank its own rows back.
int64_t seq_dim(const at::Tensor& x) { return x.dim() == 2 ? 0 : 1; }

// ------------------------------------------------------------------------------- autograd pairs
struct CopyToTp : public torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) {
    return g_sp.load() ? all_gather_dim(*g_tp.load(), x, seq_dim(x)) : x;
  }
  static variable_list backward(AutogradContext*, variable_list g) {
    return {g_sp.load() ? reduce_scatter_dim(*g_tp.load(), g[0], seq_dim(g[0])) : all_reduced(g[0])};
  }
};

struct ReduceFromTp : public torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) {
    return g_sp.load() ? reduce_scatter_dim(*g_tp.load(), x, seq_dim(x)) : all_reduced(x);
  }
  static variable_list backward(AutogradContext*, variable_list g) {
    return {g_sp.load() ? all_gather_dim(*g_tp.load(), g[0], seq_dim(g[0])) : g[0]};
  }
};

struct GatherLast : public torch::autograd::Function<GatherLast> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) { return all_gather_dim(*g_tp.load(), x, -1); }
  static variable_list backward(AutogradContext*, variable_list g) { return {own_chunk(g[0], -1)}; }
};

struct SplitLast : public torch::autograd::Function<SplitLast> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) { return own_chunk(x, -1); }
  static variable_list backward(AutogradContext*, variable_list g) { return {all_gather_dim(*g_tp.load(), g[0], -1)}; }
};

struct ScatterSeq : public torch::autograd::Function<ScatterSeq> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) {
    const int64_t t = g_seq_len.load();
    if (x.dim() < 2 || (t > 0 && x.size(1) != t))
      throw UserError(std::string(kUserErrorTag) + fmt::format(
          "distributed.sequence_parallel cuts the first block's input along dim 1, the sequence ({} tokens), but "
          "this model's first block takes a tensor shaped {}, whose dim 1 is not the sequence: sequence "
          "parallelism does not apply to this model (tensor parallelism without it does)",
          t, fmt::join(x.sizes(), " x ")));
    return own_chunk(x, 1);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {all_gather_dim(*g_tp.load(), g[0], 1)}; }
};

// A sequence_whole block's input and output under sequence parallelism (tensor_parallel.cpp,
// whole_sequence_at_call): the block runs whole on every rank, so the gradient reaching its input
// is whole too (this rank's slice of it is all this rank's part needs), and its output's gradient
// is gathered whole from the ranks' parts.
struct GatherWhole : public torch::autograd::Function<GatherWhole> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) { return all_gather_dim(*g_tp.load(), x, seq_dim(x)); }
  static variable_list backward(AutogradContext*, variable_list g) { return {own_chunk(g[0], seq_dim(g[0]))}; }
};

struct SplitWhole : public torch::autograd::Function<SplitWhole> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) { return own_chunk(x, seq_dim(x)); }
  static variable_list backward(AutogradContext*, variable_list g) {
    return {all_gather_dim(*g_tp.load(), g[0], seq_dim(g[0]))};
  }
};

at::Tensor out_of_shard(const at::Tensor& ids, int64_t start, int64_t end) { return (ids < start).logical_or(ids >= end); }

struct VocabReduce : public torch::autograd::Function<VocabReduce> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& ids, int64_t start, int64_t end) {
    at::Tensor mask = out_of_shard(ids, start, end).unsqueeze(-1);
    ctx->saved_data["mask"] = mask;
    return all_reduced(y.masked_fill(mask, 0));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {g[0].masked_fill(ctx->saved_data["mask"].toTensor(), 0), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

bool active() { return g_tp.load() != nullptr && g_tp.load()->size() > 1; }

at::Tensor tp_copy(const at::Tensor& x) { return active() ? CopyToTp::apply(x) : x; }
at::Tensor tp_reduce(const at::Tensor& x) { return active() ? ReduceFromTp::apply(x) : x; }
at::Tensor tp_gather_last(const at::Tensor& x) { return active() ? GatherLast::apply(x) : x; }
at::Tensor tp_split_last(const at::Tensor& x) { return active() ? SplitLast::apply(x) : x; }
at::Tensor sp_scatter(int64_t first, const at::Tensor& x) {
  return active() && g_sp.load() && first ? ScatterSeq::apply(x) : x;
}
at::Tensor sp_gather_whole(const at::Tensor& x) { return active() && g_sp.load() ? GatherWhole::apply(x) : x; }
at::Tensor sp_split_whole(const at::Tensor& x) { return active() && g_sp.load() ? SplitWhole::apply(x) : x; }
// A unit's further input shaped by the whole sequence, cut like its hidden state `like` (this
// rank's part along dim 1) when its dim 1 is the whole of like's: tensor_parallel.cpp,
// split_unit_side_inputs. Integer inputs (token ids) are cut without autograd.
bool cut_like(const at::Tensor& x, const at::Tensor& like) {
  return active() && g_sp.load() && x.dim() >= 2 && like.dim() >= 2 &&
         x.size(1) == like.size(1) * g_tp.load()->size();
}
at::Tensor sp_split_like(const at::Tensor& x, const at::Tensor& like) {
  if (!cut_like(x, like)) return x;
  return x.is_floating_point() ? ScatterSeq::apply(x) : own_chunk(x, 1);
}
at::Tensor sp_split_like_plain(const at::Tensor& x, const at::Tensor& like) {
  return cut_like(x, like) ? own_chunk(x, 1) : x;
}
at::Tensor tp_vocab_reduce(const at::Tensor& y, const at::Tensor& ids, int64_t start, int64_t end) {
  return active() ? VocabReduce::apply(y, ids, start, end) : y;
}
// Below autograd (no graph is recorded): forward only.
at::Tensor tp_copy_plain(const at::Tensor& x) {
  return active() && g_sp.load() ? all_gather_dim(*g_tp.load(), x, seq_dim(x)) : x;
}
at::Tensor tp_reduce_plain(const at::Tensor& x) {
  if (!active()) return x;
  return g_sp.load() ? reduce_scatter_dim(*g_tp.load(), x, seq_dim(x)) : all_reduced(x);
}
at::Tensor tp_gather_last_plain(const at::Tensor& x) { return active() ? all_gather_dim(*g_tp.load(), x, -1) : x; }
at::Tensor tp_split_last_plain(const at::Tensor& x) { return active() ? own_chunk(x, -1) : x; }
at::Tensor sp_scatter_plain(int64_t first, const at::Tensor& x) {
  return active() && g_sp.load() && first ? own_chunk(x, 1) : x;
}
at::Tensor sp_gather_whole_plain(const at::Tensor& x) {
  return active() && g_sp.load() ? all_gather_dim(*g_tp.load(), x, seq_dim(x)) : x;
}
at::Tensor sp_split_whole_plain(const at::Tensor& x) { return active() && g_sp.load() ? own_chunk(x, seq_dim(x)) : x; }
at::Tensor tp_vocab_reduce_plain(const at::Tensor& y, const at::Tensor& ids, int64_t start, int64_t end) {
  return active() ? all_reduced(y.masked_fill(out_of_shard(ids, start, end).unsqueeze(-1), 0)) : y;
}
at::Tensor tp_vocab_ids(const at::Tensor& ids, int64_t start, int64_t end) {
  return active() ? (ids - start).clamp(0, end - start - 1) : ids;
}

}  // namespace

void set_sequence_length(int64_t tokens_dim1) { g_seq_len.store(tokens_dim1); }

void set_tp_context(Communicator* tp, bool sequence_parallel) {
  g_tp.store(tp);
  g_sp.store(sequence_parallel);
}

at::Tensor all_gather_dim(Communicator& c, const at::Tensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim());
  at::Tensor in = x.contiguous();
  at::Tensor out = at::empty({c.size() * in.numel()}, in.options());
  {
    FlightTag t("tensor-parallel all-gather");
    c.all_gather(out, in.reshape({-1}));
  }
  std::vector<int64_t> stacked{c.size()};
  for (int64_t s : in.sizes()) stacked.push_back(s);
  std::vector<int64_t> result = in.sizes().vec();
  result[size_t(dim)] *= c.size();
  return out.view(stacked).movedim(0, dim).reshape(result);
}

at::Tensor reduce_scatter_dim(Communicator& c, const at::Tensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim());
  const int64_t n = x.size(dim) / c.size();
  std::vector<int64_t> split = x.sizes().vec();
  split[size_t(dim)] = n;
  split.insert(split.begin() + dim, c.size());
  at::Tensor in = x.reshape(split).movedim(dim, 0).contiguous();
  std::vector<int64_t> result = x.sizes().vec();
  result[size_t(dim)] = n;
  at::Tensor out = at::empty(result, x.options());
  FlightTag t("tensor-parallel reduce-scatter");
  c.reduce_scatter(out.view({-1}), in.view({-1}), ReduceOp::kSum);
  return out;
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                                        int64_t vocab, bool consume_logits) {
  if (!active()) throw std::logic_error("vocab_parallel_cross_entropy without a tensor-parallel group");
  const int64_t real = std::clamp<int64_t>(vocab - vocab_start, 0, logits.size(1));
  return cross_entropy_per_token(logits, targets, g_tp.load(), vocab_start, real, consume_logits);
}

}  // namespace mfsdp

TORCH_LIBRARY_FRAGMENT(mfsdp, m) {
  const auto conservative = c10::AliasAnalysisKind::CONSERVATIVE;
  m.def(torch::schema("mfsdp::tp_copy(Tensor x) -> Tensor", conservative));
  m.def(torch::schema("mfsdp::tp_reduce(Tensor x) -> Tensor", conservative));
  m.def(torch::schema("mfsdp::tp_gather_last(Tensor x) -> Tensor", conservative));
  m.def(torch::schema("mfsdp::tp_split_last(Tensor x) -> Tensor", conservative));
  m.def(torch::schema("mfsdp::sp_scatter(int first, Tensor x) -> Tensor", conservative));
  m.def(torch::schema("mfsdp::sp_gather_whole(Tensor x) -> Tensor", conservative));
  m.def(torch::schema("mfsdp::sp_split_whole(Tensor x) -> Tensor", conservative));
  m.def(torch::schema("mfsdp::sp_split_like(Tensor x, Tensor like) -> Tensor", conservative));
  m.def(torch::schema("mfsdp::tp_vocab_ids(Tensor ids, int start, int end) -> Tensor", conservative));
  m.def(torch::schema("mfsdp::tp_vocab_reduce(Tensor y, Tensor ids, int start, int end) -> Tensor", conservative));
}

TORCH_LIBRARY_IMPL(mfsdp, Autograd, m) {
  m.impl("tp_copy", mfsdp::tp_copy);
  m.impl("tp_reduce", mfsdp::tp_reduce);
  m.impl("tp_gather_last", mfsdp::tp_gather_last);
  m.impl("tp_split_last", mfsdp::tp_split_last);
  m.impl("sp_scatter", mfsdp::sp_scatter);
  m.impl("sp_gather_whole", mfsdp::sp_gather_whole);
  m.impl("sp_split_whole", mfsdp::sp_split_whole);
  m.impl("sp_split_like", mfsdp::sp_split_like);
  m.impl("tp_vocab_reduce", mfsdp::tp_vocab_reduce);
}

TORCH_LIBRARY_IMPL(mfsdp, CompositeExplicitAutograd, m) {
  m.impl("tp_copy", mfsdp::tp_copy_plain);
  m.impl("tp_reduce", mfsdp::tp_reduce_plain);
  m.impl("tp_gather_last", mfsdp::tp_gather_last_plain);
  m.impl("tp_split_last", mfsdp::tp_split_last_plain);
  m.impl("sp_scatter", mfsdp::sp_scatter_plain);
  m.impl("sp_gather_whole", mfsdp::sp_gather_whole_plain);
  m.impl("sp_split_whole", mfsdp::sp_split_whole_plain);
  m.impl("sp_split_like", mfsdp::sp_split_like_plain);
  m.impl("tp_vocab_reduce", mfsdp::tp_vocab_reduce_plain);
  m.impl("tp_vocab_ids", mfsdp::tp_vocab_ids);
}
