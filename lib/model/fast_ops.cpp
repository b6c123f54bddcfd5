#include "model/fast_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "model/cpu_kernels.h"
#include "model/graph_rewrite.h"

namespace mfsdp {
namespace {

bool is_float_tensor_type(const torch::jit::Value* v) {
  // The traced/scripted type of x: a Tensor whose dtype, when recorded, is float.
  auto t = v->type()->cast<c10::TensorType>();
  return t && (!t->scalarType() || *t->scalarType() == at::kFloat);
}

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

bool rms_ours(const at::Tensor& x) {
  return x.device().is_cpu() && x.layout() == at::kStrided && x.scalar_type() == at::kFloat && x.dim() >= 1 &&
         x.size(-1) > 0;
}

// What the replaced ops computed, for inputs the kernel does not take.
at::Tensor rms_scale_aten(const at::Tensor& x, double eps) {
  return x * at::rsqrt(x.pow(2).mean({-1}, /*keepdim=*/true) + eps);
}

// y = x r per row, r = 1 / sqrt(mean(x^2) + eps) into `r` (rows of the last dimension).
at::Tensor rms_forward(const at::Tensor& xc, double eps, at::Tensor& r) {
  const int64_t d = xc.size(-1), rows = xc.numel() / d;
  at::Tensor y = at::empty_like(xc);
  r = at::empty({rows}, xc.options());
  const float* in = xc.const_data_ptr<float>();
  float *out = y.mutable_data_ptr<float>(), *rr = r.mutable_data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / d), [&](int64_t b, int64_t e) {
    rms_scale_forward(in + b * d, out + b * d, rr + b, e - b, d, eps);
  });
  return y;
}

struct RmsScale : public torch::autograd::Function<RmsScale> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double eps) {
    const at::Tensor xc = x.contiguous();
    at::Tensor r;
    at::Tensor y = rms_forward(xc, eps, r);
    ctx->save_for_backward({xc, r});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &r = saved[1];
    const at::Tensor gc = g[0].to(at::kFloat).contiguous();
    const int64_t d = x.size(-1), rows = x.numel() / d;
    at::Tensor dx = at::empty_like(x);
    const float *gi = gc.const_data_ptr<float>(), *xi = x.const_data_ptr<float>(), *rr = r.const_data_ptr<float>();
    float* out = dx.mutable_data_ptr<float>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / d), [&](int64_t b, int64_t e) {
      rms_scale_backward(gi + b * d, xi + b * d, rr + b, out + b * d, e - b, d);
    });
    return {dx, at::Tensor()};
  }
};

at::Tensor rms_scale_autograd(const at::Tensor& x, double eps) {
  return rms_ours(x) ? RmsScale::apply(x, eps) : rms_scale_aten(x, eps);
}
at::Tensor rms_scale_plain(const at::Tensor& x, double eps) {
  if (!rms_ours(x)) return rms_scale_aten(x, eps);
  at::Tensor r;
  return rms_forward(x.contiguous(), eps, r);
}

// The value of a constant node input: an int or float, or a one-element tensor.
std::optional<double> constant_number(torch::jit::Value* v) {
  auto c = torch::jit::toIValue(v);
  if (!c) return std::nullopt;
  if (c->isDouble()) return c->toDouble();
  if (c->isInt()) return double(c->toInt());
  if (c->isTensor() && c->toTensor().numel() == 1) return c->toTensor().item<double>();
  return std::nullopt;
}

// A constant int list: a constant, or a prim::ListConstruct of constant ints (scripted code).
std::optional<std::vector<int64_t>> int_list(torch::jit::Value* v) {
  if (auto c = torch::jit::toIValue(v); c && c->isIntList()) return c->toIntVector();
  if (v->node()->kind() != c10::prim::ListConstruct) return std::nullopt;
  std::vector<int64_t> out;
  for (torch::jit::Value* e : v->node()->inputs()) {
    auto c = torch::jit::toIValue(e);
    if (!c || !c->isInt()) return std::nullopt;
    out.push_back(c->toInt());
  }
  return out;
}

// The node producing v when it is of `kind` and v has no other use.
torch::jit::Node* sole_producer(torch::jit::Value* v, c10::Symbol kind) {
  return v->node()->kind() == kind && v->uses().size() == 1 ? v->node() : nullptr;
}

// x * rsqrt(mean(pow(x, 2), [-1], keepdim=True) + eps), as RMSNorm modules write it (HF's traced,
// mfsdp's scripted): the mul becomes mfsdp::rms_scale(x, eps), the other nodes go.
bool replace_rms(torch::jit::Node* rsqrt) {
  using torch::jit::Node;
  using torch::jit::Value;
  if (rsqrt->kind() != c10::aten::rsqrt || rsqrt->output()->uses().size() != 1) return false;
  Node* mul = rsqrt->output()->uses()[0].user;
  if (mul->kind() != c10::aten::mul || mul->inputs().size() != 2) return false;
  Node* add = sole_producer(rsqrt->input(0), c10::aten::add);
  if (!add || add->inputs().size() != 3 || constant_number(add->input(2)) != 1.0) return false;
  Node* mean = sole_producer(add->input(0), c10::aten::mean);
  if (!mean || mean->inputs().size() != 4) return false;
  auto keep = torch::jit::toIValue(mean->input(2));
  auto dtype = torch::jit::toIValue(mean->input(3));
  if (int_list(mean->input(1)) != std::vector<int64_t>{-1} || !keep || !keep->isBool() || !keep->toBool() || !dtype ||
      !dtype->isNone())
    return false;
  Node* pow = sole_producer(mean->input(0), c10::aten::pow);
  if (!pow || pow->inputs().size() != 2 || constant_number(pow->input(1)) != 2.0) return false;
  Value* x = pow->input(0);
  const int other = mul->input(0) == rsqrt->output() ? 1 : 0;
  if (mul->input(other) != x || !is_float_tensor_type(x)) return false;
  // eps: a constant (a traced 0-dim tensor too) or a float the graph reads (a scripted attribute).
  Value* eps = add->input(1);
  torch::jit::Graph& g = *mul->owningGraph();
  torch::jit::WithInsertPoint guard(mul);
  if (auto c = constant_number(eps)) {
    eps = g.insertConstant(*c);
  } else if (eps->type()->kind() != c10::TypeKind::FloatType) {
    return false;
  }
  Value* y = g.insert(c10::Symbol::fromQualString("mfsdp::rms_scale"), {x, eps});
  y->setType(mul->output()->type());
  mul->output()->replaceAllUsesWith(y);
  for (Node* n : {mul, rsqrt, add, mean, pow}) n->destroy();
  return true;
}

bool near(std::optional<double> v, double want) { return v && std::fabs(*v - want) <= 1e-6 * std::fabs(want); }

// The value of `v` when it is produced by `kind`(a, constant c) or `kind`(constant c, a) with c
// near `want` (and, for an add, alpha 1), and nothing else uses v; else nullptr.
torch::jit::Value* with_constant(torch::jit::Value* v, c10::Symbol kind, double want) {
  torch::jit::Node* n = sole_producer(v, kind);
  if (!n || n->inputs().size() < 2 || (kind == c10::aten::add && (n->inputs().size() != 3 ||
                                                                    constant_number(n->input(2)) != 1.0)))
    return nullptr;
  if (near(constant_number(n->input(1)), want)) return n->input(0);
  if (near(constant_number(n->input(0)), want)) return n->input(1);
  return nullptr;
}

// GELU's tanh form spelled out, as transformers' NewGELUActivation ("gelu_new": GPT-2, GPT-J,
// CodeGen, GPT-Neo) writes it: 0.5 * x * (1.0 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3.0)))).
// Matched from its tanh; the eight nodes become one mfsdp::gelu_tanh(x).
bool replace_spelled_gelu(torch::jit::Node* tanh) {
  using torch::jit::Node;
  using torch::jit::Value;
  if (tanh->kind() != c10::aten::tanh || tanh->output()->uses().size() != 1) return false;
  Node* plus1 = tanh->output()->uses()[0].user;  // 1.0 + tanh(...)
  if (plus1->kind() != c10::aten::add || plus1->inputs().size() != 3 || constant_number(plus1->input(2)) != 1.0 ||
      plus1->output()->uses().size() != 1)
    return false;
  const int t_at = plus1->input(0) == tanh->output() ? 0 : 1;
  if (!near(constant_number(plus1->input(1 - t_at)), 1.0)) return false;
  Node* out = plus1->output()->uses()[0].user;  // (0.5 * x) * (1.0 + tanh)
  if (out->kind() != c10::aten::mul || out->inputs().size() != 2) return false;
  Value* half_x = out->input(0) == plus1->output() ? out->input(1) : out->input(0);
  Value* inner = with_constant(tanh->input(0), c10::aten::mul, 0.7978845608028654);  // x + 0.044715 x^3
  if (!inner || half_x->node()->kind() != c10::aten::mul) return false;
  Node* sum = sole_producer(inner, c10::aten::add);
  if (!sum || sum->inputs().size() != 3 || constant_number(sum->input(2)) != 1.0) return false;
  for (int i : {0, 1}) {
    Value* x = sum->input(i);
    Value* cube = with_constant(sum->input(1 - i), c10::aten::mul, 0.044715);
    Node* pow = cube ? sole_producer(cube, c10::aten::pow) : nullptr;
    if (!pow || pow->input(0) != x || !near(constant_number(pow->input(1)), 3.0)) continue;
    Node* half = half_x->node();
    const bool half_ok = half_x->uses().size() == 1 &&
                         ((half->input(0) == x && near(constant_number(half->input(1)), 0.5)) ||
                          (half->input(1) == x && near(constant_number(half->input(0)), 0.5)));
    if (!half_ok || !is_float_tensor_type(x)) return false;
    // Users before producers: (0.5 x) * (1 + t), 1 + t, tanh, the sqrt(2/pi) product, the sum,
    // the 0.044715 product, the cube, 0.5 x.
    const std::vector<Node*> chain = {out, plus1, tanh, tanh->input(0)->node(), sum, sum->input(1 - i)->node(), pow,
                                      half};
    torch::jit::Graph& g = *out->owningGraph();
    torch::jit::WithInsertPoint guard(out);
    Value* y = g.insert(c10::Symbol::fromQualString("mfsdp::gelu_tanh"), {x});
    y->setType(out->output()->type());
    out->output()->replaceAllUsesWith(y);
    for (Node* n : chain) n->destroy();
    return true;
  }
  return false;
}

// aten::gelu(x, "tanh") becomes mfsdp::gelu_tanh(x).
bool replace_gelu(torch::jit::Node* node) {
  if (node->inputs().size() != 2 || node->outputs().size() != 1) return false;
  auto how = torch::jit::toIValue(node->input(1));
  if (!how || !how->isString() || how->toStringRef() != "tanh") return false;
  torch::jit::Graph& g = *node->owningGraph();
  torch::jit::WithInsertPoint guard(node);
  torch::jit::Value* y = g.insert(c10::Symbol::fromQualString("mfsdp::gelu_tanh"), {node->input(0)});
  y->setType(node->output()->type());
  node->output()->replaceAllUsesWith(y);
  node->destroy();
  return true;
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
  return rewrite_nodes(root, {c10::aten::gelu, c10::aten::tanh}, [](torch::jit::Node* node) {
    return node->kind() == c10::aten::gelu ? replace_gelu(node) : replace_spelled_gelu(node);
  });
}

int use_fast_rms_norm(torch::jit::Module& root) { return rewrite_nodes(root, {c10::aten::rsqrt}, replace_rms); }

at::Tensor rms_scale(const at::Tensor& x, double eps) { return rms_scale_autograd(x, eps); }

}  // namespace mfsdp

TORCH_LIBRARY_FRAGMENT(mfsdp, m) {
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("rms_scale(Tensor x, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(mfsdp, Autograd, m) {
  m.impl("gelu_tanh", mfsdp::gelu_tanh_autograd);
  m.impl("rms_scale", mfsdp::rms_scale_autograd);
}

TORCH_LIBRARY_IMPL(mfsdp, CompositeExplicitAutograd, m) {
  m.impl("gelu_tanh", mfsdp::gelu_tanh);
  m.impl("rms_scale", mfsdp::rms_scale_plain);
}
