// mfsdp::linear: the linear layer whose weight gradient is written into the engine's bucket by the
// product that computes it (model/linear.h; DESIGN.md section 7, step 3, "Gradients into the buckets").
#include "model/linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "model/cpu_blas.h"
#include "model/cpu_kernels.h"
#include "model/graph_rewrite.h"

namespace mfsdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<GradSink*> g_sink{nullptr};

// The parameter index the sink gives `t`, or -1 (no sink, no tensor, or not one of its parameters).
int64_t sink_index(const at::Tensor& t) {
  GradSink* s = g_sink.load(std::memory_order_relaxed);
  return s && t.defined() && t.requires_grad() ? s->sink_param(t) : -1;
}

// The gradient of a parameter from the backward's product: into the sink's buffer when it takes the
// parameter (then autograd gets none), else a tensor of its own. `product(out, accumulate)` writes
// the gradient into `out` (overwriting, or adding to what it holds); `fresh()` computes it anew.
template <class Write, class Fresh>
at::Tensor param_grad(int64_t pi, Write product, Fresh fresh) {
  GradSink* s = g_sink.load(std::memory_order_relaxed);
  if (pi < 0 || !s) return fresh();
  bool accumulate = false;
  at::Tensor dst = s->sink_buffer(int(pi), accumulate);
  product(dst, accumulate);
  return at::Tensor();
}

// dst = a b, or dst += a b (`accumulate`), for a product whose result goes into a sink's buffer:
// ATen's where the buffer has the operands' dtype; bf16 operands into fp32 main gradients (bf16
// compute with grad_reduce_in_fp32, on the CPU: GradSink::sink_param takes those only where
// cpu_bf16_products_native) by MKL's bf16 product accumulated in fp32, as Megatron's gradient-
// accumulation fusion writes bf16 layers' weight gradients into fp32 main_grad: no bf16 gradient,
// no conversion, no rounding of the gradient to bf16.
void product_into(at::Tensor& dst, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  if (dst.scalar_type() != a.scalar_type()) return mm_bf16_into_f32(dst, a, b, accumulate);
  if (accumulate) dst.addmm_(a, b);
  else at::mm_out(dst, a, b);
}

// dy's column sums (dy [rows, out], fp32 or bf16, any strides) into the fp32 out[0:n] (added to it
// with `accumulate`), by mfsdp's row loop (model/cpu_kernels.h: col_sums_f32 / col_sums_bf16), the
// columns split over ATen's threads: each column summed over the rows in order, the same bits on any
// thread count. The loop walks rows of unit stride at least a row apart; any other dy (a broadcast
// one, as the backward of a sum over the rows gives, has rows 0 apart) is copied first.
void col_sums_into(const at::Tensor& dy, float* out, bool accumulate) {
  const bool walkable =
      (dy.stride(1) == 1 || dy.size(1) <= 1) && (dy.size(0) <= 1 || dy.stride(0) >= dy.size(1));
  const at::Tensor d = walkable ? dy : dy.contiguous();
  const int64_t rows = d.size(0), n = d.size(1), ld = rows <= 1 ? n : d.stride(0);
  const bool f32 = d.scalar_type() == at::kFloat;
  const float* xf = f32 ? d.const_data_ptr<float>() : nullptr;
  const uint16_t* xh = f32 ? nullptr : reinterpret_cast<const uint16_t*>(d.const_data_ptr<at::BFloat16>());
  // At least 256 columns (1 KiB of each row) per task: rows stream by in long runs.
  at::parallel_for(0, n, 256, [&](int64_t c0, int64_t c1) {
    if (f32) col_sums_f32(xf + c0, ld, rows, c1 - c0, out + c0, accumulate);
    else col_sums_bf16(xh + c0, ld, rows, c1 - c0, out + c0, accumulate);
  });
}

// The bias gradient, dy's column sums (dy [rows, out]), into the sink's buffer or a tensor of its
// own. On CPU fp32 dy, and bf16 dy into fp32 main gradients (bf16 compute with grad_reduce_in_fp32),
// by col_sums_into: it reads dy once, as BLAS's matrix-vector product dy^T 1 did (ATen's sum over
// dim 0 took 2.6x that one's time on a [1024, 1024] dy, bench/results_grads_into_buckets.md), without
// the vector of ones made for each call; ATen's sum with an fp32 dtype converted a bf16 dy whole
// first. Elsewhere (a GPU, bf16 into bf16) ATen's sum.
at::Tensor bias_grad(int64_t sink, const at::Tensor& dy) {
  auto ours = [&](const at::Tensor& out) {
    return dy.is_cpu() && out.is_cpu() && out.is_contiguous() && out.scalar_type() == at::kFloat &&
           (dy.scalar_type() == at::kFloat || dy.scalar_type() == at::kBFloat16) && dy.dim() == 2;
  };
  return param_grad(
      sink,
      [&](at::Tensor& dst, bool accumulate) {
        if (ours(dst)) return col_sums_into(dy, dst.mutable_data_ptr<float>(), accumulate);
        if (accumulate) dst.add_(dy.sum(0));
        else at::sum_out(dst, dy, {0});
      },
      [&] {
        if (dy.is_cpu() && dy.scalar_type() == at::kFloat && dy.dim() == 2) {
          at::Tensor out = at::empty({dy.size(1)}, dy.options());
          col_sums_into(dy, out.mutable_data_ptr<float>(), false);
          return out;
        }
        return dy.sum(0);
      });
}

// y = x w^T + b. The forward is ATen's own call; the backward is the products ATen's would run
// (AddmmBackward / MmBackward): dx = dy w, dw = dy^T x (in w's row-major layout), db = sum of dy's
// rows. Inputs of any rank: the leading dimensions of x and dy fold into rows.
struct Linear : public torch::autograd::Function<Linear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& b) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["w_sink"] = sink_index(w);
    ctx->saved_data["b_sink"] = b ? sink_index(*b) : -1;
    ctx->saved_data["has_bias"] = b.has_value();
    return at::linear(x, w, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const int64_t out = w.size(0), in = w.size(1);
    const at::Tensor dy = g[0].reshape({-1, out});
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = dy.mm(w).view(x.sizes());
    if (ctx->needs_input_grad(1)) {
      const at::Tensor x2 = x.reshape({-1, in});
      dw = param_grad(
          ctx->saved_data["w_sink"].toInt(),
          [&](at::Tensor& dst, bool accumulate) { product_into(dst, dy.t(), x2, accumulate); },
          [&] { return dy.t().mm(x2); });
    }
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2))
      db = bias_grad(ctx->saved_data["b_sink"].toInt(), dy);
    return {dx, dw, db};
  }
};

// y = b + x w, the weight stored [in, out]: Hugging Face's Conv1D (GPT-2's projections), traced as
// aten::addmm(b, x.view(-1, in), w) with beta = alpha = 1. The backward is AddmmBackward's products
// for a row-major w: dx = dy w^T, dw = x^T dy (w's [in, out] layout), db = dy's column sums.
struct LinearT : public torch::autograd::Function<LinearT> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& b, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["w_sink"] = sink_index(w);
    ctx->saved_data["b_sink"] = sink_index(b);
    return at::addmm(b, x, w);
  }

  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor& dy = g[0];
    at::Tensor db, dx, dw;
    if (ctx->needs_input_grad(0)) db = bias_grad(ctx->saved_data["b_sink"].toInt(), dy);
    if (ctx->needs_input_grad(1)) dx = dy.mm(w.t());
    if (ctx->needs_input_grad(2))
      dw = param_grad(
          ctx->saved_data["w_sink"].toInt(),
          [&](at::Tensor& dst, bool accumulate) { product_into(dst, x.t(), dy, accumulate); },
          [&] { return x.t().mm(dy); });
    return {db, dx, dw};
  }
};

// dst[idx[i]] += rows[i] for i in order: fp32 CPU rows by a loop of its own (index_add_ goes through a
// TensorIterator per row), anything else by index_add_, which adds in the same order. Rows of another
// dtype (bf16 rows into fp32 main gradients) are converted first.
void add_rows(at::Tensor& dst, const at::Tensor& idx0, const at::Tensor& rows_in) {
  const at::Tensor rows0 = rows_in.scalar_type() == dst.scalar_type() ? rows_in : rows_in.to(dst.scalar_type());
  if (!(dst.is_cpu() && dst.scalar_type() == at::kFloat && rows0.scalar_type() == at::kFloat && dst.is_contiguous() &&
        dst.dim() == 2)) {
    dst.index_add_(0, idx0, rows0);
    return;
  }
  const at::Tensor idx = idx0.to(at::kLong).contiguous(), rows = rows0.contiguous();
  const int64_t n = idx.size(0), d = dst.size(1), R = dst.size(0);
  TORCH_CHECK(rows.size(0) == n && rows.size(1) == d, "embedding backward: ", n, " rows of ", d, " expected");
  const int64_t* ix = idx.const_data_ptr<int64_t>();
  const float* src = rows.const_data_ptr<float>();
  float* out = dst.mutable_data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ix[i] >= 0 && ix[i] < R, "embedding backward: index ", ix[i], " out of ", R, " rows");
    float* o = out + ix[i] * d;
    const float* r = src + i * d;
    for (int64_t j = 0; j < d; ++j) o[j] += r[j];
  }
}

// y = w[indices]: aten::embedding, whose backward adds each token's gradient row into the table's
// gradient in the bucket, in token order (ATen's embedding_dense_backward: a zeroed [rows, d]
// tensor, the rows added in the same order, then added into the bucket by the accumulator hook).
// For a table tied to the output head the head's product has written its gradient there already,
// and the rows go on top of it; an untied table's buffer is zeroed first (then the same bits as
// ATen's). No table-sized temporary: at GPT-2's vocabulary that was a fresh 154 MB zeroed (page
// faults) and added every backward, about 70 ms of an 8.5 s one-thread step. Rows at padding_idx
// get no gradient, as ATen's; scale_grad_by_freq and sparse gradients, and tables on a GPU, go to
// ATen's backward.
struct Embedding : public torch::autograd::Function<Embedding> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& w, const at::Tensor& indices, int64_t padding_idx,
                            bool scale_grad_by_freq, bool sparse) {
    ctx->save_for_backward({indices});
    // CPU tables only: on a GPU ATen's backward (sorted, deterministic) stays, where index_add_'s
    // atomics would add the rows in no fixed order.
    ctx->saved_data["w_sink"] = scale_grad_by_freq || sparse || !w.is_cpu() ? int64_t(-1) : sink_index(w);
    ctx->saved_data["rows"] = w.size(0);
    ctx->saved_data["padding_idx"] = padding_idx;
    ctx->saved_data["scale_grad_by_freq"] = scale_grad_by_freq;
    ctx->saved_data["sparse"] = sparse;
    return at::embedding(w, indices, padding_idx, scale_grad_by_freq, sparse);
  }

  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const at::Tensor indices = ctx->get_saved_variables()[0];
    const int64_t padding_idx = ctx->saved_data["padding_idx"].toInt();
    if (!ctx->needs_input_grad(0)) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor dw = param_grad(
        ctx->saved_data["w_sink"].toInt(),
        [&](at::Tensor& dst, bool accumulate) {
          at::Tensor idx = indices.reshape({-1});
          at::Tensor rows = g[0].reshape({idx.size(0), -1});
          if (padding_idx >= 0) {
            const at::Tensor keep = idx.ne(padding_idx).nonzero().squeeze(1);
            idx = idx.index_select(0, keep);
            rows = rows.index_select(0, keep);
          }
          if (!accumulate) dst.zero_();
          add_rows(dst, idx, rows);
        },
        [&] {
          return at::embedding_backward(g[0], indices, ctx->saved_data["rows"].toInt(), padding_idx,
                                        ctx->saved_data["scale_grad_by_freq"].toBool(), ctx->saved_data["sparse"].toBool());
        });
    return {dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor embedding_autograd(const at::Tensor& w, const at::Tensor& indices, int64_t padding_idx,
                              bool scale_grad_by_freq, bool sparse) {
  if (!at::GradMode::is_enabled() || !w.requires_grad() || w.dim() != 2)
    return at::embedding(w, indices, padding_idx, scale_grad_by_freq, sparse);
  return Embedding::apply(w, indices, padding_idx, scale_grad_by_freq, sparse);
}
at::Tensor embedding_plain(const at::Tensor& w, const at::Tensor& indices, int64_t padding_idx,
                           bool scale_grad_by_freq, bool sparse) {
  return at::embedding(w, indices, padding_idx, scale_grad_by_freq, sparse);
}

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  const std::optional<at::Tensor> bias = b && b->defined() ? b : std::nullopt;
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || w.requires_grad() || (bias && bias->requires_grad()));
  // Only a 2-D weight is a Linear's; anything else (and every call that records no graph) is ATen's.
  if (!grad || w.dim() != 2) return at::linear(x, w, bias);
  return Linear::apply(x, w, bias);
}

at::Tensor linear_plain(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  return at::linear(x, w, b);
}

// Only the Conv1D shape (a bias vector of w's output width, 2-D x and w) is LinearT's; any other
// addmm (a matrix or a scalar as its first operand), and every call that records no graph, ATen's.
at::Tensor linear_t_autograd(const at::Tensor& b, const at::Tensor& x, const at::Tensor& w) {
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad() || b.requires_grad());
  if (!grad || x.dim() != 2 || w.dim() != 2 || b.dim() != 1 || b.size(0) != w.size(1)) return at::addmm(b, x, w);
  return LinearT::apply(b, x, w);
}
at::Tensor linear_t_plain(const at::Tensor& b, const at::Tensor& x, const at::Tensor& w) { return at::addmm(b, x, w); }

// aten::embedding(w, indices, padding_idx, scale_grad_by_freq, sparse) with all five inputs.
bool replace_embedding(torch::jit::Node* node) {
  if (node->inputs().size() != 5 || node->outputs().size() != 1) return false;
  return replace_node_by(node, "mfsdp::embedding",
                         {node->input(0), node->input(1), node->input(2), node->input(3), node->input(4)});
}

bool replace_linear(torch::jit::Node* node) {
  if (node->inputs().size() != 3 || node->outputs().size() != 1) return false;
  return replace_node_by(node, "mfsdp::linear", {node->input(0), node->input(1), node->input(2)});
}

// aten::addmm(b, x, w, beta, alpha) with beta and alpha the constant 1 (an int or a float) becomes
// mfsdp::linear_t(b, x, w); other scalings stay ATen's.
bool replace_addmm(torch::jit::Node* node) {
  if (node->inputs().size() != 5 || node->outputs().size() != 1) return false;
  for (size_t i : {3, 4}) {
    const auto c = torch::jit::toIValue(node->input(i));
    if (!c || !((c->isInt() && c->toInt() == 1) || (c->isDouble() && c->toDouble() == 1.0))) return false;
  }
  return replace_node_by(node, "mfsdp::linear_t", {node->input(0), node->input(1), node->input(2)});
}

}  // namespace

void set_grad_sink(GradSink* sink) { g_sink.store(sink); }

// Into called functions too: nn.MultiheadAttention's projections are linear calls inside
// torch.nn.functional's multi_head_attention_forward (the sink finds a parameter by identity).
// HF's Conv1D too (its addmm; under tensor parallelism its call sites are matmul and add, left alone).
// Embeddings too: scripted nn.Embedding calls torch.nn.functional.embedding, whose aten::embedding
// is in that function's graph.
SinkCalls use_sink_linear(torch::jit::Module& root) {
  SinkCalls calls;
  rewrite_nodes(root, {c10::aten::linear, c10::aten::addmm, c10::aten::embedding}, [&](torch::jit::Node* node) {
    const bool embedding = node->kind() == c10::aten::embedding;
    const bool done = embedding ? replace_embedding(node)
                      : node->kind() == c10::aten::linear ? replace_linear(node) : replace_addmm(node);
    if (done) ++(embedding ? calls.embedding : calls.linear);
    return done;
  }, /*into_functions=*/true);
  return calls;
}

}  // namespace mfsdp

TORCH_LIBRARY_FRAGMENT(mfsdp, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? b) -> Tensor");
  m.def("linear_t(Tensor b, Tensor x, Tensor w) -> Tensor");
  m.def("embedding(Tensor weight, Tensor indices, int padding_idx, bool scale_grad_by_freq, bool sparse) -> Tensor");
}

TORCH_LIBRARY_IMPL(mfsdp, Autograd, m) {
  m.impl("linear", mfsdp::linear_autograd);
  m.impl("linear_t", mfsdp::linear_t_autograd);
  m.impl("embedding", mfsdp::embedding_autograd);
}

TORCH_LIBRARY_IMPL(mfsdp, CompositeExplicitAutograd, m) {
  m.impl("linear", mfsdp::linear_plain);
  m.impl("linear_t", mfsdp::linear_t_plain);
  m.impl("embedding", mfsdp::embedding_plain);
}
