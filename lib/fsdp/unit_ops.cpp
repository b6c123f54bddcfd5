#include "fsdp/unit_ops.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include <atomic>

namespace mfsdp {
namespace {

std::atomic<UnitHooks*> g_hooks{nullptr};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Outputs are the inputs themselves (autograd makes them views with this node as grad_fn).
variable_list pass_through(at::TensorList inputs) { return variable_list(inputs.begin(), inputs.end()); }

struct PreForward : public torch::autograd::Function<PreForward> {
  static variable_list forward(AutogradContext* ctx, int64_t unit, at::TensorList inputs) {
    ctx->saved_data["unit"] = unit;
    if (auto* h = g_hooks.load()) h->pre_forward(int(unit));
    return pass_through(inputs);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto* h = g_hooks.load()) h->post_backward(int(ctx->saved_data["unit"].toInt()));
    variable_list out{at::Tensor()};  // no gradient for the unit id
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

struct PostForward : public torch::autograd::Function<PostForward> {
  static variable_list forward(AutogradContext* ctx, int64_t unit, at::TensorList outputs) {
    ctx->saved_data["unit"] = unit;
    if (auto* h = g_hooks.load()) h->post_forward(int(unit));
    return pass_through(outputs);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto* h = g_hooks.load()) h->pre_backward(int(ctx->saved_data["unit"].toInt()));
    variable_list out{at::Tensor()};
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

std::vector<at::Tensor> pre_forward_autograd(int64_t unit, at::TensorList inputs) {
  return PreForward::apply(unit, inputs);
}
std::vector<at::Tensor> post_forward_autograd(int64_t unit, at::TensorList outputs) {
  return PostForward::apply(unit, outputs);
}
// Below autograd (inference mode, or no tensor needs grad): the hooks, no graph.
std::vector<at::Tensor> pre_forward_plain(int64_t unit, at::TensorList inputs) {
  if (auto* h = g_hooks.load()) h->pre_forward(int(unit));
  return std::vector<at::Tensor>(inputs.begin(), inputs.end());
}
std::vector<at::Tensor> post_forward_plain(int64_t unit, at::TensorList outputs) {
  if (auto* h = g_hooks.load()) h->post_forward(int(unit));
  return std::vector<at::Tensor>(outputs.begin(), outputs.end());
}

}  // namespace

TORCH_LIBRARY(mfsdp, m) {
  m.def(torch::schema("mfsdp::pre_forward(int unit, Tensor[] inputs) -> Tensor[]", c10::AliasAnalysisKind::CONSERVATIVE));
  m.def(torch::schema("mfsdp::post_forward(int unit, Tensor[] outputs) -> Tensor[]", c10::AliasAnalysisKind::CONSERVATIVE));
}

TORCH_LIBRARY_IMPL(mfsdp, Autograd, m) {
  m.impl("pre_forward", pre_forward_autograd);
  m.impl("post_forward", post_forward_autograd);
}

TORCH_LIBRARY_IMPL(mfsdp, CompositeExplicitAutograd, m) {
  m.impl("pre_forward", pre_forward_plain);
  m.impl("post_forward", post_forward_plain);
}

void set_unit_hooks(UnitHooks* hooks) { g_hooks.store(hooks); }

}  // namespace mfsdp
