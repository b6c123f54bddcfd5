#include "fsdp/unit_ops.h"

#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/script.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <atomic>

#include "model/graph_rewrite.h"

namespace mfsdp {
namespace {

std::atomic<UnitHooks*> g_hooks{nullptr};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Outputs are the inputs themselves (autograd makes them views with this node as grad_fn). A
// custom Function's outputs all require grad once any input does, so an input that needs none
// (HF's rotary cos/sin tables, passed from layer to layer as position_embeddings; an attention
// mask) is marked non-differentiable and leaves as it came: otherwise the unit downstream would
// differentiate with respect to it, ATen's rotary in place of mfsdp's kernel and a reduction per
// table per layer for a gradient nobody reads. Gradients are not materialised: an output with no
// gradient passes an undefined one back (a None), not a tensor of zeros.
variable_list pass_through(AutogradContext* ctx, at::TensorList inputs) {
  ctx->set_materialize_grads(false);
  variable_list no_grad;
  for (const auto& t : inputs)
    if (t.defined() && !t.requires_grad()) no_grad.push_back(t);
  if (!no_grad.empty()) ctx->mark_non_differentiable(no_grad);
  return variable_list(inputs.begin(), inputs.end());
}

struct PreForward : public torch::autograd::Function<PreForward> {
  static variable_list forward(AutogradContext* ctx, int64_t unit, at::TensorList inputs) {
    ctx->saved_data["unit"] = unit;
    if (auto* h = g_hooks.load()) h->pre_forward(int(unit));
    return pass_through(ctx, inputs);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto* h = g_hooks.load()) h->post_backward(int(ctx->saved_data["unit"].toInt()));
    variable_list out{at::Tensor()};  // no gradient for the unit id
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

struct PostForward : public torch::autograd::Function<PostForward> {
  // `follows` is decided by the caller: inside forward() grad mode is always off.
  static variable_list forward(AutogradContext* ctx, int64_t unit, bool follows, at::TensorList outputs) {
    ctx->saved_data["unit"] = unit;
    if (auto* h = g_hooks.load()) h->post_forward(int(unit), follows);
    return pass_through(ctx, outputs);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto* h = g_hooks.load()) h->pre_backward(int(ctx->saved_data["unit"].toInt()));
    variable_list out{at::Tensor(), at::Tensor()};  // no gradient for the unit id nor the flag
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

std::vector<at::Tensor> pre_forward_autograd(int64_t unit, at::TensorList inputs) {
  return PreForward::apply(unit, inputs);
}
std::vector<at::Tensor> post_forward_autograd(int64_t unit, at::TensorList outputs) {
  bool follows = false;
  if (at::GradMode::is_enabled())
    for (const auto& t : outputs) follows = follows || (t.defined() && t.requires_grad());
  return PostForward::apply(unit, follows, outputs);
}
// Below autograd (inference mode, or no tensor needs grad): the hooks, no graph.
std::vector<at::Tensor> pre_forward_plain(int64_t unit, at::TensorList inputs) {
  if (auto* h = g_hooks.load()) h->pre_forward(int(unit));
  return std::vector<at::Tensor>(inputs.begin(), inputs.end());
}
std::vector<at::Tensor> post_forward_plain(int64_t unit, at::TensorList outputs) {
  if (auto* h = g_hooks.load()) h->post_forward(int(unit), false);
  return std::vector<at::Tensor>(outputs.begin(), outputs.end());
}

// Activation checkpointing of one unit call: forward runs the unit without keeping its activations
// (only its inputs are saved); backward runs it again with autograd on and back-propagates through
// the recomputed graph (a reentrant backward, as torch.utils.checkpoint(use_reentrant=True) does).
// The unit's own pre/post_forward ops run in both passes; the engine is told that the second one
// is a recompute, so that it gathers the unit's weights once for recompute and backward together.
// The random state (CPU, and the device's when the inputs are on one) is saved before the forward
// and restored for the recompute, then put back, so that dropout draws the same mask in both
// passes and the rest of backward sees the generator as it was: losses are bit-identical with and
// without checkpointing (torch.utils.checkpoint's preserve_rng_state). Units must take and return
// Tensors.
struct RngStash {
  at::Tensor cpu, device;
  c10::Device where{at::kCPU};
  static at::Generator device_generator(const c10::Device& d) {
    return at::globalContext().defaultGenerator(d);
  }
  static RngStash take(at::TensorList inputs) {
    RngStash s;
    s.cpu = at::detail::getDefaultCPUGenerator().get_state();
    for (const auto& t : inputs)
      if (t.defined() && !t.device().is_cpu()) {
        s.where = t.device();
        s.device = device_generator(s.where).get_state();
        break;
      }
    return s;
  }
  void restore() const {
    at::Generator cpu_gen = at::detail::getDefaultCPUGenerator();
    cpu_gen.set_state(cpu);
    if (device.defined()) {
      at::Generator dev_gen = device_generator(where);
      dev_gen.set_state(device);
    }
  }
};

// A reentrant checkpoint's output requires grad only when one of its inputs does; the unit's own
// parameters are not inputs. When nothing before the unit trains (model.frozen: a frozen embedding
// and frozen first layers), its input needs no gradient, and without help its trainable parameters
// would silently get none. So a unit with trainable parameters gets one more input, an empty tensor
// that requires grad (torch.utils.checkpoint's reentrant variant has the same trap and leaves it
// to the user); `dummy` says whether the last input is it.
struct Checkpoint : public torch::autograd::Function<Checkpoint> {
  static variable_list forward(AutogradContext* ctx, c10::IValue module, at::TensorList all_inputs, bool dummy) {
    at::TensorList inputs = dummy ? all_inputs.slice(0, all_inputs.size() - 1) : all_inputs;
    ctx->saved_data["module"] = module;
    ctx->saved_data["dummy"] = dummy;
    ctx->save_for_backward(variable_list(inputs.begin(), inputs.end()));
    RngStash rng = RngStash::take(inputs);
    ctx->saved_data["rng_cpu"] = rng.cpu;
    if (rng.device.defined()) {
      ctx->saved_data["rng_device"] = rng.device;
      ctx->saved_data["rng_where"] = rng.where.str();
    }
    torch::jit::Module m(module.toObject());
    std::vector<c10::IValue> args(inputs.begin(), inputs.end());
    c10::IValue out = m.forward(args);
    return {out.toTensor()};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    torch::jit::Module m(ctx->saved_data["module"].toObject());
    variable_list saved = ctx->get_saved_variables();
    variable_list detached;
    std::vector<c10::IValue> args;
    for (auto& t : saved) {
      at::Tensor d = t.detach();
      if (t.is_floating_point()) d.requires_grad_(t.requires_grad());
      detached.push_back(d);
      args.emplace_back(d);
    }
    RngStash forward_rng;
    forward_rng.cpu = ctx->saved_data["rng_cpu"].toTensor();
    if (ctx->saved_data.count("rng_device")) {
      forward_rng.device = ctx->saved_data["rng_device"].toTensor();
      forward_rng.where = c10::Device(ctx->saved_data["rng_where"].toStringRef());
    }
    RngStash now = RngStash::take(detached);
    const int unit = unit_index(m);
    UnitHooks* h = g_hooks.load();
    at::Tensor out;
    {
      at::AutoGradMode enable(true);
      forward_rng.restore();
      if (h) h->recompute(unit, true);
      out = m.forward(args).toTensor();
      if (h) h->recompute(unit, false);
      now.restore();
    }
    torch::autograd::backward({out}, {grads[0]});
    variable_list result{at::Tensor()};  // no gradient for the module argument
    for (auto& d : detached) result.push_back(d.requires_grad() ? d.grad() : at::Tensor());
    if (ctx->saved_data["dummy"].toBool()) result.push_back(at::Tensor());
    result.push_back(at::Tensor());  // nor for the flag
    return result;
  }
};

std::vector<at::Tensor> checkpoint_autograd(c10::IValue module, at::TensorList inputs) {
  bool needs_dummy = false;
  if (at::GradMode::is_enabled()) {
    bool input_requires = false;
    for (const auto& t : inputs) input_requires = input_requires || (t.defined() && t.requires_grad());
    if (!input_requires)
      for (const auto& p : torch::jit::Module(module.toObject()).parameters(/*recurse=*/true))
        if (p.requires_grad()) {
          needs_dummy = true;
          break;
        }
  }
  if (!needs_dummy) return Checkpoint::apply(module, inputs, false);
  std::vector<at::Tensor> with_dummy(inputs.begin(), inputs.end());
  with_dummy.push_back(at::empty({0}, inputs.empty() ? at::TensorOptions() : inputs[0].options()).requires_grad_(true));
  return Checkpoint::apply(module, at::TensorList(with_dummy), true);
}
std::vector<at::Tensor> checkpoint_plain(c10::IValue module, at::TensorList inputs) {
  torch::jit::Module m(module.toObject());
  return {m.forward(std::vector<c10::IValue>(inputs.begin(), inputs.end())).toTensor()};
}

}  // namespace

TORCH_LIBRARY(mfsdp, m) {
  m.def(torch::schema("mfsdp::checkpoint(Any module, Tensor[] inputs) -> Tensor[]", c10::AliasAnalysisKind::CONSERVATIVE));
  m.def(torch::schema("mfsdp::pre_forward(int unit, Tensor[] inputs) -> Tensor[]", c10::AliasAnalysisKind::CONSERVATIVE));
  m.def(torch::schema("mfsdp::post_forward(int unit, Tensor[] outputs) -> Tensor[]", c10::AliasAnalysisKind::CONSERVATIVE));
}

TORCH_LIBRARY_IMPL(mfsdp, Autograd, m) {
  m.impl("pre_forward", pre_forward_autograd);
  m.impl("post_forward", post_forward_autograd);
  m.impl("checkpoint", checkpoint_autograd);
}

TORCH_LIBRARY_IMPL(mfsdp, CompositeExplicitAutograd, m) {
  m.impl("pre_forward", pre_forward_plain);
  m.impl("post_forward", post_forward_plain);
  m.impl("checkpoint", checkpoint_plain);
}

void set_unit_hooks(UnitHooks* hooks) { g_hooks.store(hooks); }

}  // namespace mfsdp
