#include "optim/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>  // at::parallel_for: the fused passes on ATen's threads

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
bool fused_eligible(const at::Tensor& w, const at::Tensor& g) {
  return w.device().is_cpu() && g.device().is_cpu() && w.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat &&
         w.is_contiguous() && g.is_contiguous();
}

// Scalars come in as doubles and are rounded to fp32 once, as ATen's ops round theirs (the factor
// 1 - lr * wd and 1 - beta are formed in double, as torch.optim forms them in Python).
void adam_fused_cpu(at::Tensor& w, const at::Tensor& g, at::Tensor& m, at::Tensor& v, double beta1, double beta2,
                    double eps_d, double wd_d, bool decoupled, double lr, double step_size_d, double bc2_sqrt_d) {
  float* __restrict W = w.data_ptr<float>();
  const float* __restrict G = g.data_ptr<float>();
  float* __restrict M = m.data_ptr<float>();
  float* __restrict V = v.data_ptr<float>();
  const float b1 = float(beta1), b2 = float(beta2), eps = float(eps_d), wd = float(wd_d), step_size = float(step_size_d),
              bc2_sqrt = float(bc2_sqrt_d), decay = float(1.0 - lr * wd_d), one_b1 = float(1.0 - beta1),
              one_b2 = float(1.0 - beta2);
  at::parallel_for(0, w.numel(), 1 << 15, [&](int64_t lo, int64_t hi) {
    if (decoupled) {
      for (int64_t i = lo; i < hi; ++i) {
        const float wi = wd != 0 ? W[i] * decay : W[i], gi = G[i];
        const float mi = M[i] * b1 + gi * one_b1, vi = V[i] * b2 + one_b2 * gi * gi;
        M[i] = mi;
        V[i] = vi;
        W[i] = wi - step_size * (mi / (std::sqrt(vi) / bc2_sqrt + eps));
      }
    } else {
      for (int64_t i = lo; i < hi; ++i) {
        const float gi = wd != 0 ? G[i] + W[i] * wd : G[i];
        const float mi = M[i] * b1 + gi * one_b1, vi = V[i] * b2 + one_b2 * gi * gi;
        M[i] = mi;
        V[i] = vi;
        W[i] = W[i] - step_size * (mi / (std::sqrt(vi) / bc2_sqrt + eps));
      }
    }
  });
}

void sgd_fused_cpu(at::Tensor& w, const at::Tensor& g, at::Tensor* buf, float lr, float wd, float momentum, bool nesterov) {
  float* __restrict W = w.data_ptr<float>();
  const float* __restrict G = g.data_ptr<float>();
  float* __restrict B = buf ? buf->data_ptr<float>() : nullptr;
  at::parallel_for(0, w.numel(), 1 << 15, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float gi = wd != 0 ? G[i] + W[i] * wd : G[i];
      if (B) {
        const float bi = B[i] * momentum + gi;
        B[i] = bi;
        gi = nesterov ? gi + bi * momentum : bi;
      }
      W[i] = W[i] - lr * gi;
    }
  });
}

class Adam final : public Optimizer {
 public:
  Adam(const OptimizerConfig& c, bool decoupled)
      : c_(c), decoupled_(decoupled), plant_no_bc2_(test_plant("optimizer")) {}
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
  void step(std::vector<OptimSlot>& slots, double lr) override {
    ensure(slots);
    ++step_;
    const double b1 = c_.betas[0], b2 = c_.betas[1];
    const double bc1 = 1.0 - std::pow(b1, double(step_));
    const double bc2 = plant_no_bc2_ ? 1.0 : 1.0 - std::pow(b2, double(step_));  // planted bug: tests only
    const double step_size = lr / bc1, bc2_sqrt = std::sqrt(bc2);
    for (size_t i = 0; i < slots.size(); ++i) {
      auto& s = slots[i];
      if (s.frozen) continue;
      const double wd = s.decay ? c_.weight_decay : 0.0;
      if (fused_eligible(s.weight, s.grad)) {
        adam_fused_cpu(s.weight, s.grad, m_[i], v_[i], b1, b2, c_.eps, wd, decoupled_, lr, step_size, bc2_sqrt);
        continue;
      }
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
  bool plant_no_bc2_;  // MFSDP_TEST_PLANT=optimizer: no second-moment bias correction
  std::vector<at::Tensor> m_, v_;
};

class Sgd final : public Optimizer {
 public:
  explicit Sgd(const OptimizerConfig& c) : c_(c) {}
  std::vector<std::string> state_kinds() const override { return {"momentum_buffer"}; }
  at::Tensor slot_state(const std::string&, size_t slot, const std::vector<OptimSlot>& slots) override {
    if (buf_.empty()) buf_.resize(slots.size());
    if (slots[slot].frozen) return at::Tensor();
    // A zero buffer is what the first step would start from: 0 * momentum + g = g.
    if (!buf_.at(slot).defined()) buf_[slot] = at::zeros_like(slots[slot].weight, at::kFloat);
    return buf_[slot];
  }
  void step(std::vector<OptimSlot>& slots, double lr) override {
    if (buf_.empty()) buf_.resize(slots.size());
    ++step_;
    for (size_t i = 0; i < slots.size(); ++i) {
      auto& s = slots[i];
      if (s.frozen) continue;
      const double wd = s.decay ? c_.weight_decay : 0.0;
      if (fused_eligible(s.weight, s.grad)) {
        at::Tensor* buf = nullptr;
        if (c_.momentum != 0) {
          // A zero buffer makes the first step's 0 * momentum + g = g, as torch.optim's clone of g.
          if (!buf_[i].defined()) buf_[i] = at::zeros_like(s.weight, at::kFloat);
          buf = &buf_[i];
        }
        sgd_fused_cpu(s.weight, s.grad, buf, float(lr), float(wd), float(c_.momentum), c_.nesterov);
        continue;
      }
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
  std::vector<at::Tensor> buf_;
};

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& c) {
  if (c.name == "adamw") return std::make_unique<Adam>(c, true);
  if (c.name == "adam") return std::make_unique<Adam>(c, false);
  if (c.name == "sgd") return std::make_unique<Sgd>(c);
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
