// cross_entropy.h: the output loss, in row chunks, with an optional vocabulary-parallel group.
#include "parallel/cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>

#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "model/cpu_kernels.h"

namespace mfsdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows per chunk: about 16 MiB of fp32 temporaries on the CPU (they stay in the caches' reach of
// the allocator and cost nothing to split), 256 MiB on a GPU (few enough kernel launches to be
// negligible beside the head's matmul, still a fraction of a large vocabulary's logits).
int64_t chunk_rows(const at::Tensor& logits) {
  const int64_t elems = logits.is_cuda() ? (int64_t(1) << 26) : (int64_t(1) << 22);
  return std::max<int64_t>(1, elems / std::max<int64_t>(1, logits.size(1)));
}

void for_chunks(const at::Tensor& logits, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t n = logits.size(0), step = chunk_rows(logits);
  for (int64_t r = 0; r < n; r += step) fn(r, std::min(step, n - r));
}

std::atomic<int64_t> g_overwrites{0};

// fp32 or bf16 rows on the CPU, each of unit stride: the fused row kernels (model/cpu_kernels.h)
// take them.
bool fused_rows(const at::Tensor& logits) {
  const at::ScalarType t = logits.scalar_type();
  return logits.is_cpu() && (t == at::kFloat || t == at::kBFloat16) && logits.dim() == 2 &&
         (logits.stride(1) == 1 || logits.size(1) <= 1) && logits.size(1) > 0;
}

// Rows [0, n) over ATen's threads, a grain of a few rows (a row is a whole vocabulary).
template <class Fn>
void for_rows(int64_t n, Fn fn) {
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i);
  });
}

// Whether nothing but this function's own saved reference can read `logits` once its backward has
// run, so that the gradient may be written over them: the caller promised to drop its handles
// (`consume`), one tensor object holds the storage (two with a view's base: the trainer reshapes
// the model's [B, T, V] output), and nothing else holds that object (the saved variable and the
// backward's unpacked copy). A model whose last op saved its own output (torch.tanh, softmax, ...)
// or a caller that kept a handle shows up as one reference more, and gets a fresh gradient.
bool may_overwrite(const at::Tensor& logits, bool consume) {
  if (!consume || !logits.has_storage()) return false;
  const int64_t owners = logits.is_view() ? 2 : 1;
  return int64_t(logits.storage().use_count()) <= owners && int64_t(logits.use_count()) <= 2;
}

struct ChunkedCrossEntropy : public torch::autograd::Function<ChunkedCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& all_logits, const at::Tensor& targets,
                            Communicator* group, int64_t start, int64_t real_columns, bool consume) {
    // Padding columns of an uneven vocabulary split are left out: `logits` are the real ones.
    const int64_t n = all_logits.size(0), v = real_columns < 0 ? all_logits.size(1) : real_columns;
    const at::Tensor logits = v == all_logits.size(1) ? all_logits : all_logits.narrow(1, 0, v);
    const auto f32 = all_logits.options().dtype(at::kFloat);
    at::Tensor lse = at::empty({n}, f32);
    at::Tensor idx = targets, mine;  // the target's column here; whether this rank holds it
    if (group) {
      at::Tensor local = targets - start;
      mine = local.ge(0).logical_and(local.lt(v));
      idx = local.clamp(0, std::max<int64_t>(v, 1) - 1);
    }
    at::Tensor target_logit = v > 0 ? logits.gather(1, idx.unsqueeze(1)).squeeze(1).to(at::kFloat) : at::zeros({n}, f32);
    if (!group && fused_rows(logits)) {
      float* l = lse.mutable_data_ptr<float>();
      const int64_t ld = logits.stride(0), v_cols = v;
      if (logits.scalar_type() == at::kFloat) {
        const float* x = logits.const_data_ptr<float>();
        for_rows(n, [&](int64_t i) { l[i] = logsumexp_row(x + i * ld, v_cols); });
      } else {
        const uint16_t* x = reinterpret_cast<const uint16_t*>(logits.const_data_ptr<at::BFloat16>());
        for_rows(n, [&](int64_t i) { l[i] = logsumexp_row_bf16(x + i * ld, v_cols); });
      }
    } else if (!group) {
      for_chunks(logits, [&](int64_t r, int64_t k) { lse.narrow(0, r, k).copy_(logits.narrow(0, r, k).to(at::kFloat).logsumexp(1)); });
    } else {
      // The global maximum first (exp of the shifted logits cannot overflow), then one all-reduce
      // for both the sums of exponentials and the target logits (zero where another rank holds it).
      // A rank whose columns are all padding adds -inf to the maximum and 0 to the sums.
      FlightTag tag("vocab-parallel cross entropy");
      at::Tensor m = at::full({n}, -std::numeric_limits<float>::infinity(), f32);
      at::Tensor both = at::zeros({2, n}, f32);
      if (v > 0)
        for_chunks(logits, [&](int64_t r, int64_t k) { m.narrow(0, r, k).copy_(std::get<0>(logits.narrow(0, r, k).to(at::kFloat).max(1))); });
      group->all_reduce(m, ReduceOp::kMax);
      if (v > 0)
        for_chunks(logits, [&](int64_t r, int64_t k) {
          both[0].narrow(0, r, k).copy_((logits.narrow(0, r, k).to(at::kFloat) - m.narrow(0, r, k).unsqueeze(1)).exp_().sum(1));
        });
      both[1].copy_(target_logit.masked_fill(mine.logical_not(), 0));
      group->all_reduce(both, ReduceOp::kSum);
      lse = m + both[0].log();
      target_logit = both[1];
    }
    ctx->save_for_backward({all_logits, lse});
    ctx->saved_data["real"] = v;
    ctx->saved_data["consume"] = consume;
    ctx->saved_data["idx"] = idx;
    if (mine.defined()) ctx->saved_data["mine"] = mine;
    return lse - target_logit;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& all_logits = saved[0];
    const at::Tensor& lse = saved[1];
    const int64_t v = ctx->saved_data["real"].toInt();
    const at::Tensor idx = ctx->saved_data["idx"].toTensor();
    const at::Tensor g = grads[0].to(at::kFloat);
    // d loss_i / d logit_ij = softmax_ij - [j == target_i]; onehot only where this rank holds it.
    const at::Tensor mine = ctx->saved_data.count("mine") ? ctx->saved_data["mine"].toTensor().to(at::kFloat)
                                                          : at::Tensor();
    if (fused_rows(all_logits) && v > 0) {
      // One pass per row, straight into the gradient: over the logits themselves when nothing else
      // can read them (may_overwrite): no logits-sized allocation, whose first touch page-faulted a
      // fresh 200 MB every step at GPT-2's vocabulary (and no second logits-sized tensor at the
      // backward's largest moment).
      const bool in_place = may_overwrite(all_logits, ctx->saved_data["consume"].toBool());
      if (in_place) g_overwrites.fetch_add(1, std::memory_order_relaxed);
      at::Tensor grad = in_place ? all_logits : at::empty_like(all_logits, at::MemoryFormat::Contiguous);
      const int64_t cols = all_logits.size(1), ldx = all_logits.stride(0), ldg = grad.stride(0);
      const at::Tensor idx_c = idx.to(at::kLong).contiguous(), g_c = g.reshape({-1}).contiguous(),
                       mine_c = mine.defined() ? mine.contiguous() : at::Tensor(), lse_c = lse.contiguous();
      const int64_t* t = idx_c.const_data_ptr<int64_t>();
      const float *gp = g_c.const_data_ptr<float>(), *l = lse_c.const_data_ptr<float>();
      const float* oh = mine_c.defined() ? mine_c.const_data_ptr<float>() : nullptr;  // none: every row's own
      if (all_logits.scalar_type() == at::kFloat) {
        const float* x = all_logits.const_data_ptr<float>();
        float* out = grad.mutable_data_ptr<float>();
        for_rows(all_logits.size(0), [&](int64_t i) {
          xent_grad_row(x + i * ldx, l[i], t[i], oh ? oh[i] : 1.0f, gp[i], out + i * ldg, v);
          if (v < cols) std::memset(out + i * ldg + v, 0, size_t(cols - v) * sizeof(float));  // padding columns
        });
      } else {  // bf16: computed in float, rounded once (a zero bf16 is zero bits)
        const uint16_t* x = reinterpret_cast<const uint16_t*>(all_logits.const_data_ptr<at::BFloat16>());
        uint16_t* out = reinterpret_cast<uint16_t*>(grad.mutable_data_ptr<at::BFloat16>());
        for_rows(all_logits.size(0), [&](int64_t i) {
          xent_grad_row_bf16(x + i * ldx, l[i], t[i], oh ? oh[i] : 1.0f, gp[i], out + i * ldg, v);
          if (v < cols) std::memset(out + i * ldg + v, 0, size_t(cols - v) * sizeof(uint16_t));
        });
      }
      return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const at::Tensor onehot = mine.defined() ? mine.unsqueeze(1) : at::ones({all_logits.size(0), 1}, lse.options());
    at::Tensor grad = at::empty_like(all_logits, at::MemoryFormat::Contiguous);
    if (v < all_logits.size(1)) grad.narrow(1, v, all_logits.size(1) - v).zero_();  // padding columns
    const at::Tensor logits = all_logits.narrow(1, 0, v);
    if (v > 0)
      for_chunks(logits, [&](int64_t r, int64_t k) {
        at::Tensor p = (logits.narrow(0, r, k).to(at::kFloat) - lse.narrow(0, r, k).unsqueeze(1)).exp_();
        p.scatter_add_(1, idx.narrow(0, r, k).unsqueeze(1), -onehot.narrow(0, r, k));
        p.mul_(g.narrow(0, r, k).unsqueeze(1));
        grad.narrow(0, r, k).narrow(1, 0, v).copy_(p);
      });
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor cross_entropy_per_token(const at::Tensor& logits, const at::Tensor& targets, Communicator* vocab_group,
                                   int64_t vocab_start, int64_t real_columns, bool consume_logits) {
  return ChunkedCrossEntropy::apply(logits, targets, vocab_group, vocab_start, real_columns, consume_logits);
}

int64_t cross_entropy_overwrites() { return g_overwrites.load(std::memory_order_relaxed); }

}  // namespace mfsdp
