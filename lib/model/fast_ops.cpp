#include "model/fast_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "model/cpu_attention.h"
#include "model/cpu_kernels.h"
#include "model/device_fast_ops.h"
#include "model/fast_dropout.h"
#include "model/graph_match.h"
#include "model/graph_rewrite.h"

// ATen's fused RMSNorm (at::_fused_rms_norm and its backward, CUDA kernels) arrived in LibTorch 2.8-2.9;
// mfsdp builds against any 2.x, where without it RMSNorm's scaling stays ATen's ops on a GPU.
#if __has_include(<ATen/ops/_fused_rms_norm_backward.h>)
#define MFSDP_FUSED_RMS_NORM 1
#else
#define MFSDP_FUSED_RMS_NORM 0
#endif

namespace mfsdp {
namespace {

bool is_float_tensor_type(const torch::jit::Value* v) {
  // The traced/scripted type of x: a Tensor whose dtype, when recorded, is float.
  auto t = v->type()->cast<c10::TensorType>();
  return t && (!t->scalarType() || *t->scalarType() == at::kFloat);
}

// The GPU kernels lent by the CUDA plugin (device_fast_ops.h), and which of them passed their check
// on this run's GPU (verify_device_fast_ops): a graph calls one only after that.
const DeviceFastOps* device_ops = nullptr;
enum class Op { kRms, kSwiglu, kRotary };
bool gpu_on[3] = {false, false, false};

bool on_gpu(const at::Tensor& x, Op op) { return x.is_cuda() && gpu_on[int(op)]; }

bool float_or_bf16(const at::Tensor& x) {
  return x.layout() == at::kStrided && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}
// A tensor a kernel of `op` takes: on the CPU, or on a GPU where that op's kernel passed its check.
bool ours(const at::Tensor& x, Op op) { return (x.device().is_cpu() || on_gpu(x, op)) && float_or_bf16(x); }
// GELU's kernels are the CPU's alone: ATen's CUDA GELU is one kernel each way already.
bool cpu_ours(const at::Tensor& x) { return x.device().is_cpu() && float_or_bf16(x); }

// Elements in chunks of 64 Ki over at::parallel_for: the kernels are per element, so any split
// gives the same result.
template <typename F>
void chunks(int64_t n, F f) {
  at::parallel_for(0, n, 65536, [&](int64_t begin, int64_t end) { f(begin, end - begin); });
}

// f32() for a float tensor, bf16() for a bfloat16 one (the two dtypes `ours` takes).
template <typename F32, typename BF16>
void by_dtype(const at::Tensor& t, F32 f32, BF16 bf16) {
  if (t.scalar_type() == at::kFloat) f32(); else bf16();
}

const uint16_t* h16(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::BFloat16>()); }
uint16_t* m16(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.mutable_data_ptr<at::BFloat16>()); }

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GeluTanh : public torch::autograd::Function<GeluTanh> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    return gelu_tanh(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {gelu_tanh_backward(g[0], ctx->get_saved_variables()[0], may_overwrite_grad(g[0]))};
  }
};

at::Tensor gelu_tanh_autograd(const at::Tensor& x) { return GeluTanh::apply(x); }

// fp32 rows on the CPU; on a GPU, fp32 or bf16 rows through ATen's fused RMSNorm kernel
// (at::_fused_rms_norm: the one torch.nn.functional.rms_norm runs on CUDA), without a weight.
bool rms_ours(const at::Tensor& x) {
  if (x.layout() != at::kStrided || x.dim() < 1 || x.size(-1) == 0) return false;
  if (on_gpu(x, Op::kRms)) return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
  return x.device().is_cpu() && x.scalar_type() == at::kFloat;
}

// What the replaced ops computed, for inputs the kernel does not take.
at::Tensor rms_scale_aten(const at::Tensor& x, double eps) {
  return x * at::rsqrt(x.pow(2).mean({-1}, /*keepdim=*/true) + eps);
}

// y = x r per row, r = 1 / sqrt(mean(x^2) + eps) into `r` (rows of the last dimension); times the
// weight w (one float per column) when given.
at::Tensor rms_forward(const at::Tensor& xc, double eps, at::Tensor& r, const float* w = nullptr) {
  const int64_t d = xc.size(-1), rows = xc.numel() / d;
  at::Tensor y = at::empty_like(xc);
  r = at::empty({rows}, xc.options());
  const float* in = xc.const_data_ptr<float>();
  float *out = y.mutable_data_ptr<float>(), *rr = r.mutable_data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / d), [&](int64_t b, int64_t e) {
    if (w) rms_norm_forward(in + b * d, w, out + b * d, rr + b, e - b, d, eps);
    else rms_scale_forward(in + b * d, out + b * d, rr + b, e - b, d, eps);
  });
  return y;
}

struct RmsScale : public torch::autograd::Function<RmsScale> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double eps) {
    const at::Tensor xc = x.contiguous();
#if MFSDP_FUSED_RMS_NORM
    if (xc.is_cuda()) {
      auto [y, rstd] = at::_fused_rms_norm(xc, {xc.size(-1)}, std::nullopt, eps);
      ctx->save_for_backward({xc, rstd});
      return y;
    }
#endif
    at::Tensor r;
    at::Tensor y = rms_forward(xc, eps, r);
    ctx->save_for_backward({xc, r});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &r = saved[1];
#if MFSDP_FUSED_RMS_NORM
    if (x.is_cuda()) {
      const at::Tensor gx = g[0].scalar_type() == x.scalar_type() ? g[0] : g[0].to(x.scalar_type());
      auto grads = at::_fused_rms_norm_backward(gx, x, {x.size(-1)}, r, std::nullopt, {true, false});
      return {std::get<0>(grads), at::Tensor()};
    }
#endif
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

// aten::rms_norm(x, [D], weight, eps) (torch.nn.RMSNorm, F.rms_norm: torchtitan's norms), which on
// the CPU ATen runs as its composite of six ops forward and their backwards: on fp32 CPU rows over
// the last dimension, mfsdp's scaling kernel times the weight; anything else is ATen's op itself.
// eps None is float32's machine epsilon, as ATen takes it for fp32 input.
std::optional<double> rms_norm_eps(const at::Tensor& x, at::IntArrayRef shape, const std::optional<at::Tensor>& w,
                                   std::optional<double> eps) {
  if (!x.device().is_cpu() || !rms_ours(x) || shape.size() != 1 || shape[0] != x.size(-1)) return std::nullopt;
  if (w && w->defined() && (w->scalar_type() != x.scalar_type() || !w->device().is_cpu() || w->dim() != 1 ||
                            w->size(0) != x.size(-1)))
    return std::nullopt;
  return eps.value_or(double(std::numeric_limits<float>::epsilon()));
}
at::Tensor rms_scale_plain(const at::Tensor& x, double eps) {
  if (!rms_ours(x)) return rms_scale_aten(x, eps);
#if MFSDP_FUSED_RMS_NORM
  if (x.is_cuda()) return std::get<0>(at::_fused_rms_norm(x.contiguous(), {x.size(-1)}, std::nullopt, eps));
#endif
  at::Tensor r;
  return rms_forward(x.contiguous(), eps, r);
}
// ---- RMSNorm with its weight: (x r) w in one pass each way -------------------------------------
// Whether the weighted kernel takes x and w: fp32 CPU rows (rms_ours) and a weight of one fp32 CPU
// element per column.
bool rms_weight_ours(const at::Tensor& x, const at::Tensor& w) {
  return rms_ours(x) && x.device().is_cpu() && w.defined() && w.device().is_cpu() && w.scalar_type() == at::kFloat &&
         w.dim() == 1 && w.size(0) == x.size(-1);
}

// The weight's gradient is a sum over all rows: the rows split into one part per ATen thread, each
// part adds its rows into a row of `partial` of its own, and those rows are summed at the end (one
// thread: one part, no sum). Parts, not thread ids, index `partial`: the same result however the
// parts land on threads.
struct RmsNormWeight : public torch::autograd::Function<RmsNormWeight> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, double eps) {
    const at::Tensor xc = x.contiguous(), wc = w.contiguous();
    at::Tensor r;
    at::Tensor y = rms_forward(xc, eps, r, wc.const_data_ptr<float>());
    ctx->save_for_backward({xc, wc, r});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &r = saved[2];
    const at::Tensor gc = g[0].to(at::kFloat).contiguous();
    const int64_t d = x.size(-1), rows = x.numel() / d;
    at::Tensor dx = at::empty_like(x);
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / 16));
    const int64_t per = (rows + parts - 1) / parts;
    at::Tensor partial = at::zeros({parts, d}, x.options());
    const float *gi = gc.const_data_ptr<float>(), *xi = x.const_data_ptr<float>(), *wi = w.const_data_ptr<float>(),
                *rr = r.const_data_ptr<float>();
    float *out = dx.mutable_data_ptr<float>(), *dw = partial.mutable_data_ptr<float>();
    at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
      for (int64_t part = b; part < e; ++part) {
        const int64_t r0 = part * per, r1 = std::min(rows, r0 + per);
        if (r0 < r1) rms_norm_backward(gi + r0 * d, xi + r0 * d, wi, rr + r0, out + r0 * d, dw + part * d, r1 - r0, d);
      }
    });
    at::Tensor dwt = partial.size(0) == 1 ? partial[0] : partial.sum(0);
    return {dx, ctx->needs_input_grad(1) ? dwt : at::Tensor(), at::Tensor()};
  }
};

// mfsdp::rms_norm_weight(x, w, eps, dtype): what `w * rms_scale(x).to(dtype)` computes (HF's
// RMSNorm: `self.weight * hidden_states.to(input_dtype)`; dtype None without the cast), through
// the weighted kernel where it takes x and w and the cast keeps fp32, else through those ops.
at::Tensor rms_norm_weight_ops(const at::Tensor& x, const at::Tensor& w, double eps, std::optional<at::ScalarType> dtype,
                               at::Tensor (*scale)(const at::Tensor&, double)) {
  at::Tensor y = scale(x, eps);
  return at::mul(w, dtype ? y.to(*dtype) : y);
}
at::Tensor rms_norm_weight_autograd(const at::Tensor& x, const at::Tensor& w, double eps,
                                    std::optional<at::ScalarType> dtype) {
  if (!rms_weight_ours(x, w) || (dtype && *dtype != at::kFloat))
    return rms_norm_weight_ops(x, w, eps, dtype, rms_scale_autograd);
  return RmsNormWeight::apply(x, w, eps);
}
at::Tensor rms_norm_weight_plain(const at::Tensor& x, const at::Tensor& w, double eps,
                                 std::optional<at::ScalarType> dtype) {
  if (!rms_weight_ours(x, w) || (dtype && *dtype != at::kFloat))
    return rms_norm_weight_ops(x, w, eps, dtype, rms_scale_plain);
  at::Tensor r;
  const at::Tensor wc = w.contiguous();
  return rms_forward(x.contiguous(), eps, r, wc.const_data_ptr<float>());
}

// mfsdp::rms_norm with or without autograd: `Scale` is rms_scale_autograd or rms_scale_plain, and
// `Weighted` the weighted kernel's entry of the same kind.
template <at::Tensor (*Scale)(const at::Tensor&, double),
          at::Tensor (*Weighted)(const at::Tensor&, const at::Tensor&, double, std::optional<at::ScalarType>)>
at::Tensor rms_norm_through(const at::Tensor& x, at::IntArrayRef shape, const std::optional<at::Tensor>& w,
                            std::optional<double> eps) {
  const std::optional<double> e = rms_norm_eps(x, shape, w, eps);
  if (!e) return at::rms_norm(x, shape, w, eps);
  if (w && w->defined()) return Weighted(x, *w, *e, std::nullopt);  // (x r) w, as ATen's composite rounds
  return Scale(x, *e);
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

// mfsdp::rms_scale(x, eps) whose one use multiplies it by a weight, directly or through one cast,
// `w * rms_scale(x).to(dtype)` as HF's RMSNorm modules write it (either operand order: a product
// of two floats rounds the same both ways), becomes mfsdp::rms_norm_weight(x, w, eps, dtype).
bool replace_rms_weight(torch::jit::Node* scale) {
  using torch::jit::Node;
  using torch::jit::Value;
  if (scale->outputs().size() != 1 || scale->output()->uses().size() != 1) return false;
  Value* y = scale->output();
  Node* user = y->uses()[0].user;
  Node* cast = nullptr;
  Value* dtype = nullptr;
  if (user->kind() == c10::aten::to) {
    // aten::to(Tensor self, ScalarType dtype, bool non_blocking, bool copy, MemoryFormat? format):
    // a dtype (a constant, or one the graph reads: mfsdp's scripted `y.to(x.dtype)`) and no memory
    // format (the other overloads take a device or a tensor).
    if (user->inputs().size() != 5 || user->output()->uses().size() != 1) return false;
    auto fmt = torch::jit::toIValue(user->input(4));
    if (user->input(1)->type()->kind() != c10::TypeKind::IntType || !fmt || !fmt->isNone()) return false;
    cast = user;
    dtype = user->input(1);
    y = cast->output();
    user = y->uses()[0].user;
  }
  if (user->kind() != c10::aten::mul || user->inputs().size() != 2) return false;
  Value* w = user->input(0) == y ? user->input(1) : user->input(0);
  if (w == y || !is_float_tensor_type(w)) return false;
  torch::jit::Graph& g = *user->owningGraph();
  torch::jit::WithInsertPoint guard(user);
  if (!dtype) dtype = g.insertConstant(c10::IValue());
  Value* out = g.insert(c10::Symbol::fromQualString("mfsdp::rms_norm_weight"),
                        {scale->input(0), w, scale->input(1), dtype});
  out->setType(user->output()->type());
  user->output()->replaceAllUsesWith(out);
  user->destroy();
  if (cast) cast->destroy();
  scale->destroy();
  return true;
}


// aten::rms_norm(x, shape, weight, eps), or a scripted call of torch.nn.functional.rms_norm (what
// nn.RMSNorm's forward is in a saved TorchScript file: a prim::CallFunction that the executor
// inlines only when it runs), with one constant normalised dimension and a constant eps
// (nn.RMSNorm's __constants__), becomes mfsdp::rms_norm with the same arguments, which runs mfsdp's
// kernel where it takes the call.
bool replace_rms_norm(torch::jit::Node* node) {
  std::vector<torch::jit::Value*> args(node->inputs().begin(), node->inputs().end());
  if (node->kind() == c10::prim::CallFunction) {
    std::string name;
    if (!callee_graph(node, &name) ||
        (name != "torch.nn.functional.rms_norm" && name != "__torch__.torch.nn.functional.rms_norm"))
      return false;
    args.erase(args.begin());  // the function itself
  }
  if (args.size() != 4 || node->outputs().size() != 1 || !is_float_tensor_type(args[0])) return false;
  const auto shape = int_list(args[1]);
  if (!shape || shape->size() != 1) return false;  // one normalised dimension, known now
  auto eps = torch::jit::toIValue(args[3]);
  if (!eps || !(eps->isNone() || eps->isDouble())) return false;
  return replace_node_by(node, "mfsdp::rms_norm", {args[0], args[1], args[2], args[3]});
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
  return replace_node_by(node, "mfsdp::gelu_tanh", {node->input(0)});
}

// ---- SwiGLU: silu(a) * b ------------------------------------------------------------------------

bool same_and_ours(const at::Tensor& a, const at::Tensor& b) {
  return ours(a, Op::kSwiglu) && ours(b, Op::kSwiglu) && a.device() == b.device() &&
         a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes();
}


at::Tensor silu_mul_kernel(const at::Tensor& ac, const at::Tensor& bc) {
  if (ac.is_cuda()) return device_ops->silu_mul(ac, bc);
  at::Tensor y = at::empty_like(ac);
  by_dtype(
      ac,
      [&] {
        const float *a = ac.const_data_ptr<float>(), *b = bc.const_data_ptr<float>();
        float* o = y.mutable_data_ptr<float>();
        chunks(ac.numel(), [&](int64_t at, int64_t n) { silu_mul_forward(a + at, b + at, o + at, n); });
      },
      [&] {
        const uint16_t *a = h16(ac), *b = h16(bc);
        uint16_t* o = m16(y);
        chunks(ac.numel(), [&](int64_t at, int64_t n) { silu_mul_forward_bf16(a + at, b + at, o + at, n); });
      });
  return y;
}

struct SiluMul : public torch::autograd::Function<SiluMul> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    const at::Tensor ac = a.contiguous(), bc = b.contiguous();
    ctx->save_for_backward({ac, bc});
    return silu_mul_kernel(ac, bc);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &b = saved[1];
    const bool overwrite = may_overwrite_grad(g[0]);  // before gc adds a reference
    const at::Tensor gc = g[0].to(a.scalar_type()).contiguous();
    if (a.is_cuda()) {
      auto [da, db] = device_ops->silu_mul_backward(gc, a, b);
      return {da, db};
    }
    // The kernel reads each element of g before it writes da's: da may go over g.
    at::Tensor da = overwrite && gc.is_same(g[0]) && gc.sizes() == a.sizes() ? gc : at::empty_like(a);
    at::Tensor db = at::empty_like(b);
    by_dtype(
        a,
        [&] {
          const float *gi = gc.const_data_ptr<float>(), *ai = a.const_data_ptr<float>(), *bi = b.const_data_ptr<float>();
          float *oa = da.mutable_data_ptr<float>(), *ob = db.mutable_data_ptr<float>();
          chunks(a.numel(), [&](int64_t at, int64_t n) {
            silu_mul_backward(gi + at, ai + at, bi + at, oa + at, ob + at, n);
          });
        },
        [&] {
          const uint16_t *gi = h16(gc), *ai = h16(a), *bi = h16(b);
          uint16_t *oa = m16(da), *ob = m16(db);
          chunks(a.numel(), [&](int64_t at, int64_t n) {
            silu_mul_backward_bf16(gi + at, ai + at, bi + at, oa + at, ob + at, n);
          });
        });
    return {da, db};
  }
};

at::Tensor silu_mul_autograd(const at::Tensor& a, const at::Tensor& b) {
  return same_and_ours(a, b) ? SiluMul::apply(a, b) : at::silu(a) * b;
}
at::Tensor silu_mul_plain(const at::Tensor& a, const at::Tensor& b) {
  return same_and_ours(a, b) ? silu_mul_kernel(a.contiguous(), b.contiguous()) : at::silu(a) * b;
}

// ---- rotary embedding: x * cos + rotate_half(x) * sin ----------------------------------------
// rotate_half(x) = cat([-x.slice(dim, split), x.slice(dim, 0, split)], cat_dim). `split` as the graph
// wrote it: >= 0 a constant; kSplitFloor size(x, dim) // 2 (slices at half the size); kSplitChunk
// x.chunk(2, dim) (the first chunk rounds up).
constexpr int64_t kSplitFloor = -1, kSplitChunk = -2;

int64_t split_point(const at::Tensor& x, int64_t dim, int64_t split) {
  const int64_t n = x.size(dim);
  return split == kSplitFloor ? n / 2 : split == kSplitChunk ? (n + 1) / 2 : split;
}

at::Tensor rotary_aten(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t dim, int64_t split,
                       int64_t cat_dim) {
  const int64_t at = split_point(x, dim, split);
  const at::Tensor r = at::cat({-x.slice(dim, at), x.slice(dim, 0, at)}, cat_dim);
  return x * cos + r * sin;
}

// The kernel takes x of any layout with a unit-stride last dimension of even size D, split at D/2 and
// rotated along it, and cos, sin of x's dtype that broadcast to x's shape (HF's [B, 1, T, D] against
// x [B, H, T, D]).
bool rotary_ours(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t dim, int64_t split,
                 int64_t cat_dim) {
  if (!ours(x, Op::kRotary) || x.dim() < 1 || !ours(cos, Op::kRotary) || !ours(sin, Op::kRotary) ||
      cos.device() != x.device() || sin.device() != x.device() || cos.scalar_type() != x.scalar_type() ||
      sin.scalar_type() != x.scalar_type() || cos.dim() > x.dim() || sin.dim() > x.dim())
    return false;
  if (x.is_cuda() && x.dim() > DeviceFastOps::kRotaryMaxDims) return false;  // the GPU kernel's shape limit
  const int64_t last = x.dim() - 1;
  if (at::maybe_wrap_dim(dim, x.dim()) != last || at::maybe_wrap_dim(cat_dim, x.dim()) != last) return false;
  const int64_t d = x.size(last);
  if (d == 0 || d % 2 != 0 || split_point(x, dim, split) != d / 2) return false;
  for (const at::Tensor* t : {&cos, &sin})
    for (int64_t i = 1; i <= t->dim(); ++i)
      if (t->size(-i) != 1 && t->size(-i) != x.size(-i)) return false;
  return cos.size(-1) == d && sin.size(-1) == d;
}

// The element pointers the kernels take: float, or bfloat16 as its bits.
template <typename T>
const T* elems(const at::Tensor& t);
template <>
const float* elems<float>(const at::Tensor& t) { return t.const_data_ptr<float>(); }
template <>
const uint16_t* elems<uint16_t>(const at::Tensor& t) { return h16(t); }

template <typename T>
using RotaryKernel = void (*)(const T*, int64_t, const T*, int64_t, const T*, int64_t, T*, int64_t, int64_t, int64_t);

// kernel(in, cos, sin) row by row into a contiguous tensor: the dimensions before the last two are
// walked here, the rows of the second-to-last dimension by the kernel with their strides. in, cos
// and sin are views of x's shape (cos and sin expanded), each with a unit-stride last dimension.
// With `in_place` (in contiguous) the result goes over in: a row's two halves are read before they
// are written.
template <typename T>
at::Tensor rotary_rows(const at::Tensor& in, const at::Tensor& cos, const at::Tensor& sin, RotaryKernel<T> kernel,
                       bool in_place = false) {
  const int64_t nd = in.dim(), d = in.size(-1);
  at::Tensor out = in_place && in.is_contiguous()
                       ? in
                       : at::empty(in.sizes(), in.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = nd >= 2 ? in.size(-2) : 1;
  const int64_t outer = rows == 0 ? 0 : in.numel() / (rows * d);
  auto row_stride = [&](const at::Tensor& t) { return nd >= 2 ? t.stride(-2) : 0; };
  const int64_t is = row_stride(in), cs = row_stride(cos), ss = row_stride(sin);
  const T *x = elems<T>(in), *c = elems<T>(cos), *s = elems<T>(sin);
  T* y;
  if constexpr (std::is_same_v<T, float>) y = out.mutable_data_ptr<float>(); else y = m16(out);
  at::parallel_for(0, outer, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, rows * d)), [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      // The element offset of outer index o in each tensor: its multi-index over dims 0..nd-3.
      int64_t rest = o, io = 0, co = 0, so = 0;
      for (int64_t k = nd - 3; k >= 0; --k) {
        const int64_t idx = rest % in.size(k);
        rest /= in.size(k);
        io += idx * in.stride(k);
        co += idx * cos.stride(k);
        so += idx * sin.stride(k);
      }
      kernel(x + io, is, c + co, cs, s + so, ss, y + o * rows * d, d, rows, d / 2);
    }
  });
  return out;
}

at::Tensor unit_last(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// forward (kBackward false: in = x) or the gradient with respect to x (in = the output's gradient).
// `overwrite`: the result may go over in0 (a backward's gradient that may_overwrite_grad allows).
template <bool kBackward>
at::Tensor rotary_kernel(const at::Tensor& in0, const at::Tensor& cos0, const at::Tensor& sin0,
                         bool overwrite = false) {
  const at::Tensor in = unit_last(in0);
  const at::Tensor cos = unit_last(cos0).expand(in.sizes()), sin = unit_last(sin0).expand(in.sizes());
  if (in.is_cuda()) return device_ops->rotary(in, cos, sin, kBackward);
  const bool in_place = overwrite && in.is_same(in0);
  if (in.scalar_type() == at::kFloat)
    return rotary_rows<float>(in, cos, sin, kBackward ? rotary_backward : rotary_forward, in_place);
  return rotary_rows<uint16_t>(in, cos, sin, kBackward ? rotary_backward_bf16 : rotary_forward_bf16, in_place);
}

struct Rotary : public torch::autograd::Function<Rotary> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return rotary_kernel<false>(x, cos, sin);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const bool overwrite = may_overwrite_grad(g[0]) && g[0].scalar_type() == saved[0].scalar_type();
    const at::Tensor gx = g[0].scalar_type() == saved[0].scalar_type() ? g[0] : g[0].to(saved[0].scalar_type());
    return {rotary_kernel<true>(gx, saved[0], saved[1], overwrite), at::Tensor(), at::Tensor()};
  }
};

// mfsdp::rotary's calls in this process: the kernel's, and ATen's for tables that need a gradient
// or inputs the kernel does not take (describe_fast_rotary).
std::atomic<int64_t> rotary_kernel_calls{0}, rotary_table_grad_calls{0}, rotary_other_calls{0};

// The kernel when it takes the inputs and the gradient goes to x alone (rotary tables that need a
// gradient take ATen's ops).
at::Tensor rotary_autograd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t dim,
                           int64_t split, int64_t cat_dim) {
  const bool tables_grad = at::GradMode::is_enabled() && (cos.requires_grad() || sin.requires_grad());
  const bool takes = rotary_ours(x, cos, sin, dim, split, cat_dim);
  (takes ? tables_grad ? rotary_table_grad_calls : rotary_kernel_calls : rotary_other_calls)
      .fetch_add(1, std::memory_order_relaxed);
  if (tables_grad || !takes) return rotary_aten(x, cos, sin, dim, split, cat_dim);
  return Rotary::apply(x, cos, sin);
}
at::Tensor rotary_plain(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t dim, int64_t split,
                        int64_t cat_dim) {
  const bool takes = rotary_ours(x, cos, sin, dim, split, cat_dim);
  (takes ? rotary_kernel_calls : rotary_other_calls).fetch_add(1, std::memory_order_relaxed);
  if (!takes) return rotary_aten(x, cos, sin, dim, split, cat_dim);
  return rotary_kernel<false>(x, cos, sin);
}

// ---- scaled dot-product attention (model/cpu_attention.h) -------------------------------------

using OptMask = std::optional<at::Tensor>;

// A float mask in another dtype than q's (an fp32 mask of attention written out, in a bf16 run) is
// converted: SDPA takes a boolean mask or one of q's dtype.
at::Tensor sdpa_aten(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptMask& mask,
                     double dropout_p, bool causal, std::optional<double> scale, bool gqa) {
  if (mask && mask->defined() && mask->scalar_type() != at::kBool && mask->scalar_type() != q.scalar_type())
    return at::scaled_dot_product_attention(q, k, v, mask->to(q.scalar_type()), dropout_p, causal, scale, gqa);
  return at::scaled_dot_product_attention(q, k, v, mask, dropout_p, causal, scale, gqa);
}

double sdpa_scale(const at::Tensor& q, std::optional<double> scale) {
  return scale ? *scale : 1.0 / std::sqrt(double(q.size(-1)));
}

// Calls of mfsdp::sdpa so far: through the kernel (with an explicit causal mask among them), and
// through ATen's SDPA (describe_fast_attention); with dropout drawn by mfsdp.
std::atomic<int64_t> sdpa_kernel_calls{0}, sdpa_mask_calls{0}, sdpa_aten_calls{0}, sdpa_dropout_calls{0},
    sdpa_gqa_calls{0};

// The dropout mask of a call the kernel takes, [B, H, Tq, Tk] bytes drawn as ATen's math attention
// draws its noise over the probabilities (one bernoulli_(1 - p) over that contiguous tensor, from
// the default generator): so a run's masks are those PyTorch's own attention would draw. mfsdp's
// draws where they replicate ATen's (fast_dropout.h), else ATen's bernoulli_ on the bytes
// themselves: both of ATen's kernels (per element, and MKL's on Intel CPUs) draw the same numbers
// whatever the tensor's dtype. Undefined when there is no dropout (p below 1: sdpa_takes).
at::Tensor sdpa_dropout_mask(const at::Tensor& q, const at::Tensor& k, double p) {
  if (!(p > 0.0)) return {};
  at::Tensor keep = at::empty({q.size(0), q.size(1), q.size(2), k.size(2)}, q.options().dtype(at::kByte));
  if (!draw_bernoulli_keep(1.0 - p, keep.mutable_data_ptr<uint8_t>(), keep.numel())) keep.bernoulli_(1.0 - p);
  sdpa_dropout_calls.fetch_add(1, std::memory_order_relaxed);
  return keep;
}

// The kernels' view of a call's mask: nullptr without dropout, else `out` filled in. ATen's math
// attention computes a bf16 call in fp32, so its noise is fp32's 1 / (1 - p) either way.
const AttentionDropout* attention_dropout(const at::Tensor& keep, double p, AttentionDropout& out) {
  if (!keep.defined()) return nullptr;
  out = AttentionDropout{keep.const_data_ptr<uint8_t>(), dropout_scale(at::kFloat, p)};
  return &out;
}

// Whether mfsdp's kernel takes the call, and whether as causal: no mask, or a mask that is exactly
// the causal one (Hugging Face models pass theirs explicitly) with is_causal false (a mask with
// is_causal set goes to ATen, which decides what the pair means); dropout below 1.
bool sdpa_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptMask& mask, double dropout_p,
                bool gqa, bool& causal) {
  const bool masked = mask && mask->defined();
  // The cheap checks (dtype, device, shapes, key count) first: the mask's element-by-element
  // check runs only for a call the kernel would otherwise take.
  bool takes = dropout_p < 1.0 && cpu_attention_takes(q, k, v, causal || masked, gqa);
  if (takes && masked) {
    takes = !causal && is_causal_mask(*mask, q.size(-2));
    causal = true;  // what the mask computes, when taken (otherwise ATen's call gets is_causal as given)
  }
  (takes ? sdpa_kernel_calls : sdpa_aten_calls).fetch_add(1, std::memory_order_relaxed);
  if (takes && masked) sdpa_mask_calls.fetch_add(1, std::memory_order_relaxed);
  if (takes && k.size(1) != q.size(1)) sdpa_gqa_calls.fetch_add(1, std::memory_order_relaxed);
  return takes;
}

// Up to kCpuAttentionMaxKeys keys the probabilities are kept for the backward; beyond (causal only)
// one log-sum-exp per query row, and the backward recomputes them. With dropout the mask (bytes) is
// kept too.
struct Sdpa : public torch::autograd::Function<Sdpa> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, double scale, std::optional<at::Tensor> keep_mask, double dropout_p) {
    const bool keep = cpu_attention_keeps_probs(k.size(2));
    AttentionDropout drop;
    const AttentionDropout* d = attention_dropout(keep_mask.value_or(at::Tensor()), dropout_p, drop);
    at::Tensor kept;  // the probabilities, or the log-sum-exp of each row
    at::Tensor o = keep ? cpu_attention_forward(q, k, v, causal, scale, &kept, d)
                        : cpu_attention_forward_lse(q, k, v, causal, scale, &kept, d);
    ctx->save_for_backward({q, k, v, o, kept});
    if (keep_mask) ctx->saved_data["keep_mask"] = *keep_mask;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["keep"] = keep;
    ctx->saved_data["dropout_p"] = dropout_p;
    return o;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    const at::Tensor keep_mask = ctx->saved_data.count("keep_mask") ? ctx->saved_data["keep_mask"].toTensor() : at::Tensor();
    AttentionDropout drop;
    const AttentionDropout* d = attention_dropout(keep_mask, ctx->saved_data["dropout_p"].toDouble(), drop);
    const at::Tensor go = g[0].to(saved[0].scalar_type());  // the kernels' dtype: fp32, or bf16 products
    auto [dq, dk, dv] =
        ctx->saved_data["keep"].toBool()
            ? cpu_attention_backward(go, saved[0], saved[1], saved[2], saved[3], saved[4], causal, scale, d)
            : cpu_attention_backward_lse(go, saved[0], saved[1], saved[2], saved[3], saved[4], causal, scale, d);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Without a gradient to come: nothing is kept.
at::Tensor sdpa_no_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                        const at::Tensor& keep_mask, double dropout_p) {
  AttentionDropout drop;
  const AttentionDropout* d = attention_dropout(keep_mask, dropout_p, drop);
  return cpu_attention_keeps_probs(k.size(2)) ? cpu_attention_forward(q, k, v, causal, scale, nullptr, d)
                                              : cpu_attention_forward_lse(q, k, v, causal, scale, nullptr, d);
}

// The kernels, keeping the probabilities or log-sum-exps only when a gradient will be asked for.
at::Tensor sdpa_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                      const at::Tensor& keep_mask, double dropout_p) {
  const bool grad = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (!grad) return sdpa_no_grad(q, k, v, causal, scale, keep_mask, dropout_p);
  return Sdpa::apply(q, k, v, causal, scale,
                     keep_mask.defined() ? std::optional<at::Tensor>(keep_mask) : std::nullopt, dropout_p);
}

// mfsdp's kernels where they take the inputs (fp32 or bf16 on the CPU; not causal: short sequences),
// ATen's attention elsewhere. bf16 inputs run the kernels in bf16 where the CPU multiplies bf16 in
// hardware (cpu_attention_bf16_products): bf16 products accumulated in fp32, the probabilities and
// dS rounded to bf16 for theirs, as ATen's bf16 flash attention does, at about twice the fp32
// products' rate (bench/results_kernels.md). Elsewhere, or with MFSDP_ATTENTION_BF16=fp32, they are
// converted to fp32 (exactly), the kernels compute in fp32 and the output is rounded to bf16 once
// (autograd converts the gradients on the way back): the probabilities stay fp32, nearer the exact
// result than ATen's bf16 (tests/test_kernels.cpp). Why not ATen's: its CPU flash attention in
// bf16 was slower than mfsdp's fp32 kernels on this project's AMD EPYC.
bool sdpa_in_bf16(const at::Tensor& q) { return q.scalar_type() == at::kBFloat16 && cpu_attention_bf16_products(); }

at::Tensor sdpa_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptMask& mask,
                         double dropout_p, bool is_causal, std::optional<double> scale, bool gqa) {
  bool causal = is_causal;
  if (!sdpa_takes(q, k, v, mask, dropout_p, gqa, causal))
    return sdpa_aten(q, k, v, mask, dropout_p, is_causal, scale, gqa);
  const at::Tensor keep = sdpa_dropout_mask(q, k, dropout_p);
  const double s = sdpa_scale(q, scale);
  if (q.scalar_type() == at::kFloat || sdpa_in_bf16(q)) return sdpa_kernel(q, k, v, causal, s, keep, dropout_p);
  return sdpa_kernel(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), causal, s, keep, dropout_p)
      .to(q.scalar_type());
}
at::Tensor sdpa_plain(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptMask& mask,
                      double dropout_p, bool is_causal, std::optional<double> scale, bool gqa) {
  bool causal = is_causal;
  if (!sdpa_takes(q, k, v, mask, dropout_p, gqa, causal))
    return sdpa_aten(q, k, v, mask, dropout_p, is_causal, scale, gqa);
  const at::Tensor keep = sdpa_dropout_mask(q, k, dropout_p);
  const double s = sdpa_scale(q, scale);
  if (q.scalar_type() == at::kFloat || sdpa_in_bf16(q)) return sdpa_no_grad(q, k, v, causal, s, keep, dropout_p);
  return sdpa_no_grad(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), causal, s, keep, dropout_p)
      .to(q.scalar_type());
}

// aten::scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale[, enable_gqa])
// with a constant enable_gqa (or none) becomes mfsdp::sdpa(q, k, v, attn_mask, dropout_p,
// is_causal, scale, enable_gqa); whether a mask is the causal one, and the dropout probability (a
// constant, or one that follows the module's training flag: nanoGPT's `p if self.training else 0`,
// graph_rewrite.h's p * float(training)), are known only at run time. Keys and values that are
// both repeated by the same count (HF's or torchtitan's repeat_kv, or repeat_interleave over the
// heads: unrepeated) are taken before the repeat, with enable_gqa, which computes the same attention (ATen's
// enable_gqa repeats the heads as both do: query head h reads key/value head h / n): mfsdp's
// kernel then reads each key/value head in place for its query heads, and the repeat's copy
// forward and its sum backward go.
bool replace_sdpa(torch::jit::Node* node) {
  const size_t n = node->inputs().size();
  if ((n != 7 && n != 8) || node->outputs().size() != 1) return false;
  if (!node->input(4)->type()->isSubtypeOf(*c10::FloatType::get())) return false;
  torch::jit::Graph& g = *node->owningGraph();
  bool gqa = false;
  if (n == 8) {
    auto c = torch::jit::toIValue(node->input(7));
    if (!c || !c->isBool()) return false;
    gqa = c->toBool();
  }
  torch::jit::Value *k = node->input(1), *v = node->input(2);
  torch::jit::Value* flag = nullptr;
  {
    torch::jit::WithInsertPoint guard(node);
    if (!gqa) gqa = take_unrepeated(g, k, v);
    flag = g.insertConstant(gqa);
  }
  torch::jit::Value *k_rep = node->input(1), *v_rep = node->input(2);
  const bool ok = replace_node_by(node, "mfsdp::sdpa",
                                  {node->input(0), k, v, node->input(3), node->input(4), node->input(5), node->input(6), flag});
  // The repeats, when nothing else reads them.
  if (ok && k != k_rep) {
    drop_dead(k_rep->node());
    if (v_rep != k_rep) drop_dead(v_rep->node());
  }
  return ok;
}

// silu(a) for a value produced by aten::silu(a), torch.nn.functional.silu(a, inplace=False) (scripted),
// or a call of a module whose forward returns aten::silu of its input (transformers' SiLUActivation,
// traced); nullptr otherwise.
torch::jit::Value* silu_input(torch::jit::Value* v) {
  torch::jit::Node* n = v->node();
  if (v->uses().size() != 1) return nullptr;
  if (n->kind() == c10::aten::silu && n->inputs().size() == 1) return n->input(0);
  std::string name;
  auto g = (n->kind() == c10::prim::CallFunction || n->kind() == c10::prim::CallMethod) ? callee_graph(n, &name)
                                                                                          : nullptr;
  if (!g || g->outputs().size() != 1) return nullptr;
  if (n->kind() == c10::prim::CallFunction) {
    auto inplace = n->inputs().size() == 3 ? torch::jit::toIValue(n->input(2)) : std::nullopt;
    const bool not_inplace = inplace && inplace->isBool() && !inplace->toBool();
    const bool silu = name == "torch.nn.functional.silu" || name == "__torch__.torch.nn.functional.silu";
    return silu && not_inplace ? n->input(1) : nullptr;
  }
  torch::jit::Node* ret = g->outputs()[0]->node();
  if (n->inputs().size() != 2 || g->inputs().size() != 2 || ret->kind() != c10::aten::silu ||
      ret->input(0) != g->inputs()[1])
    return nullptr;
  return n->input(1);
}

// silu(a) * b, either order, becomes mfsdp::silu_mul(a, b).
bool replace_silu_mul(torch::jit::Node* mul) {
  if (mul->inputs().size() != 2 || mul->outputs().size() != 1) return false;
  for (int i : {0, 1}) {
    torch::jit::Value* a = silu_input(mul->input(i));
    if (!a || !is_tensor_value(a) || !is_tensor_value(mul->input(1 - i))) continue;
    torch::jit::Node* act = mul->input(i)->node();
    torch::jit::Graph& g = *mul->owningGraph();
    torch::jit::WithInsertPoint guard(mul);
    torch::jit::Value* y = g.insert(c10::Symbol::fromQualString("mfsdp::silu_mul"), {a, mul->input(1 - i)});
    y->setType(mul->output()->type());
    mul->output()->replaceAllUsesWith(y);
    mul->destroy();
    destroy_and_drop(act);
    return true;
  }
  return false;
}

struct Rotation {
  torch::jit::Value* x;
  int64_t dim, split, cat_dim;
};

// Whether v is size(x, dim) // 2: traced (aten::Int(floor_divide(NumToTensor(size(x, dim)), 2))) or
// scripted (floordiv(size(x, dim), 2), or of size(x)[dim]).
bool is_half_size(torch::jit::Value* v, torch::jit::Value* x, int64_t dim) {
  torch::jit::Node* n = v->node();
  if (n->kind() == c10::aten::Int) n = n->input(0)->node();
  if ((n->kind() != c10::aten::floor_divide && n->kind() != c10::aten::floordiv) || n->inputs().size() != 2 ||
      constant_number(n->input(1)) != 2.0)
    return false;
  const auto sz = size_of(n->input(0));
  return sz && sz->first == x && sz->second == dim;
}

// rotate_half(x) as `r` computes it: cat([neg(x2), x1], cat_dim) where x1, x2 are x.chunk(2, dim) or
// the slices x[..., :e] and x[..., e:] of one split point e (a constant, or size // 2).
std::optional<Rotation> rotation_of(torch::jit::Value* r) {
  using torch::jit::Node;
  Node* cat = r->node();
  if (cat->kind() != c10::aten::cat || cat->inputs().size() != 2) return std::nullopt;
  auto cat_dim = constant_int(cat->input(1));
  Node* list = cat->input(0)->node();
  if (!cat_dim || list->kind() != c10::prim::ListConstruct || list->inputs().size() != 2 ||
      cat->input(0)->uses().size() != 1)
    return std::nullopt;
  Node* neg = list->input(0)->node();
  if (neg->kind() != c10::aten::neg || neg->inputs().size() != 1) return std::nullopt;
  torch::jit::Value *p1 = list->input(1), *p2 = neg->input(0);
  Node *n1 = p1->node(), *n2 = p2->node();
  if (n1 == n2 && n1->kind() == c10::prim::ListUnpack && n1->outputs().size() == 2 && p1 == n1->output(0) &&
      p2 == n1->output(1)) {
    Node* chunk = n1->input(0)->node();
    if (chunk->kind() != c10::aten::chunk || chunk->inputs().size() != 3 || constant_int(chunk->input(1)) != 2)
      return std::nullopt;
    auto dim = constant_int(chunk->input(2));
    if (!dim) return std::nullopt;
    return Rotation{chunk->input(0), *dim, kSplitChunk, *cat_dim};
  }
  if (n1->kind() != c10::aten::slice || n2->kind() != c10::aten::slice || n1->inputs().size() != 5 ||
      n2->inputs().size() != 5 || n1->input(0) != n2->input(0))
    return std::nullopt;
  auto d1 = constant_int(n1->input(1)), d2 = constant_int(n2->input(1));
  auto end2 = torch::jit::toIValue(n2->input(3));
  const bool to_end = end2 && (end2->isNone() || (end2->isInt() && end2->toInt() >= (int64_t(1) << 62)));
  auto start1 = torch::jit::toIValue(n1->input(2));
  const bool from_0 = start1 && (start1->isNone() || (start1->isInt() && start1->toInt() == 0));
  if (!d1 || d1 != d2 || !from_0 || constant_int(n1->input(4)) != 1 ||
      constant_int(n2->input(4)) != 1 || !to_end)
    return std::nullopt;
  torch::jit::Value* x = n1->input(0);
  auto e1 = constant_int(n1->input(3)), e2 = constant_int(n2->input(2));
  if (e1 && e2 && *e1 == *e2 && *e1 >= 0) return Rotation{x, *d1, *e1, *cat_dim};
  if (is_half_size(n1->input(3), x, *d1) && is_half_size(n2->input(2), x, *d1))
    return Rotation{x, *d1, kSplitFloor, *cat_dim};
  return std::nullopt;
}

// rotate_half(x) in the graph (the cat itself) or called (a function whose graph returns it of its
// argument: mfsdp's scripted rotate_half).
std::optional<Rotation> rotate_half_of(torch::jit::Value* r) {
  if (r->uses().size() != 1) return std::nullopt;
  if (r->node()->kind() == c10::aten::cat) return rotation_of(r);
  if (r->node()->kind() != c10::prim::CallFunction || r->node()->inputs().size() != 2) return std::nullopt;
  auto g = callee_graph(r->node());
  if (!g || g->inputs().size() != 1 || g->outputs().size() != 1) return std::nullopt;
  auto rot = rotation_of(g->outputs()[0]);
  if (!rot || rot->x != g->inputs()[0]) return std::nullopt;
  rot->x = r->node()->input(1);
  return rot;
}

// The factors of a mul with one use: {first, second}.
std::optional<std::pair<torch::jit::Value*, torch::jit::Value*>> mul_of(torch::jit::Value* v) {
  torch::jit::Node* n = sole_producer(v, c10::aten::mul);
  if (!n || n->inputs().size() != 2) return std::nullopt;
  return std::make_pair(n->input(0), n->input(1));
}

// x * cos + rotate_half(x) * sin (the products in either order, the sum in either order) becomes
// mfsdp::rotary(x, cos, sin, dim, split, cat_dim).
bool replace_rotary(torch::jit::Node* add) {
  using torch::jit::Value;
  if (add->inputs().size() != 3 || constant_number(add->input(2)) != 1.0 || add->outputs().size() != 1) return false;
  for (int i : {0, 1}) {
    auto p = mul_of(add->input(i)), q = mul_of(add->input(1 - i));
    if (!p || !q) continue;
    for (int j : {0, 1}) {
      Value* r = j == 0 ? q->first : q->second;
      Value* sin = j == 0 ? q->second : q->first;
      auto rot = rotate_half_of(r);
      if (!rot) continue;
      Value* cos = p->first == rot->x ? p->second : p->second == rot->x ? p->first : nullptr;
      if (!cos || !is_tensor_value(rot->x) || !is_tensor_value(cos) || !is_tensor_value(sin)) continue;
      torch::jit::Graph& g = *add->owningGraph();
      torch::jit::WithInsertPoint guard(add);
      Value* y = g.insert(c10::Symbol::fromQualString("mfsdp::rotary"),
                          {rot->x, cos, sin, g.insertConstant(rot->dim), g.insertConstant(rot->split),
                           g.insertConstant(rot->cat_dim)});
      y->setType(add->output()->type());
      add->output()->replaceAllUsesWith(y);
      torch::jit::Node *pn = add->input(i)->node(), *qn = add->input(1 - i)->node(), *rn = r->node();
      add->destroy();
      pn->destroy();
      qn->destroy();
      destroy_and_drop(rn);
      return true;
    }
  }
  return false;
}

}  // namespace

at::Tensor gelu_tanh(const at::Tensor& x) {
  if (!cpu_ours(x)) return at::gelu(x, "tanh");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  by_dtype(
      xc,
      [&] {
        const float* in = xc.const_data_ptr<float>();
        float* out = y.mutable_data_ptr<float>();
        chunks(xc.numel(), [&](int64_t at, int64_t n) { gelu_tanh_forward(in + at, out + at, n); });
      },
      [&] {
        const uint16_t* in = h16(xc);
        uint16_t* out = m16(y);
        chunks(xc.numel(), [&](int64_t at, int64_t n) { gelu_tanh_forward_bf16(in + at, out + at, n); });
      });
  return y;
}

bool may_overwrite_grad(const at::Tensor& g) {
  if (at::GradMode::is_enabled() || !g.defined() || !g.has_storage() || !g.is_contiguous() || !g.device().is_cpu())
    return false;
  const int64_t owners = g.is_view() ? 2 : 1;
  return int64_t(g.storage().use_count()) <= owners && int64_t(g.use_count()) <= 2;
}

at::Tensor gelu_tanh_backward(const at::Tensor& g, const at::Tensor& x, bool overwrite) {
  if (!cpu_ours(x) || g.scalar_type() != x.scalar_type() || g.sizes() != x.sizes())
    return at::gelu_backward(g, x, "tanh");
  const at::Tensor xc = x.contiguous(), gc = g.contiguous();
  // Each element of g is read before dx's is written: the kernel may write over g.
  at::Tensor dx = overwrite && gc.is_same(g) ? gc : at::empty_like(xc);
  by_dtype(
      xc,
      [&] {
        const float *gi = gc.const_data_ptr<float>(), *xi = xc.const_data_ptr<float>();
        float* out = dx.mutable_data_ptr<float>();
        chunks(xc.numel(), [&](int64_t at, int64_t n) { mfsdp::gelu_tanh_backward(gi + at, xi + at, out + at, n); });
      },
      [&] {
        const uint16_t *gi = h16(gc), *xi = h16(xc);
        uint16_t* out = m16(dx);
        chunks(xc.numel(), [&](int64_t at, int64_t n) { gelu_tanh_backward_bf16(gi + at, xi + at, out + at, n); });
      });
  return dx;
}

namespace {

// ---- the GPU kernels' check -------------------------------------------------------------------

at::Tensor h_to(const at::Tensor& h, c10::Device device, at::ScalarType dtype, bool grad) {
  return h.to(device, dtype).detach().requires_grad_(grad);
}

// max |a - b| / max(1, max |b|), in fp32.
double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor af = a.to(at::kFloat), bf = b.to(at::kFloat);
  const double scale = std::max(1.0, bf.abs().max().item<double>());
  return (af - bf).abs().max().item<double>() / scale;
}

// The largest difference between `ours` and `aten` over the output and the gradients of the first
// `with_grad` inputs, in fp32 and in bf16, for inputs made by `make` (CPU random numbers of a
// generator of its own, so that the run's random streams are untouched) on `device`.
template <typename Make, typename Ours, typename Aten>
std::pair<double, double> compare_on(c10::Device device, size_t with_grad, Make make, Ours ours_fn, Aten aten_fn) {
  std::pair<double, double> worst{0, 0};
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    at::Generator gen = at::detail::createCPUGenerator(20261206);
    auto randn = [&](at::IntArrayRef sizes) { return at::randn(sizes, gen, at::TensorOptions(at::kFloat)); };
    const std::vector<at::Tensor> host = make(randn);
    std::vector<at::Tensor> ins[2];
    at::Tensor outs[2];
    variable_list grads[2];
    for (int k = 0; k < 2; ++k) {
      for (size_t i = 0; i < host.size(); ++i) ins[k].push_back(h_to(host[i], device, dtype, i < with_grad));
      outs[k] = k == 0 ? ours_fn(ins[k]) : aten_fn(ins[k]);
    }
    const at::Tensor g = randn(outs[1].sizes()).to(device, dtype);
    for (int k = 0; k < 2; ++k)
      grads[k] = torch::autograd::grad({outs[k]}, variable_list(ins[k].begin(), ins[k].begin() + with_grad), {g});
    double d = rel_diff(outs[0], outs[1]);
    for (size_t i = 0; i < grads[0].size(); ++i) d = std::max(d, rel_diff(grads[0][i], grads[1][i]));
    (dtype == at::kFloat ? worst.first : worst.second) = d;
  }
  return worst;
}

}  // namespace

DeviceKernelCheck verify_device_fast_ops(c10::Device device) {
  DeviceKernelCheck c;
  const at::AutoGradMode grad_on(true);
  // On the CPU the same comparison runs the CPU kernels (what tests/test_kernels.cpp checks of this
  // function), and leaves the GPU's switches alone.
  const bool gpu = device.is_cuda();
  auto check = [&](Op op, const char* name, bool available, size_t with_grad, auto make, auto ours_fn,
                   auto aten_fn) {
    if (gpu && !available) {
      c.report += fmt::format("; {} kept ATen's ({})", name,
                              op == Op::kRms ? "this LibTorch has no fused RMSNorm"
                                             : "the CUDA plugin was built without nvcc");
      return false;
    }
    if (gpu) gpu_on[int(op)] = true;
    std::pair<double, double> d;
    try {
      d = compare_on(device, with_grad, make, ours_fn, aten_fn);
    } catch (const std::exception& e) {
      if (gpu) gpu_on[int(op)] = false;
      const std::string what = e.what();
      c.report += fmt::format("; {} kept ATen's (its kernel failed: {})", name, what.substr(0, what.find('\n')));
      return false;
    }
    // fp32: the order of a row's sum and expf against ATen's; bf16: one rounding against ATen's two.
    const bool agree = d.first <= 1e-5 && d.second <= 2e-2;
    if (gpu) gpu_on[int(op)] = agree;
    if (!agree)
      c.report += fmt::format("; {} kept ATen's (differs from it by {:.2e} in fp32, {:.2e} in bf16)", name, d.first,
                              d.second);
    return agree;
  };
  using Tensors = std::vector<at::Tensor>;
  c.rms = check(
      Op::kRms, "RMSNorm scaling", MFSDP_FUSED_RMS_NORM != 0, 1,
      [](auto randn) { return Tensors{randn({3, 5, 96}) * 2 + 0.5}; },
      [](const Tensors& t) { return rms_scale_autograd(t[0], 1e-6); },
      [](const Tensors& t) { return rms_scale_aten(t[0], 1e-6); });
  c.swiglu = check(
      Op::kSwiglu, "SwiGLU gate", device_ops != nullptr, 2,
      [](auto randn) { return Tensors{randn({4, 7, 33}) * 3, randn({4, 7, 33})}; },
      [](const Tensors& t) { return silu_mul_autograd(t[0], t[1]); },
      [](const Tensors& t) { return at::silu(t[0]) * t[1]; });
  // x as HF's attention makes it (a transposed view of [B, T, H, D]), cos and sin [B, 1, T, D].
  c.rotary = check(
      Op::kRotary, "rotary embedding", device_ops != nullptr, 1,
      [](auto randn) { return Tensors{randn({2, 9, 3, 16}), randn({2, 1, 9, 16}), randn({2, 1, 9, 16})}; },
      [](const Tensors& t) { return rotary_autograd(t[0].transpose(1, 2), t[1], t[2], -1, kSplitFloor, -1); },
      [](const Tensors& t) { return rotary_aten(t[0].transpose(1, 2), t[1], t[2], -1, kSplitFloor, -1); });
  return c;
}

void set_device_fast_ops(const DeviceFastOps* ops) { device_ops = ops; }

int use_fast_gelu(torch::jit::Module& root) {
  return rewrite_nodes(root, {c10::aten::gelu, c10::aten::tanh}, [](torch::jit::Node* node) {
    return node->kind() == c10::aten::gelu ? replace_gelu(node) : replace_spelled_gelu(node);
  });
}

int use_fast_rms_norm(torch::jit::Module& root) {
  const int n = rewrite_nodes(root, {c10::aten::rsqrt}, replace_rms);
  // Then the weight's multiply into the same pass where one follows (counted above already).
  if (n > 0) rewrite_nodes(root, {c10::Symbol::fromQualString("mfsdp::rms_scale")}, replace_rms_weight);
  return n;
}

int use_fast_rms_norm_op(torch::jit::Module& root) {
  return rewrite_nodes(root, {c10::Symbol::fromQualString("aten::rms_norm"), c10::prim::CallFunction},
                       replace_rms_norm);
}

at::Tensor rms_scale(const at::Tensor& x, double eps) { return rms_scale_autograd(x, eps); }
at::Tensor rms_norm_weight(const at::Tensor& x, const at::Tensor& w, double eps, std::optional<at::ScalarType> dtype) {
  return rms_norm_weight_autograd(x, w, eps, dtype);
}

int use_fast_swiglu(torch::jit::Module& root) { return rewrite_nodes(root, {c10::aten::mul}, replace_silu_mul); }

int use_fast_rotary(torch::jit::Module& root) { return rewrite_nodes(root, {c10::aten::add}, replace_rotary); }

std::string describe_fast_rotary() {
  const int64_t ours = rotary_kernel_calls.load(), grad = rotary_table_grad_calls.load();
  const int64_t other = rotary_other_calls.load();
  if (ours + grad + other == 0) return "";
  std::string why;
  if (grad) why += fmt::format("; {} ATen's: their cos/sin need a gradient", grad);
  if (other) why += fmt::format("; {} ATen's: a shape, layout or dtype the kernel does not take", other);
  return fmt::format("mfsdp's rotary embedding: {} of {} calls ran its kernel{}", ours, ours + grad + other, why);
}

std::string describe_fast_attention() {
  const int64_t ours = sdpa_kernel_calls.load(), masked = sdpa_mask_calls.load(), aten = sdpa_aten_calls.load();
  const int64_t dropped = sdpa_dropout_calls.load(), grouped = sdpa_gqa_calls.load();
  return fmt::format("mfsdp's CPU attention: {} of {} calls ran its kernel ({} of them with an explicit causal "
                     "mask, {} with dropout, {} with fewer key/value heads than query heads){}",
                     ours, ours + aten, masked, dropped, grouped,
                     aten ? "; the others ATen's SDPA (not fp32 nor bf16, more than 256 keys and not causal, k/v "
                            "with fewer heads without enable_gqa, or a mask other than the causal one)"
                          : "");
}

int use_fast_attention(torch::jit::Module& root) {
  // Into called functions too: nn.MultiheadAttention (nn.TransformerEncoderLayer's) calls SDPA
  // inside torch.nn.functional's multi_head_attention_forward, a function of the saved file.
  return rewrite_nodes(root, {c10::aten::scaled_dot_product_attention}, replace_sdpa, /*into_functions=*/true);
}
at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                double dropout_p, bool causal, std::optional<double> scale, bool gqa) {
  return sdpa_autograd(q, k, v, mask, dropout_p, causal, scale, gqa);
}

at::Tensor silu_mul(const at::Tensor& a, const at::Tensor& b) { return silu_mul_autograd(a, b); }
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t dim, int64_t split,
                  int64_t cat_dim) {
  return rotary_autograd(x, cos, sin, dim, split, cat_dim);
}

}  // namespace mfsdp

TORCH_LIBRARY_FRAGMENT(mfsdp, m) {
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("rms_scale(Tensor x, float eps) -> Tensor");
  m.def("rms_norm(Tensor x, int[] normalized_shape, Tensor? weight, float? eps) -> Tensor");
  m.def("rms_norm_weight(Tensor x, Tensor w, float eps, ScalarType? dtype) -> Tensor");
  m.def("silu_mul(Tensor a, Tensor b) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int dim, int split, int cat_dim) -> Tensor");
  m.def("sdpa(Tensor q, Tensor k, Tensor v, Tensor? mask, float dropout_p, bool is_causal, float? scale, "
        "bool enable_gqa=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(mfsdp, Autograd, m) {
  m.impl("gelu_tanh", mfsdp::gelu_tanh_autograd);
  m.impl("rms_scale", mfsdp::rms_scale_autograd);
  m.impl("rms_norm", mfsdp::rms_norm_through<mfsdp::rms_scale_autograd, mfsdp::rms_norm_weight_autograd>);
  m.impl("rms_norm_weight", mfsdp::rms_norm_weight_autograd);
  m.impl("silu_mul", mfsdp::silu_mul_autograd);
  m.impl("rotary", mfsdp::rotary_autograd);
  m.impl("sdpa", mfsdp::sdpa_autograd);
}

TORCH_LIBRARY_IMPL(mfsdp, CompositeExplicitAutograd, m) {
  m.impl("gelu_tanh", mfsdp::gelu_tanh);
  m.impl("rms_scale", mfsdp::rms_scale_plain);
  m.impl("rms_norm", mfsdp::rms_norm_through<mfsdp::rms_scale_plain, mfsdp::rms_norm_weight_plain>);
  m.impl("rms_norm_weight", mfsdp::rms_norm_weight_plain);
  m.impl("silu_mul", mfsdp::silu_mul_plain);
  m.impl("rotary", mfsdp::rotary_plain);
  m.impl("sdpa", mfsdp::sdpa_plain);
}
