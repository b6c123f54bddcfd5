// Tensor-parallel building blocks at 1, 2 and 4 ranks: the vocab-parallel cross entropy equals the
// full-vocabulary loss (values and gradients) without any rank holding the full logits, the chunked
// cross entropy of the trainer equals ATen's, and the
// sequence all-gather / reduce-scatter put every rank's chunk where it belongs.
#include <ATen/ATen.h>

#include <algorithm>

#include "mpi_test_main.h"
#include "comm/communicator.h"
#include "comm/mpi_env.h"
#include "parallel/cross_entropy.h"
#include "parallel/tp_ops.h"
#include "model/tp_split.h"

using namespace mfsdp;

namespace {

struct Context {
  explicit Context(Communicator& c, bool sp = false) { set_tp_context(&c, sp); }
  ~Context() { set_tp_context(nullptr, false); }
};

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

}  // namespace

TEST_CASE("vocab-parallel cross entropy equals the full-vocabulary loss") {
  auto c = test::world("tp");
  const int n = c->size(), r = c->rank();
  Context ctx(*c);
  // Divisible by 1, 2 and 4 ranks; the second size spans several row chunks of
  // cross_entropy_per_token (about 4M elements each on the CPU) on every rank count.
  const bool chunked = GENERATE(false, true);
  const int64_t N = chunked ? 300 : 37, V = chunked ? 60000 : 24 * 4;
  at::Generator gen = at::detail::createCPUGenerator(42);
  // Large logits (scale 30) exercise the max subtraction; the same values on every rank.
  at::Tensor full = at::randn({N, V}, gen, at::kFloat) * 30;
  at::Tensor targets = at::randint(0, V, {N}, gen, at::kLong);
  at::Tensor full_leaf = full.clone().requires_grad_(true);
  at::Tensor ref = at::cross_entropy_loss(full_leaf, targets, {}, at::Reduction::None);
  at::Tensor weights = at::rand({N}, gen, at::kFloat);
  (ref * weights).sum().backward();

  const int64_t Vl = V / (n > 1 ? n : 1);
  at::Tensor mine = full.narrow(1, r * Vl, Vl).clone().requires_grad_(true);
  // One rank: the same function over a group of one (its all-reduces are identities).
  at::Tensor loss = n > 1 ? vocab_parallel_cross_entropy(mine, targets, r * Vl, V)
                          : cross_entropy_per_token(mine, targets, c.get(), 0);
  (loss * weights).sum().backward();
  INFO("ranks " << n << ", " << N << " x " << V << " logits");
  CHECK(max_rel(loss.detach(), ref.detach()) < 1e-6);
  CHECK(max_rel(mine.grad(), full_leaf.grad().narrow(1, r * Vl, Vl)) < 1e-5);
  // Every rank got the same per-token loss.
  at::Tensor sum = loss.detach().clone();
  c->all_reduce(sum, ReduceOp::kSum);
  CHECK(max_rel(sum / n, loss.detach()) < 1e-7);
}

TEST_CASE("an uneven vocabulary: the padding columns of the last ranks take no part in the loss") {
  auto c = test::world("tp");
  const int n = c->size(), r = c->rank();
  if (n == 1) return;  // nothing is padded on one rank
  Context ctx(*c);
  // 2 ranks: slices of 19, the last with 18 real columns; 4 ranks: slices of 10, the last with 7.
  // With V = 3 at 4 ranks the last rank's slice is all padding.
  const int64_t V = GENERATE(37, 3), N = 23, slice = (V + n - 1) / n;
  const int64_t start = r * slice, real = std::clamp<int64_t>(V - start, 0, slice);
  at::Generator gen = at::detail::createCPUGenerator(5);
  at::Tensor full = at::randn({N, V}, gen, at::kFloat) * 10;
  at::Tensor targets = at::randint(0, V, {N}, gen, at::kLong);
  at::Tensor full_leaf = full.clone().requires_grad_(true);
  at::Tensor ref = at::cross_entropy_loss(full_leaf, targets, {}, at::Reduction::None);
  ref.sum().backward();
  // The padding columns hold what an untrained padding row of the head would give: anything, here
  // values that would dominate the softmax if they were read.
  at::Tensor mine = at::full({N, slice}, 1e4f, at::kFloat);
  if (real > 0) mine.narrow(1, 0, real).copy_(full.narrow(1, start, real));
  mine.requires_grad_(true);
  at::Tensor loss = vocab_parallel_cross_entropy(mine, targets, start, V);
  loss.sum().backward();
  INFO("ranks " << n << ", vocabulary " << V << ", rank " << r << " holds " << real << " of its " << slice << " columns");
  CHECK(max_rel(loss.detach(), ref.detach()) < 1e-6);
  if (real > 0) CHECK(max_rel(mine.grad().narrow(1, 0, real), full_leaf.grad().narrow(1, start, real)) < 1e-5);
  if (real < slice) CHECK(mine.grad().narrow(1, real, slice - real).abs().max().item<float>() == 0.0f);
}

TEST_CASE("TpSplit: every global element on exactly one rank, padding rows mapped to none") {
  // [outer 2, D, inner 3] with D in parts; size does not divide every part.
  for (const std::vector<int64_t>& parts : {std::vector<int64_t>{5}, std::vector<int64_t>{5, 4}, std::vector<int64_t>{2, 8}})
    for (int64_t size : {2, 3, 4}) {
      int64_t D = 0;
      for (int64_t p : parts) D += p;
      const std::vector<int64_t> shape{2, D, 3};
      std::vector<int> seen(size_t(2 * D * 3), 0);
      for (int64_t r = 0; r < size; ++r) {
        TpSplit t;
        t.dim = 1, t.parts = parts, t.size = size, t.rank = r, t.global_shape = shape;
        const int64_t local = 2 * t.local_rows() * 3;
        std::vector<int> mapped(size_t(local), 0);
        t.for_each_run(0, local, [&](int64_t g, int64_t l, int64_t len) {
          for (int64_t i = 0; i < len; ++i) ++seen[size_t(g + i)], ++mapped[size_t(l + i)];
        });
        // A sub-range gives the same mapping, cut to it.
        int64_t sub = 0;
        t.for_each_run(4, local - 2, [&](int64_t, int64_t l, int64_t len) {
          CHECK(l >= 4);
          CHECK(l + len <= local - 2);
          sub += len;
        });
        int64_t real = 0, expect_sub = 0;
        for (int64_t i = 0; i < local; ++i) {
          real += mapped[size_t(i)];
          if (i >= 4 && i < local - 2) expect_sub += mapped[size_t(i)];
        }
        CHECK(sub == expect_sub);
        int64_t real_rows = 0;
        for (int64_t p : parts) real_rows += t.real_rows(p, r);
        CHECK(real == 2 * real_rows * 3);
        CHECK(t.padded() == std::any_of(parts.begin(), parts.end(), [&](int64_t p) { return p % size != 0; }));
      }
      for (int v : seen) CHECK(v == 1);
    }
}

TEST_CASE("bf16 logits: the loss is computed in fp32 and the gradient comes back in bf16") {
  auto c = test::world("tp");
  const int n = c->size(), r = c->rank();
  if (n == 1) return;  // the single-rank path is at::cross_entropy_loss itself
  Context ctx(*c);
  const int64_t N = 16, V = 8 * n;
  at::Generator gen = at::detail::createCPUGenerator(7);
  at::Tensor full = (at::randn({N, V}, gen, at::kFloat) * 4).to(at::kBFloat16);
  at::Tensor targets = at::randint(0, V, {N}, gen, at::kLong);
  at::Tensor ref = at::cross_entropy_loss(full.to(at::kFloat), targets, {}, at::Reduction::None);
  at::Tensor mine = full.narrow(1, r * 8, 8).clone().requires_grad_(true);
  at::Tensor loss = vocab_parallel_cross_entropy(mine, targets, r * 8, V);
  loss.sum().backward();
  CHECK(loss.scalar_type() == at::kFloat);
  CHECK(mine.grad().scalar_type() == at::kBFloat16);
  CHECK(max_rel(loss.detach(), ref) < 1e-6);
}

TEST_CASE("cross_entropy_per_token equals ATen's cross entropy, in several row chunks, fp32 and bf16") {
  // 250 rows of 50000: 83 rows per chunk, so three chunks, the last one short.
  const int64_t N = 250, V = 50000;
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16);
  INFO(c10::toString(dtype));
  at::Generator gen = at::detail::createCPUGenerator(11);
  at::Tensor logits = (at::randn({N, V}, gen, at::kFloat) * 8).to(dtype);
  at::Tensor targets = at::randint(0, V, {N}, gen, at::kLong);
  at::Tensor weights = at::rand({N}, gen, at::kFloat);
  // The reference: what the trainer computed before (the logits in fp32, log_softmax + nll_loss).
  at::Tensor ref_leaf = logits.clone().requires_grad_(true);
  at::Tensor ref = at::cross_entropy_loss(ref_leaf.to(at::kFloat), targets, {}, at::Reduction::None);
  (ref * weights).sum().backward();
  at::Tensor leaf = logits.clone().requires_grad_(true);
  at::Tensor loss = cross_entropy_per_token(leaf, targets);
  (loss * weights).sum().backward();
  CHECK(loss.scalar_type() == at::kFloat);
  CHECK(leaf.grad().scalar_type() == dtype);
  CHECK(max_rel(loss.detach(), ref.detach()) < 1e-6);
  // bf16: both gradients are the same fp32 values rounded once to bf16, up to fp32 rounding of
  // the softmax, which can move a value across a bf16 rounding boundary (one bf16 ulp, 2^-8).
  CHECK(max_rel(leaf.grad().to(at::kFloat), ref_leaf.grad().to(at::kFloat)) < (dtype == at::kFloat ? 1e-5 : 1e-2));
}

TEST_CASE("cross_entropy_per_token writes its gradient over logits that nothing else holds, and only then") {
  const int64_t N = 96, V = 5000;
  at::Generator gen = at::detail::createCPUGenerator(12);
  const at::Tensor base = at::randn({N, V}, gen, at::kFloat) * 4;
  const at::Tensor targets = at::randint(0, V, {N}, gen, at::kLong);
  const at::Tensor weights = at::rand({N}, gen, at::kFloat);
  // The gradient of sum(weights * CE(f(leaf))) through ATen's cross entropy, f as the model's last op.
  auto reference = [&](auto f) {
    at::Tensor leaf = base.clone().requires_grad_(true);
    (at::cross_entropy_loss(f(leaf), targets, {}, at::Reduction::None) * weights).sum().backward();
    return leaf.grad();
  };
  auto times2 = [](const at::Tensor& x) { return x * 2.0; };  // saves no tensor of its output
  SECTION("the trainer's case: a reshaped model output, no handle kept: overwritten, gradient exact") {
    at::Tensor leaf = base.clone().requires_grad_(true);
    const int64_t before = cross_entropy_overwrites();
    at::Tensor out = times2(leaf).view({N / 2, 2, V});  // the model's [B, T, V]
    at::Tensor loss = cross_entropy_per_token(out.reshape({-1, V}), targets, nullptr, 0, -1, /*consume_logits=*/true);
    out = at::Tensor();
    (loss * weights).sum().backward();
    CHECK(cross_entropy_overwrites() == before + 1);
    CHECK(max_rel(leaf.grad(), reference(times2)) < 1e-5);
  }
  SECTION("bf16 logits, the trainer's case: overwritten too, the gradient the fp32 one rounded") {
    at::Tensor leaf = base.to(at::kBFloat16).requires_grad_(true);
    const int64_t before = cross_entropy_overwrites();
    at::Tensor out = times2(leaf).view({N / 2, 2, V});
    at::Tensor loss = cross_entropy_per_token(out.reshape({-1, V}), targets, nullptr, 0, -1, /*consume_logits=*/true);
    out = at::Tensor();
    (loss * weights).sum().backward();
    CHECK(cross_entropy_overwrites() == before + 1);
    CHECK(leaf.grad().scalar_type() == at::kBFloat16);
    at::Tensor ref_leaf = base.to(at::kBFloat16).to(at::kFloat).requires_grad_(true);
    (at::cross_entropy_loss(times2(ref_leaf), targets, {}, at::Reduction::None) * weights).sum().backward();
    CHECK(max_rel(leaf.grad().to(at::kFloat), ref_leaf.grad()) < 1e-2);
  }
  SECTION("the model's last op saved its output (tanh): not overwritten, its backward reads the right values") {
    at::Tensor leaf = base.clone().requires_grad_(true);
    const int64_t before = cross_entropy_overwrites();
    at::Tensor loss = cross_entropy_per_token(at::tanh(leaf), targets, nullptr, 0, -1, /*consume_logits=*/true);
    (loss * weights).sum().backward();
    CHECK(cross_entropy_overwrites() == before);
    CHECK(max_rel(leaf.grad(), reference([](const at::Tensor& x) { return at::tanh(x); })) < 1e-5);
  }
  SECTION("the caller kept a handle, or did not consume: not overwritten, the logits unchanged") {
    const bool consume = GENERATE(true, false);
    at::Tensor leaf = base.clone().requires_grad_(true);
    const int64_t before = cross_entropy_overwrites();
    at::Tensor logits = times2(leaf);
    const at::Tensor copy = logits.detach().clone();
    at::Tensor loss = cross_entropy_per_token(logits, targets, nullptr, 0, -1, consume);
    if (!consume) logits = at::Tensor();
    (loss * weights).sum().backward();
    CHECK(cross_entropy_overwrites() == before);
    if (consume) CHECK(logits.detach().equal(copy));
    CHECK(max_rel(leaf.grad(), reference(times2)) < 1e-5);
  }
}

TEST_CASE("all_gather_dim and reduce_scatter_dim along the sequence") {
  auto c = test::world("tp");
  const int n = c->size(), r = c->rank();
  // [B=2, T=3, D=4] chunk per rank with values that say (rank, b, t, d).
  at::Tensor idx = at::arange(2 * 3 * 4, at::kFloat).view({2, 3, 4});
  at::Tensor chunk = idx + 1000 * r;
  at::Tensor g = all_gather_dim(*c, chunk, 1);
  REQUIRE(g.sizes() == at::IntArrayRef({2, 3 * n, 4}));
  for (int k = 0; k < n; ++k) CHECK(g.narrow(1, 3 * k, 3).equal(idx + 1000 * k));
  at::Tensor last = all_gather_dim(*c, chunk, -1);
  REQUIRE(last.sizes() == at::IntArrayRef({2, 3, 4 * n}));
  for (int k = 0; k < n; ++k) CHECK(last.narrow(2, 4 * k, 4).equal(idx + 1000 * k));
  // Every rank contributes the full [2, 3n, 4] tensor (rank + 1) * base; rank k gets chunk k of the sum.
  at::Tensor base = at::arange(2 * 3 * n * 4, at::kFloat).view({2, 3 * n, 4});
  at::Tensor rs = reduce_scatter_dim(*c, base * (r + 1), 1);
  const double total = n * (n + 1) / 2.0;
  CHECK(rs.equal(base.narrow(1, 3 * r, 3) * total));
}
