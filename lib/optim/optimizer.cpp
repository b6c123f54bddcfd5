#include "optim/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>  // at::parallel_for: the fused passes on ATen's threads

#include <algorithm>
#include <cmath>

#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {
namespace {

// Updates run in fp32: on the weight itself when it is fp32, else on an fp32 copy rounded back.
template <class F>
void update_fp32(at::Tensor& weight, F&& body) {
  if (weight.scalar_type() == at::kFloat) {
    body(weight);
  } else {
    at::Tensor w32 = weight.to(at::kFloat);
    body(w32);
    weight.copy_(w32);
  }
}

// One pass over a contiguous fp32 CPU slot instead of ATen's op-by-op sequence (mul_, add_, mul_,
// addcmul_, sqrt, div, add_, addcdiv_: eight passes over memory and two temporaries). Each element
// is updated with PyTorch's formula, in fp32, the same arithmetic whatever the slot's length or
// where a shard boundary cuts it: the loop has no reduction and is built with -ffp-contract=off
// (lib/CMakeLists.txt: no FMAs), so vectorised and scalar tails round alike, and a layout change
// (N ranks against one) moves no bits. Threads: ATen's pool, blocks of 32k elements.
// Scalars come in as doubles and are rounded to fp32 once, as ATen's ops round theirs (the factor
// 1 - lr * wd and 1 - beta are formed in double, as torch.optim forms them in Python).
// `gs` is the clip coefficient folded into the loop: g x gs is the product clip_grad_norm_'s mul_
// would have stored (one fp32 rounding), so folding it changes no bit and saves a pass.
// The loops over one block, in functions of their own: their pointers are __restrict parameters,
// which the vectoriser trusts. (Captured by reference into at::parallel_for's lambda, which with
// OpenMP is also called from the outlined parallel region, the locals' __restrict was lost and
// GCC left the loops scalar: Adam's pass took twice as long.)
struct AdamScalars {
  float b1, b2, eps, wd, step_size, bc2_sqrt, decay, one_b1, one_b2, gs;
};
void adam_block(float* __restrict W, const float* __restrict G, float* __restrict M, float* __restrict V, int64_t n,
                bool decoupled, const AdamScalars c) {
  if (decoupled) {
    for (int64_t i = 0; i < n; ++i) {
      const float wi = c.wd != 0 ? W[i] * c.decay : W[i], gi = G[i] * c.gs;
      const float mi = M[i] * c.b1 + gi * c.one_b1, vi = V[i] * c.b2 + c.one_b2 * gi * gi;
      M[i] = mi;
      V[i] = vi;
      W[i] = wi - c.step_size * (mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float gi = c.wd != 0 ? G[i] * c.gs + W[i] * c.wd : G[i] * c.gs;
      const float mi = M[i] * c.b1 + gi * c.one_b1, vi = V[i] * c.b2 + c.one_b2 * gi * gi;
      M[i] = mi;
      V[i] = vi;
      W[i] = W[i] - c.step_size * (mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps));
    }
  }
}

void adam_fused_cpu(at::Tensor& w, const at::Tensor& g, at::Tensor& m, at::Tensor& v, double beta1, double beta2,
                    double eps_d, double wd_d, bool decoupled, double lr, double step_size_d, double bc2_sqrt_d, float gs) {
  float* W = w.data_ptr<float>();
  const float* G = g.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  const AdamScalars c{float(beta1),        float(beta2),         float(eps_d),          float(wd_d),
                      float(step_size_d),  float(bc2_sqrt_d),    float(1.0 - lr * wd_d), float(1.0 - beta1),
                      float(1.0 - beta2),  gs};
  at::parallel_for(0, w.numel(), 1 << 15, [&](int64_t lo, int64_t hi) {
    adam_block(W + lo, G + lo, M + lo, V + lo, hi - lo, decoupled, c);
  });
}

void sgd_block(float* __restrict W, const float* __restrict G, float* __restrict B, int64_t n, float lr, float wd,
               float momentum, bool nesterov, float gs) {
  for (int64_t i = 0; i < n; ++i) {
    float gi = wd != 0 ? G[i] * gs + W[i] * wd : G[i] * gs;
    if (B) {
      const float bi = B[i] * momentum + gi;
      B[i] = bi;
      gi = nesterov ? gi + bi * momentum : bi;
    }
    W[i] = W[i] - lr * gi;
  }
}

void sgd_fused_cpu(at::Tensor& w, const at::Tensor& g, at::Tensor* buf, float lr, float wd, float momentum, bool nesterov,
                   float gs) {
  float* W = w.data_ptr<float>();
  const float* G = g.data_ptr<float>();
  float* B = buf ? buf->data_ptr<float>() : nullptr;
  at::parallel_for(0, w.numel(), 1 << 15, [&](int64_t lo, int64_t hi) {
    sgd_block(W + lo, G + lo, B ? B + lo : nullptr, hi - lo, lr, wd, momentum, nesterov, gs);
  });
}

// The fused paths take a contiguous fp32 weight with a contiguous gradient beside it. A bf16/fp16
// gradient (grad_reduce_in_fp32 off) is read through an fp32 copy (`as_fp32`), as the op-by-op
// path reads it; bf16 main weights (no preserve_fp32_weights) go op by op.
bool fused_takes(const at::Tensor& w, const at::Tensor& g) {
  return w.scalar_type() == at::kFloat && w.is_contiguous() && g.is_contiguous() && g.is_floating_point() &&
         w.device() == g.device();
}
at::Tensor as_fp32(const at::Tensor& g) { return g.scalar_type() == at::kFloat ? g : g.to(at::kFloat); }

UpdatePath path_for(UpdatePath forced, const OptimSlot& s) {
  if (!fused_takes(s.weight, s.grad)) return UpdatePath::kOpByOp;
  if (forced != UpdatePath::kAuto) return forced == UpdatePath::kCpuFused && !s.weight.device().is_cpu() ? UpdatePath::kOpByOp : forced;
  return s.weight.device().is_cpu() ? UpdatePath::kCpuFused : UpdatePath::kAtenFused;
}

// The CPU pass reads the clip coefficient on the host (free there); 1 when there is none.
float host_scale(const at::Tensor& grad_scale) {
  return grad_scale.defined() ? grad_scale.to(at::kCPU).to(at::kFloat).item<float>() : 1.0f;
}

// Paths that read the gradient as stored get it multiplied first, as clip_grad_norm_ leaves it
// (in the gradient's dtype). The CPU pass folds it instead when the gradient is fp32 itself.
void scale_in_place(const OptimSlot& s, const at::Tensor& grad_scale) {
  if (grad_scale.defined()) s.grad.mul_(grad_scale.to(s.grad.device(), s.grad.scalar_type()));
}

// ATen's fused kernels take lists: slots grouped by device and weight decay (decay vs no-decay
// parameters), one call per group. The step count is a device tensor the kernels read (torch.optim
// increments its own before calling them); one tensor serves every slot of a call.
struct AtenGroup {
  double wd;
  c10::Device device;
  std::vector<size_t> slots;
};
std::vector<AtenGroup> aten_groups(const std::vector<OptimSlot>& slots, const std::vector<UpdatePath>& paths,
                                   double weight_decay) {
  std::vector<AtenGroup> groups;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (paths[i] != UpdatePath::kAtenFused) continue;
    const double wd = slots[i].decay ? weight_decay : 0.0;
    const c10::Device dev = slots[i].weight.device();
    auto it = std::find_if(groups.begin(), groups.end(), [&](const AtenGroup& g) { return g.wd == wd && g.device == dev; });
    if (it == groups.end()) groups.push_back({wd, dev, {i}});
    else it->slots.push_back(i);
  }
  return groups;
}

class Adam final : public Optimizer {
 public:
  Adam(const OptimizerConfig& c, bool decoupled, UpdatePath path)
      : c_(c), decoupled_(decoupled), path_(path), plant_no_bc2_(test_plant("optimizer")) {}
  void ensure(const std::vector<OptimSlot>& slots) {
    if (!m_.empty()) return;
    for (auto& s : slots) {
      m_.push_back(s.frozen ? at::Tensor() : at::zeros_like(s.weight, at::kFloat));
      v_.push_back(s.frozen ? at::Tensor() : at::zeros_like(s.weight, at::kFloat));
    }
  }
  std::vector<std::string> state_kinds() const override { return {"exp_avg", "exp_avg_sq"}; }
  at::Tensor slot_state(const std::string& kind, size_t slot, const std::vector<OptimSlot>& slots) override {
    ensure(slots);
    return kind == "exp_avg" ? m_.at(slot) : v_.at(slot);
  }
  void step(std::vector<OptimSlot>& slots, double lr, const at::Tensor& grad_scale) override {
    ensure(slots);
    ++step_;
    const double b1 = c_.betas[0], b2 = c_.betas[1];
    const double bc1 = 1.0 - std::pow(b1, double(step_));
    const double bc2 = plant_no_bc2_ ? 1.0 : 1.0 - std::pow(b2, double(step_));  // planted bug: tests only
    const double step_size = lr / bc1, bc2_sqrt = std::sqrt(bc2);
    std::vector<UpdatePath> paths(slots.size(), UpdatePath::kOpByOp);
    for (size_t i = 0; i < slots.size(); ++i)
      if (!slots[i].frozen) paths[i] = path_for(path_, slots[i]);
    // The planted bug (no second bias correction) has no fused-kernel form: those slots go op by op.
    if (plant_no_bc2_) std::replace(paths.begin(), paths.end(), UpdatePath::kAtenFused, UpdatePath::kOpByOp);
    const float gs = std::count(paths.begin(), paths.end(), UpdatePath::kCpuFused) ? host_scale(grad_scale) : 1.0f;
    for (const AtenGroup& grp : aten_groups(slots, paths, c_.weight_decay)) {
      std::vector<at::Tensor> w, g, m, v;
      for (size_t i : grp.slots) {
        scale_in_place(slots[i], grad_scale);
        w.push_back(slots[i].weight);
        g.push_back(as_fp32(slots[i].grad));
        m.push_back(m_[i]);
        v.push_back(v_[i]);
      }
      const at::Tensor t = at::full({}, double(step_), at::TensorOptions().dtype(at::kFloat).device(grp.device));
      const std::vector<at::Tensor> steps(w.size(), t);
      if (decoupled_)
        at::_fused_adamw_(w, g, m, v, {}, steps, lr, b1, b2, grp.wd, c_.eps, /*amsgrad=*/false, /*maximize=*/false);
      else
        at::_fused_adam_(w, g, m, v, {}, steps, lr, b1, b2, grp.wd, c_.eps, /*amsgrad=*/false, /*maximize=*/false);
    }
    for (size_t i = 0; i < slots.size(); ++i) {
      auto& s = slots[i];
      if (s.frozen || paths[i] == UpdatePath::kAtenFused) continue;
      const double wd = s.decay ? c_.weight_decay : 0.0;
      if (paths[i] == UpdatePath::kCpuFused) {
        const bool own = s.grad.scalar_type() == at::kFloat;
        if (!own) scale_in_place(s, grad_scale);
        adam_fused_cpu(s.weight, as_fp32(s.grad), m_[i], v_[i], b1, b2, c_.eps, wd, decoupled_, lr, step_size, bc2_sqrt,
                       own ? gs : 1.0f);
        continue;
      }
      scale_in_place(s, grad_scale);
      at::Tensor g = s.grad.scalar_type() == at::kFloat ? s.grad : s.grad.to(at::kFloat);
      update_fp32(s.weight, [&](at::Tensor& w) {
        if (wd != 0) {
          if (decoupled_) w.mul_(1.0 - lr * wd);
          else g = g.add(w, wd);
        }
        m_[i].mul_(b1).add_(g, 1.0 - b1);
        v_[i].mul_(b2).addcmul_(g, g, 1.0 - b2);
        at::Tensor denom = (v_[i].sqrt() / bc2_sqrt).add_(c_.eps);
        w.addcdiv_(m_[i], denom, -step_size);
      });
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> state() override {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (size_t i = 0; i < m_.size(); ++i) {
      if (!m_[i].defined()) continue;
      out.emplace_back("exp_avg." + std::to_string(i), m_[i]);
      out.emplace_back("exp_avg_sq." + std::to_string(i), v_[i]);
    }
    return out;
  }

 private:
  OptimizerConfig c_;
  bool decoupled_;
  UpdatePath path_;
  bool plant_no_bc2_;  // MFSDP_TEST_PLANT=optimizer: no second-moment bias correction
  std::vector<at::Tensor> m_, v_;
};

class Sgd final : public Optimizer {
 public:
  Sgd(const OptimizerConfig& c, UpdatePath path) : c_(c), path_(path) {}
  std::vector<std::string> state_kinds() const override { return {"momentum_buffer"}; }
  at::Tensor slot_state(const std::string&, size_t slot, const std::vector<OptimSlot>& slots) override {
    if (buf_.empty()) buf_.resize(slots.size());
    if (slots[slot].frozen) return at::Tensor();
    // A zero buffer is what the first step would start from: 0 * momentum + g = g.
    if (!buf_.at(slot).defined()) buf_[slot] = at::zeros_like(slots[slot].weight, at::kFloat);
    return buf_[slot];
  }
  void step(std::vector<OptimSlot>& slots, double lr, const at::Tensor& grad_scale) override {
    if (buf_.empty()) buf_.resize(slots.size());
    ++step_;
    std::vector<UpdatePath> paths(slots.size(), UpdatePath::kOpByOp);
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].frozen) continue;
      paths[i] = path_for(path_, slots[i]);
      // A zero buffer makes the first step's 0 * momentum + g = g, as torch.optim's clone of g
      // (the fused paths; the op-by-op path clones g itself).
      if (paths[i] != UpdatePath::kOpByOp && c_.momentum != 0 && !buf_[i].defined())
        buf_[i] = at::zeros_like(slots[i].weight, at::kFloat);
    }
    const float gs = std::count(paths.begin(), paths.end(), UpdatePath::kCpuFused) ? host_scale(grad_scale) : 1.0f;
    for (const AtenGroup& grp : aten_groups(slots, paths, c_.weight_decay)) {
      std::vector<at::Tensor> w, g, b;
      for (size_t i : grp.slots) {
        scale_in_place(slots[i], grad_scale);
        w.push_back(slots[i].weight);
        g.push_back(as_fp32(slots[i].grad));
        if (c_.momentum != 0) b.push_back(buf_[i]);
      }
      // is_first_step false: the zero buffers above give the first step's buf = g.
      at::_fused_sgd_(w, g, b, grp.wd, c_.momentum, lr, /*dampening=*/0.0, c_.nesterov, /*maximize=*/false,
                      /*is_first_step=*/false);
    }
    for (size_t i = 0; i < slots.size(); ++i) {
      auto& s = slots[i];
      if (s.frozen || paths[i] == UpdatePath::kAtenFused) continue;
      const double wd = s.decay ? c_.weight_decay : 0.0;
      if (paths[i] == UpdatePath::kCpuFused) {
        const bool own = s.grad.scalar_type() == at::kFloat;
        if (!own) scale_in_place(s, grad_scale);
        sgd_fused_cpu(s.weight, as_fp32(s.grad), c_.momentum != 0 ? &buf_[i] : nullptr, float(lr), float(wd),
                      float(c_.momentum), c_.nesterov, own ? gs : 1.0f);
        continue;
      }
      scale_in_place(s, grad_scale);
      at::Tensor g = s.grad.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      update_fp32(s.weight, [&](at::Tensor& w) {
        if (wd != 0) g.add_(w, wd);
        if (c_.momentum != 0) {
          if (!buf_[i].defined()) buf_[i] = g.clone();
          else buf_[i].mul_(c_.momentum).add_(g);
          if (c_.nesterov) g.add_(buf_[i], c_.momentum);
          else g = buf_[i];
        }
        w.add_(g, -lr);
      });
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> state() override {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (size_t i = 0; i < buf_.size(); ++i)
      if (buf_[i].defined()) out.emplace_back("momentum_buffer." + std::to_string(i), buf_[i]);
    return out;
  }

 private:
  OptimizerConfig c_;
  UpdatePath path_;
  std::vector<at::Tensor> buf_;
};

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& c, UpdatePath path) {
  if (c.name == "adamw") return std::make_unique<Adam>(c, true, path);
  if (c.name == "adam") return std::make_unique<Adam>(c, false, path);
  if (c.name == "sgd") return std::make_unique<Sgd>(c, path);
  throw UserError("optimizer.name: unknown optimizer '" + c.name + "'");
}

double learning_rate(const LrSchedulerConfig& s, double max_lr, int64_t max_steps, int64_t step) {
  const int64_t warmup = s.warmup_steps;
  const int64_t decay_steps = s.decay_steps ? *s.decay_steps : max_steps;
  if (warmup > 0 && step <= warmup) return max_lr * double(step) / double(warmup);
  if (s.name == "constant") return max_lr;
  if (step > decay_steps) return s.min_lr;  // every decaying schedule, inverse_sqrt too (as Megatron)
  if (s.name == "inverse_sqrt") {
    const double w = double(std::max<int64_t>(warmup, 1));
    return std::max(s.min_lr, max_lr * std::sqrt(w) / std::sqrt(double(step)));
  }
  const double range = max_lr - s.min_lr;
  if (s.name == "wsd") {
    // Warmup, stable at max_lr, then a linear decay to min_lr over the last wsd_decay_steps.
    const int64_t wsd = s.wsd_decay_steps ? *s.wsd_decay_steps : std::max<int64_t>(1, decay_steps / 10);
    const int64_t stable_end = decay_steps - wsd;
    if (step <= stable_end) return max_lr;
    return s.min_lr + range * (1.0 - double(step - stable_end) / double(wsd));
  }
  const double span = double(std::max<int64_t>(decay_steps - warmup, 1));
  const double ratio = std::min(1.0, std::max(0.0, double(step - warmup) / span));
  if (s.name == "linear") return s.min_lr + range * (1.0 - ratio);
  if (s.name == "cosine") return s.min_lr + range * 0.5 * (1.0 + std::cos(M_PI * ratio));
  throw UserError("lr_scheduler.name: unknown schedule '" + s.name + "'");
}

}  // namespace mfsdp
