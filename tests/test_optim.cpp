// Optimizers against hand-computed PyTorch updates; LR schedules at their defining points.
#include <ATen/ATen.h>

#include <cmath>

#include "catch.h"
#include "optim/optimizer.h"

using namespace mfsdp;

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
