// mfsdp's CPU kernels against ATen's: GELU's tanh form (model/fast_ops.h), forward and backward,
// fp32 and bf16, every length's tail, the values where it saturates, and the graph rewrite that
// puts it into a TorchScript model (with autograd through it).
#include <ATen/ATen.h>

#include <torch/autograd.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/script.h>

#include <algorithm>
#include <cmath>

#include "catch.h"
#include "model/fast_ops.h"

using namespace mfsdp;

namespace {
// Largest |a - b| / max(|b|, floor) over the elements.
double worst(const at::Tensor& a, const at::Tensor& b, double floor) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs() / b.to(at::kDouble).abs().clamp_min(floor)).max().item<double>();
}

at::Tensor inputs(int64_t n, at::ScalarType dtype) {
  at::manual_seed(3);
  at::Tensor x = at::randn({n}) * 2.5;  // activations' range
  at::Tensor edges = at::tensor({0.0f, -0.0f, 1e-30f, -1e-30f, 3.0f, -3.0f, 9.0f, -9.0f, 20.0f, -20.0f, 300.0f, -300.0f,
                                 1e4f, -1e4f});
  return at::cat({x, edges}).to(dtype);
}
}  // namespace

// GELU and its derivative in double, through the sigmoid form (x/2 (1 + tanh u) cancels for
// negative x, in double too).
std::pair<at::Tensor, at::Tensor> truth(const at::Tensor& x32) {
  at::Tensor x = x32.to(at::kDouble);
  const double c0 = std::sqrt(2.0 / M_PI), c1 = 0.044715;
  at::Tensor u = c0 * (x + c1 * x * x * x);
  at::Tensor s = at::sigmoid(2 * u);
  return {x * s, s + 2 * x * s * (1 - s) * c0 * (1 + 3 * c1 * x * x)};
}

TEST_CASE("GELU tanh: mfsdp's kernel against the function in double and against ATen's, fp32") {
  for (int64_t n : {1, 15, 16, 17, 1000, 70001}) {
    at::Tensor x = inputs(n, at::kFloat), g = at::ones_like(x);
    INFO("n " << x.numel());
    auto [y, dy] = truth(x);
    // A few float roundings of the exact value, and never further from it than ATen's, which
    // loses digits where 1 + tanh(u) cancels (x below -2: ATen 1e-3 relative on the derivative,
    // and 0 for values under 1e-30). Relative errors with floors: 1e-20 for values, 1e-3 for slopes.
    const double fw = worst(gelu_tanh(x), y, 1e-20), bw = worst(gelu_tanh_backward(g, x), dy, 1e-3);
    const double fa = worst(at::gelu(x, "tanh"), y, 1e-20), ba = worst(at::gelu_backward(g, x, "tanh"), dy, 1e-3);
    CHECK(fw < 1e-5);
    CHECK(bw < 1e-4);
    CHECK(fw <= std::max(fa, 1e-6));
    CHECK(bw <= std::max(ba, 1e-6));
    CHECK(gelu_tanh(x).isfinite().all().item<bool>());
  }
  // Saturation: x for large x, -0 or a value under 1e-30 for very negative x; slope 1 and 0.
  at::Tensor big = at::tensor({30.0f, -30.0f, 1e4f, -1e4f});
  at::Tensor y = gelu_tanh(big), d = gelu_tanh_backward(at::ones_like(big), big);
  CHECK(y[0].item<float>() == 30.0f);
  CHECK(std::fabs(y[1].item<float>()) < 1e-30f);
  CHECK(y[2].item<float>() == 1e4f);
  CHECK(d[0].item<float>() == 1.0f);
  CHECK(std::fabs(d[1].item<float>()) < 1e-30f);
  CHECK(std::isnan(gelu_tanh(at::tensor({NAN})).item<float>()));
}

TEST_CASE("GELU tanh: bf16 within one bf16 rounding of ATen's") {
  at::Tensor x = inputs(5000, at::kBFloat16), g = at::randn_like(x.to(at::kFloat)).to(at::kBFloat16);
  // Both compute in fp32 and round once to bf16 (8 bits of mantissa: 2^-8 relative per rounding).
  CHECK(worst(gelu_tanh(x), at::gelu(x, "tanh"), 1e-2) <= 1.0 / 128);
  CHECK(worst(gelu_tanh_backward(g, x), at::gelu_backward(g, x, "tanh"), 1e-2) <= 1.0 / 128);
  CHECK(gelu_tanh(at::tensor({NAN}).to(at::kBFloat16)).isnan().all().item<bool>());
}

TEST_CASE("GELU tanh: other dtypes and non-contiguous inputs") {
  at::Tensor x = at::randn({64, 33}, at::kDouble);
  CHECK(at::equal(gelu_tanh(x), at::gelu(x, "tanh")));  // ATen's own path
  at::Tensor t = at::randn({33, 64}).t();               // strided
  CHECK(worst(gelu_tanh(t), truth(t).first, 1e-20) < 1e-5);
}

TEST_CASE("GELU tanh: the graph rewrite replaces aten::gelu(x, 'tanh') and gradients flow through it") {
  torch::jit::Module m("m");
  m.define(R"(
    def forward(self, x):
        return torch.gelu(x, approximate="tanh") + torch.gelu(x)
  )");
  at::Tensor x = at::randn({8, 40}).requires_grad_(true);
  at::Tensor want = m.forward({x}).toTensor();
  at::Tensor gw = torch::autograd::grad({want.sum()}, {x})[0];
  REQUIRE(use_fast_gelu(m) == 1);  // the tanh one only; the erf GELU stays ATen's
  at::Tensor got = m.forward({x}).toTensor();
  at::Tensor gg = torch::autograd::grad({got.sum()}, {x})[0];
  CHECK(worst(got, want, 1e-2) < 1e-4);  // against ATen's (see above)
  CHECK(worst(gg, gw, 1e-2) < 1e-4);
  CHECK(m.get_method("forward").graph()->toString().find("mfsdp::gelu_tanh") != std::string::npos);
}

TEST_CASE("RMS scaling: mfsdp's kernel against ATen's ops, forward and backward") {
  at::manual_seed(5);
  for (int64_t d : {7, 16, 64, 257}) {  // (d 1 is degenerate: a slope of eps / (x^2 + eps)^1.5, all cancellation)
    at::Tensor x = (at::randn({3, 5, d}) * 3).requires_grad_(true);
    at::Tensor g = at::randn({3, 5, d});
    const double eps = 1e-6;
    at::Tensor want = x * at::rsqrt(x.pow(2).mean({-1}, true) + eps);
    at::Tensor gw = torch::autograd::grad({want}, {x}, {g})[0];
    at::Tensor got = rms_scale(x, eps);
    at::Tensor gg = torch::autograd::grad({got}, {x}, {g})[0];
    INFO("d " << d);
    CHECK(worst(got, want, 1e-6) < 2e-6);
    CHECK(worst(gg, gw, 1e-3) < 2e-5);
  }
  // Other dtypes: ATen's ops themselves.
  at::Tensor xd = at::randn({4, 9}, at::kDouble);
  CHECK(at::allclose(rms_scale(xd, 1e-5), xd * at::rsqrt(xd.pow(2).mean({-1}, true) + 1e-5)));
}

TEST_CASE("RMS scaling: the graph rewrite finds RMSNorm's ops, scripted and traced-style, and nothing else") {
  torch::jit::Module m("m");
  m.register_attribute("eps", c10::FloatType::get(), 1e-5);
  m.define(R"(
    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        z = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.tensor(1e-6))
        w = x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)
        return y + z + w
  )");
  at::Tensor x = at::randn({6, 32}).requires_grad_(true);
  at::Tensor want = m.forward({x}).toTensor();
  at::Tensor gw = torch::autograd::grad({want.sum()}, {x})[0];
  // torch.tensor(1e-6) folded into a constant tensor, as a trace records HF's eps.
  auto graph = m.get_method("forward").graph();
  torch::jit::ConstantPropagation(graph);
  REQUIRE(use_fast_rms_norm(m) == 2);  // not the mean over dim 0
  at::Tensor got = m.forward({x}).toTensor();
  at::Tensor gg = torch::autograd::grad({got.sum()}, {x})[0];
  CHECK(worst(got, want, 1e-3) < 2e-6);
  CHECK(worst(gg, gw, 1e-3) < 2e-5);
}

TEST_CASE("GELU tanh spelled out (transformers' gelu_new) is replaced too, and a near miss is not") {
  torch::jit::Module m("m");
  m.define(R"(
    def forward(self, x):
        a = 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))
        b = 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.05 * torch.pow(x, 3.0))))
        return a + b
  )");
  at::Tensor x = (at::randn({8, 40}) * 2).requires_grad_(true);
  at::Tensor want = m.forward({x}).toTensor();
  at::Tensor gw = torch::autograd::grad({want.sum()}, {x})[0];
  REQUIRE(use_fast_gelu(m) == 1);  // 0.05 is not GELU's 0.044715
  at::Tensor got = m.forward({x}).toTensor();
  at::Tensor gg = torch::autograd::grad({got.sum()}, {x})[0];
  CHECK(worst(got, want, 1e-2) < 1e-4);
  CHECK(worst(gg, gw, 1e-2) < 1e-4);
  const std::string graph = m.get_method("forward").graph()->toString();
  CHECK(graph.find("mfsdp::gelu_tanh") != std::string::npos);
  CHECK(graph.find("aten::tanh") != std::string::npos);  // the near miss stays
}
