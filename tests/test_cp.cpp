// Context-parallel attention at 1, 2 and 4 ranks, both ways of moving keys/values (all-gather and
// the p2p ring), against plain causal attention on the whole sequence: outputs and the gradients
// of q, k and v, each rank holding its two load-balanced chunks (rank r: chunks r and 2cp-1-r).
// Large logits exercise the log-sum-exp merging.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "mpi_test_main.h"
#include "comm/communicator.h"
#include "comm/mpi_env.h"
#include "parallel/context_parallel.h"

using namespace mfsdp;

namespace {

at::Tensor mine(const at::Tensor& x, int64_t r, int64_t C) {
  const int64_t c = x.size(2) / (2 * C);
  return at::cat({x.narrow(2, r * c, c), x.narrow(2, (2 * C - 1 - r) * c, c)}, 2);
}

at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(3)));
  at::Tensor keep = at::ones({q.size(2), q.size(2)}, at::kBool).tril();
  return at::matmul(at::softmax(s.masked_fill(keep.logical_not(), -INFINITY), -1), v);
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max()).item<double>();
}

// cp_attention on this rank's chunks of q [B, H, T, D], k [B, Hk, T, D], v [B, Hk, T, Dv] against
// the reference on the whole sequence with the shared key/value heads repeated by hand (query head
// h reads key/value head h / (H / Hk)): outputs and the gradients of q, k and v.
void check_grouped(Communicator& c, int64_t H, int64_t Hk, int64_t D, int64_t Dv, uint64_t seed) {
  const int64_t C = c.size(), r = c.rank();
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const int64_t B = 2, T = 4 * C * 2;
  at::Tensor q = at::randn({B, H, T, D}, gen, at::kFloat), k = at::randn({B, Hk, T, D}, gen, at::kFloat);
  at::Tensor v = at::randn({B, Hk, T, Dv}, gen, at::kFloat), w = at::randn({B, H, T, Dv}, gen, at::kFloat);
  at::Tensor qr = q.clone().requires_grad_(true), kr = k.clone().requires_grad_(true), vr = v.clone().requires_grad_(true);
  at::Tensor ref = reference(qr, kr.repeat_interleave(H / Hk, 1), vr.repeat_interleave(H / Hk, 1));
  (ref * w).sum().backward();
  at::Tensor ql = mine(q, r, C).requires_grad_(true), kl = mine(k, r, C).requires_grad_(true), vl = mine(v, r, C).requires_grad_(true);
  at::Tensor out = cp_attention(ql, kl, vl);
  (out * mine(w, r, C)).sum().backward();
  CHECK(out.sizes() == at::IntArrayRef({B, H, T / C, Dv}));
  CHECK(kl.grad().sizes() == kl.sizes());
  CHECK(vl.grad().sizes() == vl.sizes());
  CHECK(max_rel(out.detach(), mine(ref.detach(), r, C)) < 1e-5);
  CHECK(max_rel(ql.grad(), mine(qr.grad(), r, C)) < 1e-4);
  CHECK(max_rel(kl.grad(), mine(kr.grad(), r, C)) < 1e-4);
  CHECK(max_rel(vl.grad(), mine(vr.grad(), r, C)) < 1e-5);
}

}  // namespace

TEST_CASE("context-parallel attention (all-gather and ring) equals causal attention on the whole sequence") {
  auto c = test::world("cp");
  const int64_t C = c->size(), r = c->rank();
  for (bool ring : {false, true})
  for (double amp : {1.0, 8.0}) {
    set_cp_context(c.get(), ring);
    INFO("ranks " << C << ", amplitude " << amp << (ring ? ", ring (p2p)" : ", all-gather"));
    at::Generator gen = at::detail::createCPUGenerator(11);
    const int64_t B = 2, H = 3, T = 8 * 4, D = 16;
    at::Tensor q = at::randn({B, H, T, D}, gen, at::kFloat) * amp, k = at::randn({B, H, T, D}, gen, at::kFloat) * amp;
    at::Tensor v = at::randn({B, H, T, D}, gen, at::kFloat), w = at::randn({B, H, T, D}, gen, at::kFloat);
    // Reference on the whole sequence.
    at::Tensor qr = q.clone().requires_grad_(true), kr = k.clone().requires_grad_(true), vr = v.clone().requires_grad_(true);
    at::Tensor ref = reference(qr, kr, vr);
    (ref * w).sum().backward();
    // This rank's chunks.
    at::Tensor ql = mine(q, r, C).requires_grad_(true), kl = mine(k, r, C).requires_grad_(true), vl = mine(v, r, C).requires_grad_(true);
    at::Tensor out = cp_attention(ql, kl, vl);
    (out * mine(w, r, C)).sum().backward();
    CHECK(max_rel(out.detach(), mine(ref.detach(), r, C)) < 1e-5);
    CHECK(max_rel(ql.grad(), mine(qr.grad(), r, C)) < 1e-4);
    CHECK(max_rel(kl.grad(), mine(kr.grad(), r, C)) < 1e-4);
    CHECK(max_rel(vl.grad(), mine(vr.grad(), r, C)) < 1e-5);
  }
  set_cp_context(nullptr);
}

TEST_CASE("bf16 inputs: fp32 inside, bf16 out and back") {
  auto c = test::world("cp");
  const int64_t C = c->size(), r = c->rank();
  set_cp_context(c.get());
  at::Generator gen = at::detail::createCPUGenerator(3);
  at::Tensor q = at::randn({1, 2, 4 * C, 8}, gen, at::kFloat).to(at::kBFloat16);
  at::Tensor ql = mine(q, r, C).requires_grad_(true);
  at::Tensor out = cp_attention(ql, ql, ql);
  out.sum().backward();
  CHECK(out.scalar_type() == at::kBFloat16);
  CHECK(ql.grad().scalar_type() == at::kBFloat16);
  CHECK(max_rel(out.to(at::kFloat), mine(reference(q.to(at::kFloat), q.to(at::kFloat), q.to(at::kFloat)), r, C)) < 1e-2);
  set_cp_context(nullptr);
}

TEST_CASE("grouped-query and multi-query keys/values: each shared head serves its group of query heads") {
  auto c = test::world("cp");
  for (int64_t Hk : {1, 2}) {
    set_cp_context(c.get(), Hk == 2);
    INFO("ranks " << c->size() << ", " << Hk << " key/value heads of 4");
    check_grouped(*c, 4, Hk, 8, 8, 5);
  }
  set_cp_context(nullptr);
}

TEST_CASE("soft-capped scores (Gemma 2): cap * tanh(scores / cap) before the causal mask, both exchanges") {
  auto c = test::world("cp");
  const int64_t C = c->size(), r = c->rank();
  for (bool ring : {false, true}) {
    set_cp_context(c.get(), ring);
    INFO("ranks " << C << (ring ? ", ring (p2p)" : ", all-gather"));
    at::Generator gen = at::detail::createCPUGenerator(17);
    const int64_t B = 1, H = 2, T = 4 * C * 2, D = 8;
    const double scale = 0.3, cap = 2.0;  // scores of amplitude ~8: the cap bends most of them
    at::Tensor q = at::randn({B, H, T, D}, gen, at::kFloat) * 3, k = at::randn({B, H, T, D}, gen, at::kFloat) * 3;
    at::Tensor v = at::randn({B, H, T, D}, gen, at::kFloat), w = at::randn({B, H, T, D}, gen, at::kFloat);
    at::Tensor qr = q.clone().requires_grad_(true), kr = k.clone().requires_grad_(true), vr = v.clone().requires_grad_(true);
    at::Tensor s = at::tanh(at::matmul(qr, kr.transpose(-2, -1)) * scale / cap) * cap;
    at::Tensor keep = at::ones({T, T}, at::kBool).tril();
    at::Tensor ref = at::matmul(at::softmax(s.masked_fill(keep.logical_not(), -INFINITY), -1), vr);
    (ref * w).sum().backward();
    at::Tensor ql = mine(q, r, C).requires_grad_(true), kl = mine(k, r, C).requires_grad_(true), vl = mine(v, r, C).requires_grad_(true);
    at::Tensor out = cp_attention(ql, kl, vl, scale, cap);
    (out * mine(w, r, C)).sum().backward();
    CHECK(max_rel(out.detach(), mine(ref.detach(), r, C)) < 1e-5);
    CHECK(max_rel(ql.grad(), mine(qr.grad(), r, C)) < 1e-4);
    CHECK(max_rel(kl.grad(), mine(kr.grad(), r, C)) < 1e-4);
    CHECK(max_rel(vl.grad(), mine(vr.grad(), r, C)) < 1e-5);
    // The cap matters here: without it the output is far from the capped reference.
    CHECK(max_rel(cp_attention(ql, kl, vl, scale).detach(), mine(ref.detach(), r, C)) > 1e-2);
  }
  set_cp_context(nullptr);
}

TEST_CASE("values of another head size than queries and keys (DeepSeek's MLA), both exchanges, with shared heads") {
  auto c = test::world("cp");
  for (bool ring : {false, true})
  for (int64_t Dv : {8, 24})
  for (int64_t Hk : {4, 2}) {
    set_cp_context(c.get(), ring);
    INFO("ranks " << c->size() << (ring ? ", ring (p2p)" : ", all-gather") << ", q/k head size 16, value head size "
                  << Dv << ", " << Hk << " key/value heads of 4");
    check_grouped(*c, 4, Hk, 16, Dv, 23);
  }
  set_cp_context(nullptr);
}
