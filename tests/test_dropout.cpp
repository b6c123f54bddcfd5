// Dropout's masks drawn by mfsdp (model/cpu_random.h, model/fast_dropout.h) against ATen's: the same
// numbers from the same generator, the generator left in the same state, and mfsdp::dropout's
// output and gradient equal to at::dropout's bit for bit; then the graph rewrite.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/DistributionsHelper.h>

#include <torch/autograd.h>
#include <torch/script.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "catch.h"
#include "model/cpu_random.h"
#include "model/fast_dropout.h"
#include "model/fast_ops.h"

using namespace mfsdp;

namespace {

at::CPUGeneratorImpl* default_impl() {
  return at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
}

// The default generator's whole state (torch.get_rng_state's bytes).
at::Tensor rng_state() { return at::Tensor(at::detail::getDefaultCPUGenerator().get_state()); }
void set_rng_state(const at::Tensor& s) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  gen.set_state(s);
}

// Moves the generator by `words` 32-bit outputs (odd counts put draws across a word pair).
void advance(int64_t words) {
  for (int64_t i = 0; i < words; ++i) default_impl()->random();
}

}  // namespace

// Against ATen's per-element draw itself (bernoulli_distribution<double> on the generator: what its
// CPU bernoulli_ runs on every CPU but Intel's), so this holds on any machine CI runs on.
TEST_CASE("The twister's Bernoulli draws are ATen's bernoulli_distribution<double>, across state regenerations") {
  for (double p : {0.9, 0.8, 0.5, 1.0 / 3.0, 0.1, 1e-12, 1.0 - 1e-12}) {
    for (int64_t offset : {0, 1, 623, 624, 1247}) {
      for (int64_t n : {1, 7, 311, 312, 313, 624, 1025, 5003}) {
        at::Generator gen = at::detail::createCPUGenerator(20261207);
        auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
        for (int64_t i = 0; i < offset; ++i) impl->random();
        at::mt19937_data_pod pod = impl->engine().data();
        Mt19937State s;
        std::memcpy(s.state, pod.state_.data(), sizeof(s.state));
        s.left = pod.left_;
        s.next = pod.next_;
        std::vector<uint8_t> keep(size_t(n), 7);
        mt19937_bernoulli(s, p, keep.data(), n);
        int64_t wrong = 0;
        for (int64_t i = 0; i < n; ++i) {
          at::bernoulli_distribution<double> draw(p);
          wrong += (draw(impl) != 0.0) != (keep[size_t(i)] == 1);
        }
        INFO("p " << p << " offset " << offset << " n " << n);
        CHECK(wrong == 0);
        const at::mt19937_data_pod after = impl->engine().data();
        CHECK(after.left_ == s.left);
        CHECK(after.next_ == s.next);
        CHECK(std::memcmp(after.state_.data(), s.state, sizeof(s.state)) == 0);
      }
    }
  }
}

// mfsdp::sdpa's masks where mfsdp's draws do not replicate ATen's are ATen's bernoulli_ on a byte
// tensor: the same numbers as on the float tensor ATen's math attention draws on, on any CPU.
TEST_CASE("ATen's bernoulli_ draws the same numbers on a byte tensor as on a float one") {
  at::manual_seed(13);
  advance(1);
  const at::Tensor before = rng_state();
  at::Tensor f = at::empty({4, 3, 50, 50}).bernoulli_(0.9);
  const at::Tensor after = rng_state();
  set_rng_state(before);
  at::Tensor b = at::empty({4, 3, 50, 50}, at::kByte).bernoulli_(0.9);
  CHECK(at::equal(b.to(at::kFloat), f));
  CHECK(at::equal(rng_state(), after));
}

TEST_CASE("draw_bernoulli_keep: bernoulli_'s values and the generator state it leaves, or nothing where it cannot") {
  at::manual_seed(11);
  advance(3);
  for (int64_t n : {1, 700, 4099}) {
    const at::Tensor before = rng_state();
    at::Tensor aten = at::empty({n}).bernoulli_(0.8);
    const at::Tensor aten_after = rng_state();
    set_rng_state(before);
    std::vector<uint8_t> keep(static_cast<size_t>(n));
    if (cpu_bernoulli_replicable()) {
      REQUIRE(draw_bernoulli_keep(0.8, keep.data(), n));
      at::Tensor ours = at::from_blob(keep.data(), {n}, at::kByte).to(at::kFloat);
      CHECK(at::equal(ours, aten));
      CHECK(at::equal(rng_state(), aten_after));
    } else {
      // ATen's MKL kernel (Intel CPUs): mfsdp draws nothing and leaves the generator alone.
      WARN("this CPU's bernoulli_ is ATen's MKL kernel: mfsdp's dropout runs ATen's (checked below)");
      CHECK_FALSE(draw_bernoulli_keep(0.8, keep.data(), n));
      CHECK(at::equal(rng_state(), before));
      set_rng_state(aten_after);
    }
  }
}

TEST_CASE("mfsdp::dropout is at::dropout bit for bit: output, gradient and generator, fp32 and bf16") {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (double p : {0.1, 0.2, 0.5, 0.9}) {
      at::manual_seed(5);
      at::Tensor x = (at::randn({37, 129}) * 3).to(dtype).requires_grad_(true);
      x.detach()[0][0] = std::numeric_limits<float>::infinity();  // inf * 0 is NaN in both
      x.detach()[1][1] = -0.0f;
      at::Tensor g = at::randn({37, 129}).to(dtype);
      advance(5);
      const at::Tensor before = rng_state();
      at::Tensor want = at::dropout(x, p, true);
      at::Tensor dwant = torch::autograd::grad({want}, {x}, {g})[0];
      const at::Tensor after = rng_state();
      set_rng_state(before);
      at::Tensor got = mfsdp::dropout(x, p, true);
      at::Tensor dgot = torch::autograd::grad({got}, {x}, {g})[0];
      INFO("dtype " << dtype << " p " << p);
      CHECK(at::equal(got.isnan(), want.isnan()));
      CHECK(at::equal(got.nan_to_num(0, 0, 0), want.nan_to_num(0, 0, 0)));
      CHECK(at::equal(got.signbit() & ~got.isnan(), want.signbit() & ~want.isnan()));  // (a NaN's sign aside)
      CHECK(at::equal(dgot, dwant));
      CHECK(at::equal(rng_state(), after));
      // Without a gradient to come: the same values.
      set_rng_state(before);
      {
        at::NoGradGuard no_grad;
        CHECK(at::equal(mfsdp::dropout(x, p, true).nan_to_num(0, 0, 0), want.nan_to_num(0, 0, 0)));
      }
    }
  }
}

TEST_CASE("mfsdp::dropout: evaluation, p 0 and 1, non-contiguous and other dtypes are at::dropout's") {
  at::manual_seed(9);
  at::Tensor x = at::randn({16, 24});
  CHECK(at::equal(mfsdp::dropout(x, 0.3, false), x));
  CHECK(at::equal(mfsdp::dropout(x, 0.0, true), x));
  CHECK(at::equal(mfsdp::dropout(x, 1.0, true), at::dropout(x, 1.0, true)));
  for (const at::Tensor& t : {x.t(), x.to(at::kDouble)}) {
    const at::Tensor before = rng_state();
    at::Tensor want = at::dropout(t, 0.25, true);
    set_rng_state(before);
    CHECK(at::equal(mfsdp::dropout(t, 0.25, true), want));
  }
}

TEST_CASE("Dropout: the graph rewrite replaces aten::dropout, and a trained module's masks and gradients stay ATen's") {
  torch::jit::Module m("m");
  m.register_attribute("training", c10::BoolType::get(), true);
  m.define(R"(
    def forward(self, x):
        return torch.dropout(x * 2, 0.2, self.training) + torch.dropout(x, 0.5, True)
  )");
  m.train();
  at::Tensor x = at::randn({64, 33}).requires_grad_(true);
  at::manual_seed(2);
  at::Tensor want = m.forward({x}).toTensor();
  at::Tensor gw = torch::autograd::grad({want.sum()}, {x})[0];
  const at::Tensor after = rng_state();
  const int replaced = use_fast_dropout(m);
  const std::string graph = m.get_method("forward").graph()->toString();
  if (cpu_bernoulli_replicable()) {
    CHECK(replaced == 2);
    CHECK(graph.find("mfsdp::dropout") != std::string::npos);
    CHECK(graph.find("aten::dropout") == std::string::npos);
  } else {
    CHECK(replaced == 0);  // ATen's MKL draws: nothing to gain, other numbers
  }
  at::manual_seed(2);
  at::Tensor got = m.forward({x}).toTensor();
  at::Tensor gg = torch::autograd::grad({got.sum()}, {x})[0];
  CHECK(at::equal(got, want));
  CHECK(at::equal(gg, gw));
  CHECK(at::equal(rng_state(), after));
  // In evaluation the first follows self.training (off); the second was written always on.
  m.eval();
  at::NoGradGuard no_grad;
  at::manual_seed(3);
  at::Tensor eval_got = m.forward({x}).toTensor();
  at::manual_seed(3);
  CHECK(at::equal(eval_got, x * 2 + at::dropout(x, 0.5, true)));
}

namespace {
// q, k, v as attention makes them: [B, T, H, D] memory viewed as [B, H, T, D].
at::Tensor heads(int64_t b, int64_t h, int64_t t, int64_t d, at::ScalarType dtype) {
  return at::randn({b, t, h, d}).to(dtype).transpose(1, 2);
}
struct DropRun {
  std::vector<at::Tensor> out;  // o, dq, dk, dv
  at::Tensor state_after_forward;
};
DropRun attn_dropout_run(const at::Tensor& q0, const at::Tensor& k0, const at::Tensor& v0, const at::Tensor& g,
                         const std::optional<at::Tensor>& mask, double p, bool causal, bool ours, bool gqa) {
  at::Tensor q = q0.detach().requires_grad_(true), k = k0.detach().requires_grad_(true),
             v = v0.detach().requires_grad_(true);
  at::Tensor o = ours ? mfsdp::sdpa(q, k, v, mask, p, causal, std::nullopt, gqa)
                      : at::scaled_dot_product_attention(q, k, v, mask, p, causal, std::nullopt, gqa);
  DropRun r;
  r.state_after_forward = rng_state();
  auto gr = torch::autograd::grad({o}, {q, k, v}, {g});
  r.out = {o.detach(), gr[0], gr[1], gr[2]};
  return r;
}
}  // namespace

// The masks are ATen's math attention's (its CPU path with dropout): one bernoulli_(1 - p) over the
// [B, H, Tq, Tk] probabilities. So with the same generator state mfsdp's kernel and ATen's attention
// compute the same function: outputs and gradients agree to rounding, and the generator ends equal.
TEST_CASE("Attention dropout: mfsdp's kernel draws ATen's masks; outputs and gradients agree with ATen's attention") {
  struct Case {
    int64_t b, h, t, d;
    bool causal, explicit_mask;
    at::ScalarType dtype;
    int64_t hk = 0;  // key/value heads when fewer than h (enable_gqa)
  };
  const std::vector<Case> cases = {
      {2, 3, 37, 16, true, false, at::kFloat},   // rows not a multiple of the 32-row block
      {2, 2, 64, 32, false, false, at::kFloat},  // not causal
      {1, 2, 48, 16, false, true, at::kFloat},   // an explicit causal mask (Hugging Face's way)
      {1, 2, 300, 16, true, false, at::kFloat},  // beyond kCpuAttentionMaxKeys: the log-sum-exp kernels
      {2, 2, 40, 16, true, false, at::kBFloat16},
      {1, 2, 300, 16, true, false, at::kBFloat16},
      {2, 4, 37, 16, true, false, at::kBFloat16, 2},
      {2, 4, 37, 16, true, false, at::kFloat, 2},  // grouped-query attention: the mask is over q's heads
      {1, 4, 300, 16, true, false, at::kFloat, 1},
  };
  // bf16 both ways: its kernels with bf16 products, and converted to fp32 (model/cpu_attention.h:
  // cpu_attention_bf16_products; MFSDP_ATTENTION_BF16 restored after).
  const char* knob_before = std::getenv("MFSDP_ATTENTION_BF16");
  const std::string saved = knob_before ? knob_before : "";
  for (const Case& c : cases)
  for (const char* mode : {"bf16", "fp32"}) {
    if (c.dtype == at::kFloat && std::string(mode) == "fp32") continue;
    setenv("MFSDP_ATTENTION_BF16", mode, 1);
    for (double p : {0.1, 0.5}) {
      at::manual_seed(31);
      const int64_t hk = c.hk ? c.hk : c.h;
      at::Tensor q = heads(c.b, c.h, c.t, c.d, c.dtype), k = heads(c.b, hk, c.t, c.d, c.dtype),
                 v = heads(c.b, hk, c.t, c.d, c.dtype);
      at::Tensor g = at::randn({c.b, c.h, c.t, c.d}).to(c.dtype);
      std::optional<at::Tensor> mask;
      if (c.explicit_mask) mask = at::ones({c.t, c.t}, at::kBool).tril();
      const at::Tensor before = rng_state();
      const DropRun want = attn_dropout_run(q, k, v, g, mask, p, c.causal, false, c.hk != 0);
      set_rng_state(before);
      const DropRun got = attn_dropout_run(q, k, v, g, mask, p, c.causal, true, c.hk != 0);
      INFO("t " << c.t << " causal " << c.causal << " mask " << c.explicit_mask << " dtype " << c.dtype << " p " << p
                << " kv heads " << hk << " MFSDP_ATTENTION_BF16=" << mode);
      CHECK(at::equal(got.state_after_forward, want.state_after_forward));
      const double tol = c.dtype == at::kFloat ? 2e-5 : 2e-2;
      for (size_t i = 0; i < 4; ++i) {
        const at::Tensor a = got.out[i].to(at::kDouble), w = want.out[i].to(at::kDouble);
        const double err = ((a - w).abs().max() / w.abs().max().clamp_min(1e-6)).item<double>();
        INFO("output " << i << " (o, dq, dk, dv) error " << err);
        CHECK(err < tol);
      }
    }
  }
  if (knob_before) setenv("MFSDP_ATTENTION_BF16", saved.c_str(), 1);
  else unsetenv("MFSDP_ATTENTION_BF16");
}

// nanoGPT's spelling: the probability is `p if self.training else 0.0`, a value of the graph, not a
// constant. The rewrite takes it; training draws ATen's masks, evaluation runs without dropout.
TEST_CASE("Attention dropout: a dropout_p that follows self.training is taken, and follows it") {
  torch::jit::Module m("m");
  m.register_attribute("training", c10::BoolType::get(), true);
  m.register_attribute("p", c10::FloatType::get(), 0.2);
  m.define(R"(
    def forward(self, q, k, v):
        return torch.scaled_dot_product_attention(q, k, v, None, self.p if self.training else 0.0, True)
  )");
  at::manual_seed(41);
  at::Tensor q = heads(2, 3, 40, 16, at::kFloat), k = heads(2, 3, 40, 16, at::kFloat),
             v = heads(2, 3, 40, 16, at::kFloat);
  m.train();
  const at::Tensor before = rng_state();
  at::Tensor want = m.forward({q, k, v}).toTensor();
  const at::Tensor after = rng_state();
  REQUIRE(use_fast_attention(m) == 1);
  CHECK(m.get_method("forward").graph()->toString().find("mfsdp::sdpa") != std::string::npos);
  set_rng_state(before);
  at::Tensor got = m.forward({q, k, v}).toTensor();
  CHECK(at::equal(rng_state(), after));
  CHECK(((got - want).abs().max() / want.abs().max()).item<double>() < 2e-5);
  m.eval();
  at::Tensor plain = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true);
  CHECK(((m.forward({q, k, v}).toTensor() - plain).abs().max() / plain.abs().max()).item<double>() < 2e-5);
  CHECK(at::equal(rng_state(), after));  // nothing drawn in evaluation
}
