// Optimizers against hand-computed PyTorch updates; LR schedules at their defining points.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <torch/script.h>

#include <cmath>
#include <cstdlib>

#include "catch.h"
#include "optim/optimizer.h"

using namespace mfsdp;

// 40 steps of torch.optim itself (tests/oracle/optim_reference.py writes the file; CTest passes its
// path in MFSDP_OPTIM_REFERENCE): the same gradients and learning rates through mfsdp's optimizers,
// every step's weights compared. Missing the file is a failure, not a skip.
TEST_CASE("AdamW, Adam (L2) and SGD (momentum, nesterov, plain) follow torch.optim for 40 steps") {
  const char* path = std::getenv("MFSDP_OPTIM_REFERENCE");
  REQUIRE(path != nullptr);
  torch::jit::Module ref = torch::jit::load(path);
  auto buf = [&](const std::string& n) { return ref.attr(n).toTensor(); };
  const at::Tensor w0 = buf("w0").reshape({-1}), b0 = buf("b0"), gw = buf("grad_w"), gb = buf("grad_b"), lr = buf("lr");
  struct Setting {
    const char* name;
    OptimizerConfig c;
  };
  auto cfg = [](const char* name, double wd, std::vector<double> betas, double eps, double momentum, bool nesterov) {
    OptimizerConfig c;
    c.name = name;
    c.weight_decay = wd;
    c.betas = betas;
    c.eps = eps;
    c.momentum = momentum;
    c.nesterov = nesterov;
    return c;
  };
  const Setting settings[] = {
      {"adamw", cfg("adamw", 0.1, {0.8, 0.99}, 1e-6, 0, false)},
      {"adam_l2", cfg("adam", 0.05, {0.9, 0.95}, 1e-8, 0, false)},
      {"sgd_momentum", cfg("sgd", 0.01, {0.9, 0.95}, 1e-8, 0.9, false)},
      {"sgd_nesterov", cfg("sgd", 0.02, {0.9, 0.95}, 1e-8, 0.8, true)},
      {"sgd_plain", cfg("sgd", 0.0, {0.9, 0.95}, 1e-8, 0.0, false)},
  };
  for (const auto& st : settings) {
    SECTION(st.name) {
      auto opt = make_optimizer(st.c);
      std::vector<OptimSlot> slots{{"w", w0.clone(), at::zeros_like(w0), true}, {"b", b0.clone(), at::zeros_like(b0), false}};
      const at::Tensor want_w = buf(std::string(st.name) + "_w"), want_b = buf(std::string(st.name) + "_b");
      double worst = 0;
      for (int64_t s = 0; s < lr.size(0); ++s) {
        slots[0].grad.copy_(gw[s]);
        slots[1].grad.copy_(gb[s]);
        opt->step(slots, lr[s].item<double>());
        for (auto [got, want] : {std::pair{slots[0].weight, want_w[s]}, std::pair{slots[1].weight, want_b[s]}}) {
          const double rel = ((got - want).norm() / want.norm()).item<double>();
          worst = std::max(worst, rel);
          INFO(st.name << " step " << s + 1);
          REQUIRE(rel < 1e-6);
        }
      }
      CHECK(opt->steps_taken() == lr.size(0));
      WARN(st.name << ": worst relative difference from torch.optim over 40 steps " << worst);
    }
  }
}

TEST_CASE("AdamW matches torch.optim.AdamW's update") {
  OptimizerConfig c;
  c.name = "adamw";
  c.weight_decay = 0.1;
  c.betas = {0.9, 0.99};
  c.eps = 1e-8;
  auto opt = make_optimizer(c);
  std::vector<OptimSlot> slots{{"w", at::tensor({1.0f, -2.0f}), at::tensor({0.5f, 0.25f}), true}};
  opt->step(slots, 0.01);
  // Step 1: m = 0.1 g, v = 0.01 g^2, m_hat = g, v_hat = g^2: update = lr * g / (|g| + eps) = lr * sign(g).
  const double w0 = 1.0 * (1 - 0.01 * 0.1) - 0.01 * 0.5 / (0.5 + 1e-8);
  const double w1 = -2.0 * (1 - 0.01 * 0.1) - 0.01 * 0.25 / (0.25 + 1e-8);
  CHECK(slots[0].weight[0].item<double>() == Approx(w0).epsilon(1e-6));
  CHECK(slots[0].weight[1].item<double>() == Approx(w1).epsilon(1e-6));
  CHECK(opt->steps_taken() == 1);
  CHECK(opt->state().size() == 2);
}

TEST_CASE("weight decay is skipped for slots marked decay=false; Adam adds L2 to the gradient") {
  OptimizerConfig c;
  c.name = "adam";
  c.weight_decay = 0.5;
  auto opt = make_optimizer(c);
  std::vector<OptimSlot> slots{{"bias", at::tensor({1.0f}), at::tensor({0.0f}), false},
                               {"w", at::tensor({1.0f}), at::tensor({0.0f}), true}};
  opt->step(slots, 0.1);
  CHECK(slots[0].weight.item<double>() == Approx(1.0));             // no gradient, no decay
  CHECK(slots[1].weight.item<double>() == Approx(1.0 - 0.1).epsilon(1e-5));  // L2 gradient 0.5 -> Adam step lr
}

TEST_CASE("SGD with momentum and nesterov follows torch.optim.SGD") {
  OptimizerConfig c;
  c.name = "sgd";
  c.weight_decay = 0;
  c.momentum = 0.9;
  auto opt = make_optimizer(c);
  std::vector<OptimSlot> slots{{"w", at::tensor({0.0f}), at::tensor({1.0f}), true}};
  opt->step(slots, 0.1);  // buf = 1, w = -0.1
  opt->step(slots, 0.1);  // buf = 1.9, w = -0.29
  CHECK(slots[0].weight.item<double>() == Approx(-0.29).epsilon(1e-6));
  c.nesterov = true;
  auto nes = make_optimizer(c);
  std::vector<OptimSlot> s2{{"w", at::tensor({0.0f}), at::tensor({1.0f}), true}};
  nes->step(s2, 0.1);  // buf = 1, g = 1 + 0.9 = 1.9
  CHECK(s2[0].weight.item<double>() == Approx(-0.19).epsilon(1e-6));
}

TEST_CASE("bf16 main weights are updated in fp32 and rounded") {
  OptimizerConfig c;
  c.name = "sgd";
  c.momentum = 0;
  c.weight_decay = 0;
  auto opt = make_optimizer(c);
  std::vector<OptimSlot> slots{{"w", at::tensor({1.0f}).to(at::kBFloat16), at::tensor({1.0f}).to(at::kBFloat16), true}};
  opt->step(slots, 0.5);
  CHECK(slots[0].weight.scalar_type() == at::kBFloat16);
  CHECK(slots[0].weight.item<double>() == 0.5);
}

TEST_CASE("LR schedules: warmup, cosine, linear, constant, WSD, inverse sqrt") {
  LrSchedulerConfig s;
  s.warmup_steps = 10;
  s.min_lr = 0.1;
  s.name = "cosine";
  CHECK(learning_rate(s, 1.0, 110, 5) == Approx(0.5));
  CHECK(learning_rate(s, 1.0, 110, 10) == Approx(1.0));
  CHECK(learning_rate(s, 1.0, 110, 60) == Approx(0.1 + 0.9 * 0.5));
  CHECK(learning_rate(s, 1.0, 110, 110) == Approx(0.1));
  s.name = "linear";
  CHECK(learning_rate(s, 1.0, 110, 60) == Approx(0.55));
  s.name = "constant";
  CHECK(learning_rate(s, 1.0, 110, 100) == Approx(1.0));
  s.name = "wsd";
  s.wsd_decay_steps = 20;
  CHECK(learning_rate(s, 1.0, 110, 90) == Approx(1.0));
  CHECK(learning_rate(s, 1.0, 110, 100) == Approx(0.1 + 0.9 * 0.5));
  CHECK(learning_rate(s, 1.0, 110, 110) == Approx(0.1));
  s.name = "inverse_sqrt";
  CHECK(learning_rate(s, 1.0, 110, 40) == Approx(std::sqrt(10.0 / 40.0)));
  CHECK(learning_rate(s, 1.0, 1000000, 1000000) == Approx(0.1));  // floored at min_lr
}

TEST_CASE("decay_steps ends the decay before max_steps") {
  LrSchedulerConfig s;
  s.name = "linear";
  s.warmup_steps = 0;
  s.min_lr = 0.0;
  s.decay_steps = 50;
  CHECK(learning_rate(s, 1.0, 100, 25) == Approx(0.5));
  CHECK(learning_rate(s, 1.0, 100, 60) == Approx(0.0));  // past decay_steps: min_lr
}

// The fused CPU pass (contiguous fp32 slots) against the op-by-op path (the same slots as strided
// views, which the fused pass does not take), and against itself over another cut of the same
// elements into slots and another thread count: a shard boundary or a thread split must not move
// a bit, or N ranks would not match one rank.
TEST_CASE("fused optimizer passes: layout- and thread-independent, equal to the op-by-op update") {
  const int64_t n = 100003;
  at::manual_seed(7);
  const at::Tensor w0 = at::randn({n}), grads = at::randn({5, n});
  for (const char* name : {"adamw", "adam", "sgd"}) {
    OptimizerConfig c;
    c.name = name;
    c.weight_decay = 0.05;
    c.momentum = 0.9;
    c.nesterov = std::string(name) == "sgd";
    auto run = [&](std::vector<int64_t> cuts, bool strided, int threads) {
      at::set_num_threads(threads);
      auto opt = make_optimizer(c);
      at::Tensor w = w0.clone(), backing, g;
      if (strided) {  // every second element of a 2n buffer: not contiguous
        backing = at::zeros({2 * n});
        w = backing.as_strided({n}, {2});
        w.copy_(w0);
      }
      at::Tensor gbuf = strided ? at::zeros({2 * n}) : at::zeros({n});
      g = strided ? gbuf.as_strided({n}, {2}) : gbuf;
      std::vector<OptimSlot> slots;
      int64_t at_ = 0;
      for (int64_t len : cuts) {
        slots.push_back({"s" + std::to_string(at_), w.narrow(0, at_, len), g.narrow(0, at_, len), true});
        at_ += len;
      }
      for (int64_t s = 0; s < grads.size(0); ++s) {
        g.copy_(grads[s]);
        opt->step(slots, 1e-2);
      }
      at::set_num_threads(1);
      return w.contiguous();
    };
    const at::Tensor one = run({n}, false, 1);
    INFO(name);
    CHECK(at::equal(one, run({33331, 7, n - 33338}, false, 1)));  // another cut: bit-equal
    CHECK(at::equal(one, run({n}, false, 2)));                   // two threads: bit-equal
    const at::Tensor ops = run({n}, true, 1);
    const double rel = ((one - ops).norm() / ops.norm()).item<double>();
    CHECK(rel < 1e-6);
    WARN(name << ": fused vs op-by-op after 5 steps, relative difference " << rel);
  }
}

// The three update paths on the same slots (one with weight decay, one without: two groups for
// ATen's list kernels), five steps with a clip coefficient: ATen's fused kernels (the GPU path,
// run here on the CPU: the same ATen call) and mfsdp's CPU pass against op by op. And the folded
// coefficient against gradients multiplied beforehand (clip_grad_norm_ then step): bit-equal on
// the CPU pass, which folds it, as on the paths that multiply in place. bf16 gradients too.
TEST_CASE("update paths: ATen fused kernels, the CPU pass and op by op agree; the clip coefficient folds exactly") {
  const int64_t n = 40009;
  at::manual_seed(11);
  const at::Tensor w0 = at::randn({n}), grads = at::randn({5, n});
  const at::Tensor coeff = at::full({}, 0.37, at::kDouble);
  for (const char* name : {"adamw", "adam", "sgd"}) {
    OptimizerConfig c;
    c.name = name;
    c.weight_decay = 0.05;
    c.momentum = 0.9;
    c.nesterov = false;
    auto run = [&](UpdatePath path, bool fold, at::ScalarType gtype = at::kFloat) {
      auto opt = make_optimizer(c, path);
      at::Tensor w = w0.clone(), g = at::zeros({n}, gtype);
      std::vector<OptimSlot> slots{{"a", w.narrow(0, 0, 30000), g.narrow(0, 0, 30000), true},
                                   {"b", w.narrow(0, 30000, n - 30000), g.narrow(0, 30000, n - 30000), false}};
      for (int64_t s = 0; s < grads.size(0); ++s) {
        g.copy_(grads[s]);
        if (fold) {
          opt->step(slots, 1e-2, coeff);
        } else {
          g.mul_(coeff.to(gtype));
          opt->step(slots, 1e-2);
        }
      }
      return w;
    };
    INFO(name);
    const at::Tensor ops = run(UpdatePath::kOpByOp, false), cpu = run(UpdatePath::kCpuFused, true),
                     aten = run(UpdatePath::kAtenFused, true);
    CHECK(at::equal(cpu, run(UpdatePath::kCpuFused, false)));
    CHECK(at::equal(ops, run(UpdatePath::kOpByOp, true)));
    CHECK(at::equal(aten, run(UpdatePath::kAtenFused, false)));
    CHECK(!at::equal(ops, w0));
    // bf16 gradients (grad_reduce_in_fp32 off): the fused paths read an fp32 copy.
    const at::Tensor ops16 = run(UpdatePath::kOpByOp, true, at::kBFloat16);
    for (auto path : {UpdatePath::kCpuFused, UpdatePath::kAtenFused}) {
      const double rel = ((run(path, true, at::kBFloat16) - ops16).norm() / (ops16 - w0).norm()).item<double>();
      CHECK(rel < 1e-5);
    }
    for (auto [what, t] : {std::pair{"cpu pass", cpu}, std::pair{"aten fused", aten}}) {
      const double rel = ((t - ops).norm() / (ops - w0).norm()).item<double>();
      WARN(name << ": " << what << " vs op by op after 5 steps, relative to the update " << rel);
      CHECK(rel < 1e-5);
    }
  }
}
