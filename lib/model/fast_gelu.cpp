#include "model/fast_gelu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>

#include <set>

#include "model/gelu_kernel.h"

namespace mfsdp {
namespace {

bool ours(const at::Tensor& x) {
  return x.device().is_cpu() && x.layout() == at::kStrided &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

// Elements in chunks of 64 Ki over at::parallel_for: the kernels are per element, so any split
// gives the same result.
template <typename F>
void chunks(int64_t n, F f) {
  at::parallel_for(0, n, 65536, [&](int64_t begin, int64_t end) { f(begin, end - begin); });
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GeluTanh : public torch::autograd::Function<GeluTanh> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    return gelu_tanh(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {gelu_tanh_backward(g[0], ctx->get_saved_variables()[0])};
  }
};

at::Tensor gelu_tanh_autograd(const at::Tensor& x) { return GeluTanh::apply(x); }

void replace_in(torch::jit::Block* block, int& replaced) {
  static const c10::Symbol op = c10::Symbol::fromQualString("mfsdp::gelu_tanh");
  for (auto it = block->nodes().begin(); it != block->nodes().end();) {
    torch::jit::Node* node = *it;
    ++it;
    for (auto* sub : node->blocks()) replace_in(sub, replaced);
    if (node->kind() != c10::aten::gelu || node->inputs().size() != 2 || node->outputs().size() != 1) continue;
    auto how = torch::jit::toIValue(node->input(1));
    if (!how || !how->isString() || how->toStringRef() != "tanh") continue;
    torch::jit::Graph& g = *node->owningGraph();
    torch::jit::WithInsertPoint guard(node);
    torch::jit::Value* y = g.insert(op, {node->input(0)});
    y->setType(node->output()->type());
    node->output()->replaceAllUsesWith(y);
    node->destroy();
    ++replaced;
  }
}

}  // namespace

at::Tensor gelu_tanh(const at::Tensor& x) {
  if (!ours(x)) return at::gelu(x, "tanh");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  if (xc.scalar_type() == at::kFloat) {
    const float* in = xc.const_data_ptr<float>();
    float* out = y.mutable_data_ptr<float>();
    chunks(xc.numel(), [&](int64_t at, int64_t n) { gelu_tanh_forward(in + at, out + at, n); });
  } else {
    auto in = reinterpret_cast<const uint16_t*>(xc.const_data_ptr<at::BFloat16>());
    auto out = reinterpret_cast<uint16_t*>(y.mutable_data_ptr<at::BFloat16>());
    chunks(xc.numel(), [&](int64_t at, int64_t n) { gelu_tanh_forward_bf16(in + at, out + at, n); });
  }
  return y;
}

at::Tensor gelu_tanh_backward(const at::Tensor& g, const at::Tensor& x) {
  if (!ours(x) || g.scalar_type() != x.scalar_type() || g.sizes() != x.sizes())
    return at::gelu_backward(g, x, "tanh");
  const at::Tensor xc = x.contiguous(), gc = g.contiguous();
  at::Tensor dx = at::empty_like(xc);
  if (xc.scalar_type() == at::kFloat) {
    const float *gi = gc.const_data_ptr<float>(), *xi = xc.const_data_ptr<float>();
    float* out = dx.mutable_data_ptr<float>();
    chunks(xc.numel(), [&](int64_t at, int64_t n) { mfsdp::gelu_tanh_backward(gi + at, xi + at, out + at, n); });
  } else {
    auto gi = reinterpret_cast<const uint16_t*>(gc.const_data_ptr<at::BFloat16>());
    auto xi = reinterpret_cast<const uint16_t*>(xc.const_data_ptr<at::BFloat16>());
    auto out = reinterpret_cast<uint16_t*>(dx.mutable_data_ptr<at::BFloat16>());
    chunks(xc.numel(), [&](int64_t at, int64_t n) { gelu_tanh_backward_bf16(gi + at, xi + at, out + at, n); });
  }
  return dx;
}

int use_fast_gelu(torch::jit::Module& root) {
  std::set<const c10::ClassType*> seen;
  int replaced = 0;
  for (const auto& m : root.modules()) {
    if (!seen.insert(m.type().get()).second) continue;
    for (const auto& method : m.get_methods())
      replace_in(torch::jit::toGraphFunction(method.function()).graph()->block(), replaced);
  }
  return replaced;
}

}  // namespace mfsdp

TORCH_LIBRARY_FRAGMENT(mfsdp, m) { m.def("gelu_tanh(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(mfsdp, Autograd, m) { m.impl("gelu_tanh", mfsdp::gelu_tanh_autograd); }

TORCH_LIBRARY_IMPL(mfsdp, CompositeExplicitAutograd, m) { m.impl("gelu_tanh", mfsdp::gelu_tanh); }
