// mfsdp's CPU kernels against ATen's: GELU's tanh form (model/fast_ops.h), forward and backward,
// fp32 and bf16, every length's tail, the values where it saturates, and the graph rewrite that
// puts it into a TorchScript model (with autograd through it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <torch/autograd.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/script.h>

#include <algorithm>
#include <functional>
#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "catch.h"
#include "kernel_refs.h"
#include "model/cpu_attention.h"
#include "model/cpu_blas.h"
#include "model/cpu_kernels.h"
#include "model/fast_ops.h"
#include "model/linear.h"
#include "train/system.h"

using namespace mfsdp;
using mfsdp::test::rotate_half_ref;
using mfsdp::test::scaled;

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

// at::parallel_for compiled in mfsdp's translation units (as its kernels and optimizer passes are)
// splits over ATen's threads: without -fopenmp there it silently ran on one (lib/CMakeLists.txt).
TEST_CASE("mfsdp's parallel loops reach every intra-op thread") {
  const int before = at::get_num_threads();
  for (int n : {1, 2, 3}) {
    at::set_num_threads(n);
    CHECK(mfsdp::parallel_loop_threads() == n);
  }
  at::set_num_threads(before);
}

TEST_CASE("cross entropy rows: logsumexp_row and xent_grad_row against ATen, in place and not, non-finite rows") {
  at::Generator gen = at::detail::createCPUGenerator(5);
  for (int64_t n : {1, 15, 16, 17, 1000, 50257}) {
    INFO("n " << n);
    const at::Tensor x = at::randn({n}, gen, at::kFloat) * 6;
    const float* p = x.const_data_ptr<float>();
    const double ref = at::logsumexp(x.to(at::kDouble), 0).item<double>();
    const float lse = mfsdp::logsumexp_row(p, n);
    CHECK(std::abs(lse - ref) <= 2e-6 * std::max(1.0, std::abs(ref)));
    // (softmax - onehot * 0.75) * 0.5 at target n / 2, against the same in double.
    const int64_t t = n / 2;
    at::Tensor want = at::exp(x.to(at::kDouble) - ref);
    want[t] -= 0.75;
    want = want * 0.5;
    at::Tensor out = at::empty({n}, at::kFloat), inplace = x.clone();
    mfsdp::xent_grad_row(p, lse, t, 0.75f, 0.5f, out.mutable_data_ptr<float>(), n);
    mfsdp::xent_grad_row(inplace.const_data_ptr<float>(), lse, t, 0.75f, 0.5f, inplace.mutable_data_ptr<float>(), n);
    CHECK(out.equal(inplace));
    // Probabilities are at most 1; the fp32 log-sum-exp's own rounding (an ulp of about 24 at n
    // 50257: 2e-6) moves them by up to that relative amount, as ATen's fp32 softmax does.
    CHECK((out.to(at::kDouble) - want).abs().max().item<double>() <= 1e-5);
    // A target outside the row (another rank's column under vocabulary parallelism): no onehot.
    mfsdp::xent_grad_row(p, lse, -1, 1.0f, 1.0f, out.mutable_data_ptr<float>(), n);
    CHECK((out.to(at::kDouble) - at::exp(x.to(at::kDouble) - ref)).abs().max().item<double>() <= 1e-5);
  }
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> row(40, 0.5f);
  row[7] = std::nanf("");
  CHECK(std::isnan(mfsdp::logsumexp_row(row.data(), 40)));
  row[7] = inf;
  CHECK(mfsdp::logsumexp_row(row.data(), 40) == inf);
  std::vector<float> low(40, -inf);
  CHECK(mfsdp::logsumexp_row(low.data(), 40) == -inf);
  // A non-finite log-sum-exp makes the gradient row non-finite (the step's gradient norm then says
  // so), never finite values from the clamped exp.
  std::vector<float> g(40);
  mfsdp::xent_grad_row(row.data(), inf, 3, 1.0f, 1.0f, g.data(), 40);
  CHECK(std::isnan(g[7]));
  mfsdp::xent_grad_row(row.data(), std::nanf(""), 3, 1.0f, 1.0f, g.data(), 40);
  CHECK(std::all_of(g.begin(), g.end(), [](float v) { return std::isnan(v); }));
}

TEST_CASE("cross entropy rows on bf16 logits: the float kernels' values on the widened row, rounded once") {
  at::Generator gen = at::detail::createCPUGenerator(6);
  for (int64_t n : {1, 31, 32, 33, 1000, 32000, 50257}) {
    INFO("n " << n);
    const at::Tensor xb = (at::randn({n}, gen, at::kFloat) * 6).to(at::kBFloat16);
    const at::Tensor xf = xb.to(at::kFloat);
    const uint16_t* pb = reinterpret_cast<const uint16_t*>(xb.const_data_ptr<at::BFloat16>());
    const double ref = at::logsumexp(xf.to(at::kDouble), 0).item<double>();
    const float lse = mfsdp::logsumexp_row_bf16(pb, n);
    CHECK(std::abs(lse - ref) <= 2e-6 * std::max(1.0, std::abs(ref)));
    // The gradient: (softmax - 0.75 onehot) * 0.5 in double, rounded to bf16: within one bf16 ulp
    // (the float exp's rounding can cross a rounding boundary), and in place the same bits.
    const int64_t t = n / 3;
    at::Tensor want = at::exp(xf.to(at::kDouble) - ref);
    want[t] -= 0.75;
    want = want * 0.5;
    at::Tensor out = at::empty({n}, at::kBFloat16), inplace = xb.clone();
    mfsdp::xent_grad_row_bf16(pb, lse, t, 0.75f, 0.5f, reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>()), n);
    uint16_t* ip = reinterpret_cast<uint16_t*>(inplace.mutable_data_ptr<at::BFloat16>());
    mfsdp::xent_grad_row_bf16(ip, lse, t, 0.75f, 0.5f, ip, n);
    CHECK(out.equal(inplace));
    const at::Tensor err = (out.to(at::kDouble) - want).abs();
    CHECK((err <= want.abs() * (1.0 / 128) + 1e-30).all().item<bool>());
    // Rounded to nearest: the float kernel's values rounded by ATen are the same bits but for ties
    // of the exp's last float bit; count them.
    at::Tensor f = at::empty({n}, at::kFloat);
    mfsdp::xent_grad_row(xf.const_data_ptr<float>(), lse, t, 0.75f, 0.5f, f.mutable_data_ptr<float>(), n);
    CHECK(out.ne(f.to(at::kBFloat16)).sum().item<int64_t>() <= std::max<int64_t>(1, n / 1000));
  }
  // Non-finite rows stay non-finite, as the float kernel's.
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<uint16_t> row(40, 0x3F00);  // 0.5
  row[7] = 0x7FC0;                        // NaN
  CHECK(std::isnan(mfsdp::logsumexp_row_bf16(row.data(), 40)));
  row[7] = 0x7F80;  // +inf
  CHECK(mfsdp::logsumexp_row_bf16(row.data(), 40) == inf);
  std::vector<uint16_t> low(40, 0xFF80);  // -inf
  CHECK(mfsdp::logsumexp_row_bf16(low.data(), 40) == -inf);
  std::vector<uint16_t> g(40);
  mfsdp::xent_grad_row_bf16(row.data(), std::nanf(""), 3, 1.0f, 1.0f, g.data(), 40);
  CHECK(std::all_of(g.begin(), g.end(), [](uint16_t v) { return (v & 0x7F80) == 0x7F80 && (v & 0x7F) != 0; }));
}

TEST_CASE("mm_bf16_into_f32 and col_sums_bf16: bf16 products and column sums into fp32 against the same in "
          "double, transposed operands, accumulation, empty sizes") {
  REQUIRE(mfsdp::cpu_bf16_products_available());
  at::Generator gen = at::detail::createCPUGenerator(8);
  auto bf = [&](int64_t r, int64_t c) { return at::randn({r, c}, gen, at::kFloat).to(at::kBFloat16); };
  for (const auto& [m, k, n] : std::vector<std::array<int64_t, 3>>{{1, 1, 1}, {7, 33, 5}, {64, 1024, 96}, {300, 17, 1}}) {
    INFO(m << " x " << k << " x " << n);
    // a as the weight gradient reads dy: a transposed view; b contiguous; and a sliced-column layout
    // that is neither (copied).
    const at::Tensor a = bf(k, m).t(), b = bf(k, n), a2 = bf(m, 2 * k).narrow(1, 0, k).t().contiguous().t();
    const at::Tensor want = at::mm(a.to(at::kDouble), b.to(at::kDouble));
    at::Tensor c = at::full({m, n}, 7.0f);
    mfsdp::mm_bf16_into_f32(c, a, b, false);
    // fp32 accumulation of exact products of bf16 values: fp32 rounding only.
    CHECK((c.to(at::kDouble) - want).abs().max().item<double>() <= 1e-5 * std::max(1.0, want.abs().max().item<double>()) * k);
    at::Tensor acc = c.clone();
    mfsdp::mm_bf16_into_f32(acc, a, b, true);
    CHECK((acc.to(at::kDouble) - 2 * want).abs().max().item<double>() <= 2e-5 * std::max(1.0, want.abs().max().item<double>()) * k);
    at::Tensor c2 = at::empty({m, n});
    mfsdp::mm_bf16_into_f32(c2, a2, b, false);
    const at::Tensor want2 = at::mm(a2.to(at::kDouble), b.to(at::kDouble));
    CHECK((c2.to(at::kDouble) - want2).abs().max().item<double>() <= 1e-5 * std::max(1.0, want2.abs().max().item<double>()) * k);
    // Into a view of a larger buffer (a bucket's slice), rows of the view's stride.
    at::Tensor big = at::zeros({m, n + 3});
    at::Tensor view = big.narrow(1, 0, n);
    mfsdp::mm_bf16_into_f32(view, a, b, false);
    CHECK(view.equal(c));
    CHECK(big.narrow(1, n, 3).eq(0).all().item<bool>());
  }
  // A bias's gradient from bf16 rows into fp32: column sums, written or added, rows ld apart.
  for (int64_t n : {1, 15, 16, 17, 768}) {
    INFO("columns " << n);
    const at::Tensor rows = bf(300, n + 5).narrow(1, 0, n);
    const at::Tensor want = rows.to(at::kDouble).sum(0);
    at::Tensor out = at::full({n}, 3.0f);
    const uint16_t* x = reinterpret_cast<const uint16_t*>(rows.const_data_ptr<at::BFloat16>());
    mfsdp::col_sums_bf16(x, rows.stride(0), 300, n, out.mutable_data_ptr<float>(), false);
    CHECK((out.to(at::kDouble) - want).abs().max().item<double>() <= 1e-4);
    mfsdp::col_sums_bf16(x, rows.stride(0), 300, n, out.mutable_data_ptr<float>(), true);
    CHECK((out.to(at::kDouble) - 2 * want).abs().max().item<double>() <= 2e-4);
  }
  at::Tensor c = at::full({3, 4}, 5.0f);
  mfsdp::mm_bf16_into_f32(c, bf(3, 0), bf(0, 4), true);  // K = 0: accumulating adds nothing
  CHECK(c.eq(5).all().item<bool>());
  mfsdp::mm_bf16_into_f32(c, bf(3, 0), bf(0, 4), false);
  CHECK(c.eq(0).all().item<bool>());
  CHECK_THROWS(mfsdp::mm_bf16_into_f32(c, bf(3, 2), bf(3, 4), false));
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

TEST_CASE("col_sums_f32: a bias's gradient from fp32 rows, written or added, rows ld apart, against double") {
  at::Generator gen = at::detail::createCPUGenerator(11);
  for (int64_t n : {1, 15, 16, 17, 768}) {
    INFO("columns " << n);
    const at::Tensor rows = at::randn({300, n + 5}, gen, at::kFloat).narrow(1, 0, n);
    const at::Tensor want = rows.to(at::kDouble).sum(0);
    at::Tensor out = at::full({n}, 3.0f);
    mfsdp::col_sums_f32(rows.const_data_ptr<float>(), rows.stride(0), 300, n, out.mutable_data_ptr<float>(), false);
    CHECK((out.to(at::kDouble) - want).abs().max().item<double>() <= 1e-4);
    mfsdp::col_sums_f32(rows.const_data_ptr<float>(), rows.stride(0), 300, n, out.mutable_data_ptr<float>(), true);
    CHECK((out.to(at::kDouble) - 2 * want).abs().max().item<double>() <= 2e-4);
  }
  at::Tensor out = at::full({4}, 3.0f);
  mfsdp::col_sums_f32(nullptr, 4, 0, 4, out.mutable_data_ptr<float>(), false);  // no rows: zeros
  CHECK(out.eq(0).all().item<bool>());
}

TEST_CASE("The linear layers' bias gradient from any dy layout: contiguous, broadcast rows, transposed, one row") {
  // The graph's addmm(b, x, w) (HF's Conv1D) rewritten into mfsdp::linear_t, whose bias gradient is
  // mfsdp::linear's (no sink: its gradients are autograd's),
  // against the same module unrewritten. Three losses whose gradients reach the layer as a
  // contiguous dy, as rows 0 apart (the backward of a sum over the rows: an expanded [40]), and as
  // a transposed copy.
  auto module = [] {
    torch::jit::Module m("m");
    m.define(R"(
      def forward(self, x, w, b, up, loss: int):
          y = torch.addmm(b, x, w)
          if loss == 0:
              return (y * up).sum()
          if loss == 1:
              return (y.sum(0) * up[0]).sum()
          return (y.t().contiguous().t() * up).sum()
    )");
    return m;
  };
  torch::jit::Module ref = module(), ours = module();
  REQUIRE(use_sink_linear(ours).linear == 1);
  REQUIRE(ours.get_method("forward").graph()->toString().find("mfsdp::linear_t") != std::string::npos);
  at::Generator gen = at::detail::createCPUGenerator(13);
  for (int64_t rows : {1, 5, 64}) {
    const at::Tensor x0 = at::randn({rows, 24}, gen, at::kFloat), w0 = at::randn({24, 40}, gen, at::kFloat);
    const at::Tensor b0 = at::randn({40}, gen, at::kFloat), up = at::randn({rows, 40}, gen, at::kFloat);
    for (int64_t loss = 0; loss < 3; ++loss) {
      INFO("rows " << rows << ", loss " << loss);
      auto grads = [&](torch::jit::Module& m) {
        at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
                   b = b0.clone().requires_grad_(true);
        return torch::autograd::grad({m.forward({x, w, b, up, loss}).toTensor()}, {x, w, b});
      };
      const auto g = grads(ours), r = grads(ref);
      for (int i = 0; i < 3; ++i) CHECK(worst(g[i], r[i], 1e-3) < 1e-5);
    }
  }
}

// mfsdp::gelu_tanh through the dispatcher: its autograd kernel (fast_ops.h's gelu_tanh is the forward).
at::Tensor gelu_tanh_autograd_for_tests(const at::Tensor& x) {
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mfsdp::gelu_tanh", "").typed<at::Tensor(const at::Tensor&)>();
  return op.call(x);
}

TEST_CASE("Backwards that write over their incoming gradient: only where nothing else can read it") {
  // GELU, SwiGLU's gate: the gradient written over autograd's incoming one when may_overwrite_grad
  // allows. A gradient that two nodes receive (an add's backward hands both the same tensor), a
  // retained .grad of the op's output, and a gradient the caller holds must come out unchanged, and
  // every result must equal ATen's.
  at::Generator gen = at::detail::createCPUGenerator(12);
  const at::Tensor a0 = at::randn({16, 64}, gen, at::kFloat), b0 = at::randn({16, 64}, gen, at::kFloat);
  const at::Tensor up = at::randn({16, 64}, gen, at::kFloat);
  auto run = [&](bool ours) {
    at::Tensor a = a0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
    at::Tensor ga = ours ? gelu_tanh_autograd_for_tests(a) : at::gelu(a, "tanh");
    at::Tensor gb = ours ? gelu_tanh_autograd_for_tests(b) : at::gelu(b, "tanh");
    at::Tensor s = ours ? silu_mul(a, b) : at::silu(a) * b;
    ga.retain_grad();
    at::Tensor out = (ga + gb) * 1.5 + s;  // ga and gb get the same gradient tensor
    const at::Tensor g = up.clone();
    out.backward(g);
    CHECK(at::equal(g, up));  // the caller's gradient untouched
    return std::vector<at::Tensor>{a.grad(), b.grad(), ga.grad()};
  };
  const auto want = run(false), got = run(true);
  CHECK(worst(got[0], want[0], 1e-2) < 1e-4);
  CHECK(worst(got[1], want[1], 1e-2) < 1e-4);
  CHECK(at::equal(got[2], want[2]));  // the retained gradient is the upstream one, not GELU's result
  CHECK(at::allclose(got[2], up * 1.5));
  {  // written over g, and the same values as into a fresh tensor
    at::Tensor g2 = up.clone();
    const at::Tensor fresh = gelu_tanh_backward(g2, a0, false);
    const at::Tensor over = gelu_tanh_backward(g2, a0, true);
    CHECK(over.is_same(g2));
    CHECK(at::equal(over, fresh));
  }
  {  // the rule itself
    at::NoGradGuard ng;
    at::Tensor t = at::ones({4, 4});
    at::Tensor copy = t;  // as in a backward: its argument and autograd's list hold the tensor
    CHECK(may_overwrite_grad(t));
    at::Tensor other = t;  // a third holder: someone else
    CHECK_FALSE(may_overwrite_grad(t));
    at::Tensor base = at::ones({4, 8});
    at::Tensor v = base.narrow(1, 0, 4).contiguous();  // a copy: its own storage
    CHECK(may_overwrite_grad(v));
    CHECK_FALSE(may_overwrite_grad(base.t()));  // not contiguous
  }
  at::Tensor t = at::ones({4, 4});
  CHECK_FALSE(may_overwrite_grad(t));  // grad mode on: a double backward may record it
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

TEST_CASE("RMSNorm's weight joins the scaling kernel: HF's `weight * x.to(dtype)` and the bare product, "
          "gradients of x and the weight on 1 and 2 threads; a cast to bf16 and a weight of another shape stay ATen's") {
  torch::jit::Module m("m");
  m.register_parameter("w", (at::randn({64}) * 0.5 + 1).requires_grad_(true), false);
  m.register_parameter("v", (at::randn({64}) * 0.5 + 1).requires_grad_(true), false);
  m.register_attribute("eps", c10::FloatType::get(), 1e-6);
  m.define(R"(
    def forward(self, x, m):
        xf = x.float()
        h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        a = self.w * h.to(6)  # 6: torch.float32
        h2 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        b = h2 * self.v
        h3 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        c = self.w.to(15) * h3.to(15)  # 15: torch.bfloat16
        h4 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        d = h4 * m
        # mfsdp's scripted RMSNorm (scripts/export_model.py): a cast to a dtype the graph reads
        h5 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        e = h5.to(x.dtype) * self.v
        return a + b + c.float() + d + e
  )");
  at::manual_seed(11);
  const at::Tensor w = m.attr("w").toTensor(), v = m.attr("v").toTensor();
  const int threads = at::get_num_threads();
  for (int t : {1, 2}) {
    at::set_num_threads(t);
    for (int64_t rows : {1, 3, 300}) {
      torch::jit::Module mc = m.clone();
      const at::Tensor wc = mc.attr("w").toTensor(), vc = mc.attr("v").toTensor();
      at::Tensor x = (at::randn({rows, 64}) * 2).requires_grad_(true);
      at::Tensor full = at::randn({rows, 64});  // a multiplier of x's shape: not a weight
      at::Tensor want = mc.forward({x, full}).toTensor();
      auto gw = torch::autograd::grad({want.sum()}, {x, wc, vc});
      REQUIRE(use_fast_rms_norm(mc) == 5);
      const std::string graph = mc.get_method("forward").graph()->toString();
      // a, b and e take the weight (the bf16 cast of c and the full-shaped d are rewritten too, and
      // computed as before at run time: the dtype, or a multiplier that is not one per column):
      // no product is left.
      CHECK(graph.find("mfsdp::rms_norm_weight") != std::string::npos);
      CHECK(graph.find("aten::mul") == std::string::npos);
      at::Tensor got = mc.forward({x, full}).toTensor();
      auto gg = torch::autograd::grad({got.sum()}, {x, wc, vc});
      INFO("threads " << t << ", rows " << rows);
      CHECK(worst(got, want, 1e-2) < 2e-6);
      // x's gradient sums four norms' (one through bf16), each r u - c x: where they cancel to
      // under 1e-2 (of gradients of order 1), the bound is absolute, 2e-7.
      CHECK(worst(gg[0], gw[0], 1e-2) < 2e-5);
      CHECK(worst(gg[1], gw[1], 1e-3) < 2e-5);
      CHECK(worst(gg[2], gw[2], 1e-3) < 2e-5);
    }
  }
  at::set_num_threads(threads);
  // The kernel against the two ops it replaces, bit for bit forward: (x r) w rounds as HF's does.
  at::Tensor x = at::randn({5, 64}) * 3;
  at::Tensor ref = w * rms_scale(x, 1e-6);
  torch::jit::Module one("one");
  one.register_parameter("w", w.detach().clone(), false);
  one.define(R"(
    def forward(self, x):
        return self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
  )");
  REQUIRE(use_fast_rms_norm(one) == 1);
  at::NoGradGuard ng;
  CHECK(at::equal(one.forward({x}).toTensor(), ref.detach()));
}

TEST_CASE("aten::rms_norm (nn.RMSNorm, F.rms_norm) through mfsdp's kernel: gradients of x and the weight; "
          "other calls are ATen's own") {
  torch::jit::Module m("m");
  m.register_parameter("w", (at::randn({32}) * 0.5 + 1).requires_grad_(true), false);
  m.define(R"(
    def forward(self, x):
        a = torch.rms_norm(x, [32], self.w, 1e-5)
        b = torch.rms_norm(x, [32], None, None)
        c = torch.rms_norm(x, [6, 32], None, 1e-5)
        return a + b + c
  )");
  at::manual_seed(9);
  at::Tensor x = (at::randn({6, 32}) * 2).requires_grad_(true);
  const at::Tensor w = m.attr("w").toTensor();
  at::Tensor want = m.forward({x}).toTensor();
  auto gw = torch::autograd::grad({want.sum()}, {x, w});
  // Not the [6, 32] call: two normalised dimensions. (nn.RMSNorm scripted calls F.rms_norm, a
  // prim::CallFunction: titan_rms_norm_line, tests/oracle/oracle_tests.cmake.)
  REQUIRE(use_fast_rms_norm_op(m) == 2);
  at::Tensor got = m.forward({x}).toTensor();
  auto gg = torch::autograd::grad({got.sum()}, {x, w});
  CHECK(worst(got, want, 1e-3) < 2e-6);
  CHECK(worst(gg[0], gw[0], 1e-3) < 2e-5);
  CHECK(worst(gg[1], gw[1], 1e-3) < 2e-5);
  {  // without grad: the same values
    at::NoGradGuard ng;
    CHECK(worst(m.forward({x}).toTensor(), want, 1e-3) < 2e-6);
  }
  // bf16 (not the kernel's): ATen's rms_norm bit for bit.
  m.to(at::kBFloat16);
  at::Tensor xb = x.detach().to(at::kBFloat16);
  const at::Tensor wb = m.attr("w").toTensor();
  at::Tensor ref = at::rms_norm(xb, {32}, wb, 1e-5) + at::rms_norm(xb, {32}, std::nullopt, std::nullopt) +
                   at::rms_norm(xb, {6, 32}, std::nullopt, 1e-5);
  CHECK(at::equal(m.forward({xb}).toTensor(), ref));
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

TEST_CASE("SwiGLU gate: silu(a) * b in one pass, forward and backward, against ATen's") {
  at::manual_seed(7);
  for (int64_t n : {1, 15, 16, 17, 1000, 70001}) {
    at::Tensor a = (at::randn({n}) * 3).requires_grad_(true), b = at::randn({n}).requires_grad_(true);
    at::Tensor g = at::randn({n});
    at::Tensor want = at::silu(a) * b;
    auto gw = torch::autograd::grad({want}, {a, b}, {g});
    at::Tensor got = silu_mul(a, b);
    auto gg = torch::autograd::grad({got}, {a, b}, {g});
    INFO("n " << n);
    CHECK(scaled(got, want) < 1e-6);
    CHECK(scaled(gg[0], gw[0]) < 1e-6);
    CHECK(scaled(gg[1], gw[1]) < 1e-6);
  }
  // Saturation and NaN: silu(a) -> a for large a, -> 0 for very negative a; NaN stays NaN.
  at::Tensor a = at::tensor({100.0f, -100.0f, 1e4f, -1e4f, NAN}), b = at::ones({5});
  at::Tensor y = silu_mul(a, b);
  CHECK(y[0].item<float>() == 100.0f);
  CHECK(std::fabs(y[1].item<float>()) < 1e-30f);
  CHECK(std::isnan(y[4].item<float>()));
  // bf16: computed in fp32 and rounded once (ATen rounds silu(a) and the product: two roundings).
  at::Tensor ah = (at::randn({4001}) * 3).to(at::kBFloat16).requires_grad_(true);
  at::Tensor bh = at::randn({4001}).to(at::kBFloat16).requires_grad_(true);
  at::Tensor gh = at::randn({4001}).to(at::kBFloat16);
  auto exact = [&](const at::Tensor& x) { return x.detach().to(at::kDouble); };
  at::Tensor s = at::sigmoid(exact(ah));
  CHECK(worst(silu_mul(ah, bh), exact(ah) * s * exact(bh), 1e-2) <= 1.0 / 256);
  auto gg = torch::autograd::grad({silu_mul(ah, bh)}, {ah, bh}, {gh});
  CHECK(worst(gg[1], exact(gh) * exact(ah) * s, 1e-2) <= 1.0 / 256);
  CHECK(worst(gg[0], exact(gh) * exact(bh) * s * (1 + exact(ah) * (1 - s)), 1e-2) <= 1.0 / 256);
  // Broadcasting and other dtypes take ATen's ops.
  at::Tensor ad = at::randn({4, 9}, at::kDouble), bb = at::randn({1, 9}, at::kDouble);
  CHECK(at::equal(silu_mul(ad, bb), at::silu(ad) * bb));
}

TEST_CASE("Rotary embedding: x cos + rotate_half(x) sin in one pass, against ATen's, strided and broadcast") {
  at::manual_seed(9);
  for (int64_t d : {2, 8, 34, 64, 130}) {
    // q as attention makes it: [B, T, H, D] memory viewed as [B, H, T, D]; cos and sin [B, 1, T, D].
    at::Tensor x = at::randn({2, 5, 3, d}).transpose(1, 2).requires_grad_(true);
    at::Tensor ang = at::randn({2, 1, 5, d});
    at::Tensor cos = ang.cos(), sin = ang.sin(), g = at::randn({2, 3, 5, d});
    at::Tensor want = x * cos + rotate_half_ref(x) * sin;
    at::Tensor gw = torch::autograd::grad({want}, {x}, {g})[0];
    at::Tensor got = rotary(x, cos, sin, 3, -1, -1);
    at::Tensor gg = torch::autograd::grad({got}, {x}, {g})[0];
    INFO("d " << d);
    CHECK(got.sizes() == want.sizes());
    CHECK(scaled(got, want) < 1e-6);
    CHECK(scaled(gg, gw) < 1e-6);
    // cos and sin shared by the batch ([1, 1, T, D]), and chunk's split (the same for even d).
    at::Tensor c1 = cos.slice(0, 0, 1), s1 = sin.slice(0, 0, 1);
    CHECK(scaled(rotary(x, c1, s1, -1, -2, -1), x * c1 + rotate_half_ref(x) * s1) < 1e-6);
  }
  // bf16 within a rounding of the exact value.
  at::Tensor xh = at::randn({2, 4, 6, 64}).to(at::kBFloat16);
  at::Tensor ah = at::randn({2, 1, 6, 64});
  at::Tensor ch = ah.cos().to(at::kBFloat16), sh = ah.sin().to(at::kBFloat16);
  auto dbl = [](const at::Tensor& t) { return t.to(at::kDouble); };
  CHECK(scaled(rotary(xh, ch, sh, 3, 32, -1), dbl(xh) * dbl(ch) + rotate_half_ref(dbl(xh)) * dbl(sh)) <= 1.0 / 256);
}

TEST_CASE("Rotary embedding: what the kernel does not take computes what the graph did") {
  at::manual_seed(11);
  auto ref = [](const at::Tensor& x, const at::Tensor& c, const at::Tensor& s, int64_t dim, int64_t at) {
    return x * c + at::cat({-x.slice(dim, at), x.slice(dim, 0, at)}, -1) * s;
  };
  at::Tensor x = at::randn({2, 3, 7}), c = at::randn({7}), s = at::randn({7});
  CHECK(at::allclose(rotary(x, c, s, -1, -1, -1), ref(x, c, s, -1, 3)));  // odd size, floor split
  CHECK(at::allclose(rotary(x, c, s, -1, -2, -1), ref(x, c, s, -1, 4)));  // odd size, chunk's split
  at::Tensor y = at::randn({2, 3, 8});
  at::Tensor c8 = at::randn({8}), s8 = at::randn({8});
  CHECK(at::allclose(rotary(y, c8, s8, 2, 3, -1), ref(y, c8, s8, 2, 3)));  // a split not at the half
  // Tables that need a gradient get it (ATen's ops).
  at::Tensor ct = at::randn({8}).requires_grad_(true);
  at::Tensor out = rotary(y, ct, s8, -1, -1, -1);
  at::Tensor gc = torch::autograd::grad({out.sum()}, {ct})[0];
  CHECK(at::allclose(gc, y.sum(at::IntArrayRef{0, 1})));
}

TEST_CASE("SwiGLU and rotary graph rewrites: chunk and slice forms, operand orders, near misses left alone") {
  torch::jit::Module m("m");
  m.define(R"(
    def forward(self, x, cos, sin, a, b):
        x1, x2 = x.chunk(2, dim=-1)
        y = x * cos + torch.cat((-x2, x1), dim=-1) * sin
        h = x.size(-1) // 2
        z = sin * torch.cat((-x[..., h:], x[..., :h]), dim=-1) + cos * x
        w = x * cos + torch.cat((x[..., h:], -x[..., :h]), dim=-1) * sin
        v = a * cos + torch.cat((-x2, x1), dim=-1) * sin
        s = torch.silu(a) * b + b * torch.silu(b)
        return y + z + w + v, s
  )");
  at::Tensor x = at::randn({2, 3, 5, 16}).requires_grad_(true);
  at::Tensor ang = at::randn({2, 1, 5, 16});
  at::Tensor a = at::randn({2, 3, 5, 16}).requires_grad_(true), b = at::randn({2, 3, 5, 16}).requires_grad_(true);
  std::vector<c10::IValue> in = {x, ang.cos(), ang.sin(), a, b};
  auto run = [&] {
    auto out = m.forward(in).toTuple();
    at::Tensor r = out->elements()[0].toTensor(), s = out->elements()[1].toTensor();
    auto gr = torch::autograd::grad({r.sum() + s.sum()}, {x, a, b});
    return std::vector<at::Tensor>{r, s, gr[0], gr[1], gr[2]};
  };
  auto want = run();
  REQUIRE(use_fast_rotary(m) == 2);  // not w (the wrong half negated), not v (a * cos: another x)
  REQUIRE(use_fast_swiglu(m) == 2);
  auto got = run();
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("output " << i);
    CHECK(scaled(got[i], want[i]) < 1e-6);
  }
  const std::string graph = m.get_method("forward").graph()->toString();
  CHECK(graph.find("mfsdp::rotary") != std::string::npos);
  CHECK(graph.find("mfsdp::silu_mul") != std::string::npos);
  CHECK(graph.find("aten::silu") == std::string::npos);
}

TEST_CASE("The GPU kernels' check (verify_device_fast_ops), run on the CPU's kernels: all three agree with ATen") {
  // On a GPU this decides which kernels the graphs use; here it runs the same comparisons (fp32 and
  // bf16, forward and backward, a transposed query with broadcast tables) on the CPU kernels.
  const DeviceKernelCheck c = verify_device_fast_ops(c10::Device(c10::kCPU));
  INFO(c.report);
  CHECK(c.rms);
  CHECK(c.swiglu);
  CHECK(c.rotary);
  CHECK(c.report.empty());
}

// ---- attention (model/cpu_attention.h) ----------------------------------------------------------

namespace {
struct AttnCase {
  int64_t b, h, tq, tk, d, dv;
  bool causal;
  std::optional<double> scale;
  int64_t hk = 0;  // key/value heads when fewer than h (enable_gqa)
};

// q, k, v as attention makes them: [B, T, H, D] memory viewed as [B, H, T, D].
at::Tensor heads(int64_t b, int64_t h, int64_t t, int64_t d) { return at::randn({b, t, h, d}).transpose(1, 2); }

// Output and dq, dk, dv for the output gradient g, through autograd.
std::vector<at::Tensor> attn_run(const at::Tensor& q0, const at::Tensor& k0, const at::Tensor& v0, const at::Tensor& g,
                                 bool causal, std::optional<double> scale, bool ours, std::string* node = nullptr,
                                 bool gqa = false) {
  at::Tensor q = q0.detach().requires_grad_(true), k = k0.detach().requires_grad_(true),
             v = v0.detach().requires_grad_(true);
  at::Tensor o = ours ? sdpa(q, k, v, std::nullopt, 0.0, causal, scale, gqa)
                      : at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, causal, scale, gqa);
  if (node) *node = o.grad_fn() ? o.grad_fn()->name() : "";
  auto gr = torch::autograd::grad({o}, {q, k, v}, {g});
  return {o.detach(), gr[0], gr[1], gr[2]};
}

// Causal sdpa through mfsdp's kernels gives the same bits on 1 and 2 threads (output and gradients),
// and without grad (output).
void check_threads_and_no_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               bool gqa = false) {
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = attn_run(q, k, v, g, true, std::nullopt, true, nullptr, gqa);
  at::set_num_threads(2);
  const auto two = attn_run(q, k, v, g, true, std::nullopt, true, nullptr, gqa);
  at::set_num_threads(before);
  for (size_t i = 0; i < one.size(); ++i) CHECK(at::equal(one[i], two[i]));
  const at::NoGradGuard no_grad;
  CHECK(at::equal(sdpa(q, k, v, std::nullopt, 0.0, true, std::nullopt, gqa), one[0]));
}
}  // namespace

TEST_CASE("Attention: mfsdp's kernel against ATen's in double, causal and not, forward and backward") {
  at::manual_seed(21);
  const std::vector<AttnCase> cases = {
      {2, 3, 1, 1, 8, 8, true, std::nullopt},       // one token
      {2, 3, 37, 37, 16, 16, true, std::nullopt},   // rows not a multiple of the 32-row block
      {1, 2, 128, 128, 64, 64, true, std::nullopt}, // the bench's head shape
      {2, 2, 64, 64, 32, 32, false, 0.3},           // full attention, a given scale
      {2, 2, 5, 70, 8, 12, false, std::nullopt},    // cross attention: Tq != Tk, Dv != D
      {1, 1, 256, 256, 8, 8, true, std::nullopt},   // the longest with the probabilities kept
      {1, 2, 257, 257, 16, 16, true, std::nullopt}, // beyond: the log-sum-exp kernels, a 1-row last block
      {2, 1, 640, 640, 64, 64, true, 0.2},          // ten 64-row blocks, a given scale
      // Grouped-query attention (enable_gqa): key/value heads read by 2 and 3 query heads each, and by
      // all of them (multi-query); dk and dv sum their query heads'.
      {2, 4, 37, 37, 16, 16, true, std::nullopt, 2},
      {2, 6, 40, 40, 8, 8, false, std::nullopt, 2},
      {1, 4, 300, 300, 16, 16, true, std::nullopt, 1},  // the log-sum-exp kernels
  };
  for (const AttnCase& c : cases) {
    const int64_t hk = c.hk ? c.hk : c.h;
    const bool gqa = c.hk != 0;
    INFO("B " << c.b << " H " << c.h << " Hk " << hk << " Tq " << c.tq << " Tk " << c.tk << " D " << c.d << " Dv " << c.dv
              << " causal " << c.causal);
    at::Tensor q = heads(c.b, c.h, c.tq, c.d) * 2, k = heads(c.b, hk, c.tk, c.d) * 2, v = heads(c.b, hk, c.tk, c.dv);
    at::Tensor g = at::randn({c.b, c.h, c.tq, c.dv});
    std::string node;
    const auto got = attn_run(q, k, v, g, c.causal, c.scale, true, &node, gqa);
    CHECK(node.find("Sdpa") != std::string::npos);  // mfsdp's kernel ran, not ATen's fallback
    const auto want = attn_run(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), g.to(at::kDouble), c.causal,
                               c.scale, false, nullptr, gqa);
    const auto flash = attn_run(q, k, v, g, c.causal, c.scale, false, nullptr, gqa);
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("output " << i << " (out, dq, dk, dv)");
      CHECK(got[i].sizes() == want[i].sizes());
      // fp32 against the exact value, and no further from it than ATen's own fp32 kernel (x4); over
      // at least 1 (one key: dq and dk are exactly 0, what is left is the rounding of dO.v - dO.o).
      auto err = [&](const at::Tensor& a) {
        const at::Tensor w = want[i].to(at::kDouble);
        return (a.to(at::kDouble) - w).abs().max().item<double>() / std::max(w.abs().max().item<double>(), 1.0);
      };
      CHECK(err(got[i]) < 1e-5);
      CHECK(err(got[i]) <= 4 * err(flash[i]) + 1e-7);
    }
    // The output and gradients come back as flash attention's do: [B, T, H, D] memory.
    CHECK(got[0].transpose(1, 2).is_contiguous());
    CHECK(got[1].transpose(1, 2).is_contiguous());
  }
}

TEST_CASE("Attention: no-grad and threaded runs give the same bits; NaN stays NaN; what it does not take is ATen's") {
  at::manual_seed(22);
  at::Tensor q = heads(2, 4, 50, 16), k = heads(2, 4, 50, 16), v = heads(2, 4, 50, 16), g = at::randn({2, 4, 50, 16});
  check_threads_and_no_grad(q, k, v, g);
  check_threads_and_no_grad(q, k.slice(1, 0, 2), v.slice(1, 0, 2), g, /*gqa=*/true);  // each thread its groups
  check_threads_and_no_grad(heads(1, 4, 300, 16), heads(1, 2, 300, 16), heads(1, 2, 300, 16), at::randn({1, 4, 300, 16}),
                            /*gqa=*/true);
  // A NaN in one query row: that row's output is NaN (as ATen's), the others are not.
  at::Tensor qn = q.clone();
  qn.index_put_({0, 1, 7, 3}, NAN);
  at::Tensor on = sdpa(qn, k, v, std::nullopt, 0.0, true, std::nullopt);
  CHECK(on[0][1][7].isnan().all().item<bool>());
  CHECK(!on[0][1][6].isnan().any().item<bool>());
  CHECK(!on[1].isnan().any().item<bool>());
  // Not taken, so exactly ATen's: fp16, more keys than kCpuAttentionMaxKeys without a causal mask,
  // causal with Tq != Tk, and k/v with fewer heads than q.
  auto aten = [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, bool causal) {
    return at::scaled_dot_product_attention(a, b, c, std::nullopt, 0.0, causal);
  };
  at::Tensor qh = q.to(at::kHalf), kh = k.to(at::kHalf), vh = v.to(at::kHalf);
  CHECK(at::equal(sdpa(qh, kh, vh, std::nullopt, 0.0, true, std::nullopt), aten(qh, kh, vh, true)));
  at::Tensor ql = heads(1, 2, 300, 8), kl = heads(1, 2, 300, 8), vl = heads(1, 2, 300, 8);
  CHECK(at::equal(sdpa(ql, kl, vl, std::nullopt, 0.0, false, std::nullopt), aten(ql, kl, vl, false)));  // not causal
  at::Tensor qs = heads(2, 4, 10, 16);
  CHECK(at::equal(sdpa(qs, k, v, std::nullopt, 0.0, true, std::nullopt), aten(qs, k, v, true)));
  CHECK_THROWS(sdpa(q, k.slice(1, 0, 2), v.slice(1, 0, 2), std::nullopt, 0.0, true, std::nullopt));  // ATen's error, as before
}

namespace {
// MFSDP_ATTENTION_BF16 set for a scope (how bf16 attention multiplies: mfsdp::cpu_attention_bf16_products).
struct AttentionBf16Knob {
  std::string before;
  bool had;
  explicit AttentionBf16Knob(const char* value) {
    const char* b = std::getenv("MFSDP_ATTENTION_BF16");
    had = b != nullptr;
    if (had) before = b;
    setenv("MFSDP_ATTENTION_BF16", value, 1);
  }
  ~AttentionBf16Knob() {
    if (had) setenv("MFSDP_ATTENTION_BF16", before.c_str(), 1);
    else unsetenv("MFSDP_ATTENTION_BF16");
  }
};
}  // namespace

TEST_CASE("Attention: bf16 computed in fp32 (MFSDP_ATTENTION_BF16=fp32) is the fp32 kernels on the converted inputs, "
          "output and gradients rounded once") {
  const AttentionBf16Knob knob("fp32");
  CHECK_FALSE(mfsdp::cpu_attention_bf16_products());
  at::manual_seed(26);
  for (int64_t t : {40, 300}) {  // probabilities kept; log-sum-exp
    INFO("T " << t);
    at::Tensor q = heads(2, 2, t, 16).to(at::kBFloat16), k = heads(2, 2, t, 16).to(at::kBFloat16),
               v = heads(2, 2, t, 16).to(at::kBFloat16);
    at::Tensor g = at::randn({2, 2, t, 16}).to(at::kBFloat16);
    std::string node;
    const auto got = attn_run(q, k, v, g, true, std::nullopt, true, &node);
    const auto fp32 = attn_run(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), g.to(at::kFloat), true,
                               std::nullopt, true);
    const auto want = attn_run(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), g.to(at::kDouble), true,
                               std::nullopt, false);
    const auto flash = attn_run(q, k, v, g, true, std::nullopt, false);
    CHECK(node.find("ToCopy") != std::string::npos);  // the output's rounding to bf16, over mfsdp's Sdpa
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("output " << i << " (out, dq, dk, dv)");
      CHECK(got[i].scalar_type() == at::kBFloat16);
      CHECK(at::equal(got[i], fp32[i].to(at::kBFloat16)));
      // bf16's own rounding (2^-8 relative) bounds it, and it is no further from the exact value
      // than ATen's bf16 flash attention.
      CHECK(scaled(got[i], want[i]) < 1e-2);
      CHECK(scaled(got[i], want[i]) <= scaled(flash[i], want[i]) * 1.05 + 1e-4);
    }
  }
}

TEST_CASE("Attention: bf16 with bf16 products (MFSDP_ATTENTION_BF16=bf16) against double and against ATen's bf16 "
          "flash attention, kept probabilities and log-sum-exp, grouped heads, threads") {
  const AttentionBf16Knob knob("bf16");
  REQUIRE(mfsdp::cpu_attention_bf16_products());  // LibTorch's MKL exports cblas_gemm_bf16bf16f32
  at::manual_seed(27);
  struct Case {
    int64_t t, h, hk, d;
  };
  for (const Case c : {Case{40, 2, 2, 16}, Case{100, 4, 2, 64}, Case{300, 2, 2, 16}, Case{600, 4, 1, 64}}) {
    INFO("T " << c.t << ", heads " << c.h << ", key/value heads " << c.hk << ", head dim " << c.d);
    const bool gqa = c.hk != c.h;
    at::Tensor q = heads(2, c.h, c.t, c.d).to(at::kBFloat16), k = heads(2, c.hk, c.t, c.d).to(at::kBFloat16),
               v = heads(2, c.hk, c.t, c.d).to(at::kBFloat16);
    at::Tensor g = at::randn({2, c.h, c.t, c.d}).to(at::kBFloat16);
    std::string node;
    const auto got = attn_run(q, k, v, g, true, std::nullopt, true, &node, gqa);
    const auto want = attn_run(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), g.to(at::kDouble), true,
                               std::nullopt, false, nullptr, gqa);
    const auto flash = attn_run(q, k, v, g, true, std::nullopt, false, nullptr, gqa);
    const auto fp32 = attn_run(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), g.to(at::kFloat), true,
                               std::nullopt, true, nullptr, gqa);
    CHECK(node.find("Sdpa") != std::string::npos);  // mfsdp's node itself: no conversion around it
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("output " << i << " (out, dq, dk, dv)");
      CHECK(got[i].scalar_type() == at::kBFloat16);
      // The probabilities and dS rounded to bf16 for their products, as flash attention rounds
      // them: within bf16's few roundings of the exact value, and of ATen's bf16 error's order.
      const double err = scaled(got[i], want[i]), ref = scaled(flash[i], want[i]);
      INFO("error " << err << ", ATen's bf16 " << ref << ", fp32 kernels rounded " << scaled(fp32[i].to(at::kBFloat16), want[i]));
      CHECK(err < 2e-2);
      CHECK(err <= ref * 2.0 + 1e-3);
      // Not the fp32 path's result: the products did take bf16 operands.
      if (i > 0) CHECK_FALSE(at::equal(got[i], fp32[i].to(at::kBFloat16)));
    }
    check_threads_and_no_grad(q, k, v, g, gqa);
  }
}

TEST_CASE("Attention: the log-sum-exp kernels against double at lengths either side of kCpuAttentionMaxKeys") {
  // Called directly, so that lengths the probabilities-kept kernel would take (sdpa's choice) test
  // this one too: one row, a block and a row, a block less a row, several blocks; causal and not.
  at::manual_seed(25);
  for (int64_t t : {1, 37, 63, 65, 130, 300}) {
    for (bool causal : {true, false}) {
      INFO("T " << t << " causal " << causal);
      at::Tensor q = heads(2, 2, t, 16) * 2, k = heads(2, 2, t, 16) * 2, v = heads(2, 2, t, 24);
      at::Tensor g = at::randn({2, 2, t, 24});
      const double scale = 0.25;
      at::Tensor lse;
      at::Tensor o = cpu_attention_forward_lse(q, k, v, causal, scale, &lse);
      auto [dq, dk, dv] = cpu_attention_backward_lse(g, q, k, v, o, lse, causal, scale);
      const auto want = attn_run(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), g.to(at::kDouble), causal,
                                 scale, false);
      at::Tensor logits = at::matmul(q.to(at::kDouble), k.to(at::kDouble).transpose(-1, -2)) * scale;
      if (causal) logits.masked_fill_(at::ones({t, t}, at::kBool).triu(1), -INFINITY);
      CHECK(scaled(lse, logits.logsumexp(-1)) < 1e-6);
      const std::vector<at::Tensor> got = {o, dq, dk, dv};
      for (size_t i = 0; i < got.size(); ++i) {
        INFO("output " << i << " (out, dq, dk, dv)");
        // Over at least 1: with one key dq and dk are exactly 0 (as in the test above).
        const at::Tensor w = want[i].to(at::kDouble);
        const double err =
            (got[i].to(at::kDouble) - w).abs().max().item<double>() / std::max(w.abs().max().item<double>(), 1.0);
        CHECK(err < 1e-5);
        CHECK(got[i].transpose(1, 2).is_contiguous());
      }
    }
  }
  // Threads and no-grad give the bits of one thread with a gradient; a NaN query row stays NaN.
  at::Tensor q = heads(2, 3, 300, 16), k = heads(2, 3, 300, 16), v = heads(2, 3, 300, 16), g = at::randn({2, 3, 300, 16});
  check_threads_and_no_grad(q, k, v, g);
  at::Tensor qn = q.clone();
  qn.index_put_({1, 2, 280, 5}, NAN);
  const auto nan = attn_run(qn, k, v, g, true, std::nullopt, true);
  CHECK(nan[0][1][2][280].isnan().all().item<bool>());
  CHECK(!nan[0][1][2][279].isnan().any().item<bool>());
  CHECK(!nan[0][0].isnan().any().item<bool>());
  CHECK(nan[1][1][2][280].isnan().all().item<bool>());  // its dq row too
  CHECK(!nan[1][0].isnan().any().item<bool>());         // other pairs' gradients are untouched
}

TEST_CASE("Attention: the graph rewrite takes SDPA with or without mask and dropout, and gradients flow through it") {
  torch::jit::Module m("m");
  m.define(R"(
    def forward(self, q, k, v, mask):
        a = torch.scaled_dot_product_attention(q, k, v, None, 0.0, True)
        b = torch.scaled_dot_product_attention(q, k, v, mask, 0.0, False)
        c = torch.scaled_dot_product_attention(q, k, v, None, 0.1, False)
        d = torch.scaled_dot_product_attention(q, k, v, None, 0.0, False, scale=None, enable_gqa=True)
        return (a + b, c + d)
  )");
  at::manual_seed(23);
  at::Tensor q = heads(2, 2, 24, 8).requires_grad_(true), k = heads(2, 2, 24, 8), v = heads(2, 2, 24, 8);
  at::Tensor mask = at::randn({24, 24}) > 0;
  mask.diagonal().fill_(true);
  // (c's dropout is random: only a + b is compared.)
  at::Tensor want = m.forward({q, k, v, mask}).toTuple()->elements()[0].toTensor();
  at::Tensor gw = torch::autograd::grad({want.sum()}, {q})[0];
  // a, b (b's mask is not causal: ATen's at run time), c (dropout) and d (enable_gqa, a constant).
  REQUIRE(use_fast_attention(m) == 4);
  at::Tensor got = m.forward({q, k, v, mask}).toTuple()->elements()[0].toTensor();
  at::Tensor gg = torch::autograd::grad({got.sum()}, {q})[0];
  CHECK(scaled(got, want) < 1e-5);
  CHECK(scaled(gg, gw) < 1e-5);
  const std::string graph = m.get_method("forward").graph()->toString();
  CHECK(graph.find("mfsdp::sdpa") != std::string::npos);
  CHECK(graph.find("aten::scaled_dot_product_attention") == std::string::npos);
}

TEST_CASE("Attention: keys and values repeated by HF's repeat_kv are taken before the repeat, with enable_gqa; "
          "near misses keep the repeat") {
  torch::jit::Module m("m");
  // HF's repeat_kv as code: x[:, :, None, :, :].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d).
  m.define(R"(
    def rep(self, x, n: int):
        b = x.size(0)
        kv = x.size(1)
        t = x.size(2)
        d = x.size(3)
        return x[:, :, None, :, :].expand(b, kv, n, t, d).reshape(b, kv * n, t, d)

    def rep2(self, x, n: int):
        b = x.size(0)
        t = x.size(1)
        kv = x.size(2)
        d = x.size(3)
        return x[:, :, :, None, :].expand(b, t, kv, n, d).reshape(b, t, kv * n, d)

    def forward(self, q, k, v):
        a = torch.scaled_dot_product_attention(q, self.rep(k, 3), self.rep(v, 3), None, 0.0, True)
        # torchtitan's layout: repeated as [B, T, H, D], then transposed (its repeat_kv, and repeat_interleave)
        kt = k.transpose(1, 2)
        vt = v.transpose(1, 2)
        d = torch.scaled_dot_product_attention(q, self.rep2(kt, 3).transpose(1, 2), self.rep2(vt, 3).transpose(1, 2),
                                               None, 0.0, True)
        e = torch.scaled_dot_product_attention(q, kt.repeat_interleave(3, dim=2).transpose(1, 2),
                                               vt.repeat_interleave(3, dim=2).transpose(1, 2), None, 0.0, True)
        # near misses: k and v repeated differently; a repeat along another dimension
        kk = torch.cat([k, k, k], 1)
        b = torch.scaled_dot_product_attention(q, kk, self.rep(v, 3), None, 0.0, True)
        # repeat_interleave over the heads (scripted GQA), by a count the graph computes
        n = q.size(1) // k.size(1)
        c = torch.scaled_dot_product_attention(q, k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1))
        return a + b + c + d + e
  )");
  auto graph = m.get_method("forward").graph();
  torch::jit::Inline(*graph);
  at::manual_seed(27);
  at::Tensor q = heads(2, 6, 24, 8).requires_grad_(true), k = heads(2, 2, 24, 8).requires_grad_(true),
             v = heads(2, 2, 24, 8).requires_grad_(true);
  at::Tensor g = at::randn({2, 6, 24, 8});
  at::Tensor want = m.forward({q, k, v}).toTensor();
  auto gw = torch::autograd::grad({want}, {q, k, v}, {g});
  REQUIRE(use_fast_attention(m) == 5);
  const std::string text = m.get_method("forward").graph()->toString();
  INFO(text);
  // a's, c's, d's and e's k and v are the unrepeated ones (one expand left: b's v), with enable_gqa.
  auto count = [&](const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  CHECK(count("aten::expand") == 1);
  CHECK(count("aten::repeat_interleave") == 0);
  std::string node;
  at::Tensor got = m.forward({q, k, v}).toTensor();
  auto gg = torch::autograd::grad({got}, {q, k, v}, {g});
  CHECK(scaled(got, want) < 1e-5);
  for (int i = 0; i < 3; ++i) CHECK(scaled(gg[i], gw[i]) < 1e-5);
}

TEST_CASE("Attention: an explicit causal mask (as Hugging Face models pass) takes the kernel, any other is ATen's") {
  at::manual_seed(24);
  const int64_t T = 40;
  at::Tensor q = heads(2, 3, T, 16), k = heads(2, 3, T, 16), v = heads(2, 3, T, 16), g = at::randn({2, 3, T, 16});
  at::Tensor tril = at::ones({T, T}, at::kBool).tril();
  at::Tensor additive = at::zeros({T, T}).masked_fill(tril.logical_not(), -INFINITY);
  at::Tensor lowest = at::zeros({T, T}).masked_fill(tril.logical_not(), std::numeric_limits<float>::lowest());
  at::Tensor older = at::zeros({T, T}).masked_fill(tril.logical_not(), -1e9);  // the -1e9 of older code
  auto run = [&](const at::Tensor& mask, bool ours, std::string* node) {
    at::Tensor qq = q.detach().requires_grad_(true);
    at::Tensor o = ours ? sdpa(qq, k, v, mask, 0.0, false, std::nullopt)
                        : at::scaled_dot_product_attention(qq, k, v, mask, 0.0, false);
    if (node) *node = o.grad_fn()->name();
    return std::make_pair(o.detach(), torch::autograd::grad({o}, {qq}, {g})[0]);
  };
  for (const at::Tensor& mask :
       {tril, tril.expand({2, 1, T, T}).contiguous(), additive.view({1, 1, T, T}), lowest, older}) {
    INFO("mask " << mask.sizes() << " " << mask.scalar_type());
    CHECK(is_causal_mask(mask, T));
    std::string node;
    auto got = run(mask, true, &node);
    auto want = run(mask, false, nullptr);
    CHECK(node.find("Sdpa") != std::string::npos);
    CHECK(scaled(got.first, want.first) < 1e-5);
    CHECK(scaled(got.second, want.second) < 1e-5);
  }
  // Not the causal mask: ATen's call, bit for bit.
  at::Tensor extra = tril.clone();
  extra.index_put_({3, 9}, true);
  at::Tensor padded = tril.clone();
  padded.slice(1, 0, 2).fill_(false);
  padded.diagonal().fill_(true);
  at::Tensor soft = at::zeros({T, T}).masked_fill(tril.logical_not(), -1e4);
  for (const at::Tensor& mask : {extra, padded, soft, at::ones({T, T}, at::kBool)}) {
    CHECK(!is_causal_mask(mask, T));
    std::string node;
    auto got = run(mask, true, &node);
    CHECK(node.find("Sdpa") == std::string::npos);
    CHECK(at::equal(got.first, run(mask, false, nullptr).first));
  }
  // Beyond kCpuAttentionMaxKeys an explicit causal mask takes the log-sum-exp kernel.
  {
    const int64_t L = 300;
    at::Tensor ql = heads(1, 2, L, 16), kl = heads(1, 2, L, 16), vl = heads(1, 2, L, 16);
    at::Tensor long_tril = at::ones({L, L}, at::kBool).tril();
    at::Tensor qq = ql.detach().requires_grad_(true);
    at::Tensor o = sdpa(qq, kl, vl, long_tril, 0.0, false, std::nullopt);
    CHECK(std::string(o.grad_fn()->name()).find("Sdpa") != std::string::npos);
    CHECK(scaled(o, at::scaled_dot_product_attention(ql, kl, vl, std::nullopt, 0.0, true)) < 1e-5);
  }
  // A mask together with is_causal: ATen's call, whatever it makes of the pair.
  CHECK(at::equal(sdpa(q, k, v, tril, 0.0, true, std::nullopt),
                  at::scaled_dot_product_attention(q, k, v, tril, 0.0, true)));
}
