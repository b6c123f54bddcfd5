// Attention written out (softmax(q k^T) v) and scripts/export_hf.py's mfsdp::attention taken by
// mfsdp::sdpa (model/eager_attention.cpp): each form models write, scripted, against the graph as
// it was (outputs and the gradients of q, k and v), the kernel's run where the mask is causal, the
// dropout masks PyTorch's own, and near misses left as written.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/script.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "catch.h"
#include "kernel_refs.h"
#include "model/fast_ops.h"
#include "model/graph_rewrite.h"

using namespace mfsdp;
using mfsdp::test::scaled;

namespace {

at::Tensor heads(int64_t b, int64_t h, int64_t t, int64_t d) { return at::randn({b, t, h, d}).transpose(1, 2); }

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

struct Run {
  at::Tensor out;
  std::vector<at::Tensor> grads;  // of q, k, v
  std::string grad_fn;
};

Run run(torch::jit::Module& m, const std::string& method, const at::Tensor& q0, const at::Tensor& k0,
        const at::Tensor& v0, const std::vector<c10::IValue>& rest, uint64_t seed = 5) {
  at::Tensor q = q0.detach().requires_grad_(true), k = k0.detach().requires_grad_(true),
             v = v0.detach().requires_grad_(true);
  std::vector<c10::IValue> args{q, k, v};
  args.insert(args.end(), rest.begin(), rest.end());
  at::manual_seed(seed);
  at::Tensor o = m.get_method(method)(args).toTensor();
  Run r{o.detach(), {}, o.grad_fn() ? o.grad_fn()->name() : ""};
  at::Tensor g = at::ones_like(o) + at::arange(o.numel(), o.options()).view(o.sizes()).remainder(7) * 0.1;
  r.grads = torch::autograd::grad({o}, {q, k, v}, {g.detach()});
  return r;
}

void check_close(const Run& got, const Run& want, double tol = 1e-5) {
  CHECK(scaled(got.out, want.out) < tol);
  for (int i = 0; i < 3; ++i) {
    INFO("gradient " << i);
    CHECK(scaled(got.grads[size_t(i)], want.grads[size_t(i)]) < tol);
  }
}

// The forms, one method each (scripted: TorchScript source as a model's file holds it).
const char* kForms = R"(
    def mingpt(self, q, k, v, bias):
        T = q.size(2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / k.size(-1) ** 0.5)
        att = att.masked_fill(bias[:, :, :T, :T] == 0, float('-inf'))
        att = torch.softmax(att, dim=-1)
        return att @ v

    def meta(self, q, k, v, mask, head_dim: int):
        scores = torch.matmul(q, k.transpose(2, 3)) / head_dim ** 0.5
        scores = scores + mask
        scores = torch.softmax(scores.float(), dim=-1).type_as(q)
        return torch.matmul(scores, v)

    def hf(self, q, k, v, mask):
        b = k.size(0)
        kv = k.size(1)
        t = k.size(2)
        d = k.size(3)
        kr = k[:, :, None, :, :].expand(b, kv, 2, t, d).reshape(b, kv * 2, t, d)
        vb = v.size(0)
        vkv = v.size(1)
        vt = v.size(2)
        vd = v.size(3)
        vr = v[:, :, None, :, :].expand(vb, vkv, 2, vt, vd).reshape(vb, vkv * 2, vt, vd)
        w = torch.matmul(q, kr.transpose(2, 3)) * 0.125
        w = w + mask[:, :, :, : kr.shape[-2]]
        w = torch.softmax(w, dim=-1, dtype=6).to(q.dtype)  # torch.float32
        w = torch.dropout(w, 0.0, self.training)
        return torch.matmul(w, vr)

    def gpt2_where(self, q, k, v, keep, fill):
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w / 8
        w = torch.where(keep, w, fill)
        w = torch.softmax(w, -1)
        return torch.matmul(w, v)

    def full(self, q, k, v):
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.3, -1), v)

    def dropped(self, q, k, v, bias, p: float):
        att = (q @ k.transpose(-2, -1)) * 0.25
        att = att.masked_fill(bias == 0, float('-inf'))
        att = torch.softmax(att, dim=-1)
        att = torch.dropout(att, p, self.training)
        return att @ v
)";

// mfsdp::sdpa's calls that ran the kernel so far in this process (describe_fast_attention's N).
int64_t kernel_calls() {
  const std::string line = describe_fast_attention();
  const std::string tag = "mfsdp's CPU attention: ";
  REQUIRE(line.rfind(tag, 0) == 0);
  return std::stoll(line.substr(tag.size()));
}

torch::jit::Module forms() {
  torch::jit::Module m("m");
  m.register_attribute("training", c10::BoolType::get(), true);
  m.define(kForms);
  return m;
}

}  // namespace

TEST_CASE("Attention written out: each form is taken by mfsdp::sdpa, its outputs and gradients as before") {
  const int64_t B = 2, H = 4, T = 24, D = 16;
  at::manual_seed(41);
  const at::Tensor q = heads(B, H, T, D), k = heads(B, H, T, D), v = heads(B, H, T, D);
  const at::Tensor k2 = heads(B, 2, T, D), v2 = heads(B, 2, T, D);
  const at::Tensor bias = at::ones({1, 1, 32, 32}).tril();
  const at::Tensor tril = at::ones({T, T}, at::kBool).tril();
  const at::Tensor additive = at::zeros({T, T}).masked_fill(tril.logical_not(), -INFINITY);
  const at::Tensor lowest =
      at::zeros({B, 1, T, T}).masked_fill(tril.logical_not(), std::numeric_limits<float>::lowest());
  const at::Tensor fill = at::full({}, std::numeric_limits<float>::lowest());
  struct Case {
    const char* method;
    at::Tensor k, v;
    std::vector<c10::IValue> rest;
  };
  const std::vector<Case> cases = {
      {"mingpt", k, v, {bias}},
      {"meta", k, v, {additive, int64_t(D)}},
      {"hf", k2, v2, {lowest}},
      {"gpt2_where", k, v, {tril.view({1, 1, T, T}), fill}},
  };
  torch::jit::Module before = forms(), after = forms();
  REQUIRE(use_fast_eager_attention(after) == 6);
  for (const std::string method : {"mingpt", "meta", "hf", "gpt2_where", "full", "dropped"}) {
    const std::string text = after.get_method(method).graph()->toString();
    INFO(method << ":\n" << text);
    CHECK(count(text, "mfsdp::sdpa") == 1);
    CHECK(count(text, "aten::softmax") == 0);
    CHECK(count(text, "aten::matmul") == 0);
    CHECK(count(text, "aten::expand") == 0);  // hf's repeat_kv is gone: enable_gqa
  }
  for (const Case& c : cases) {
    INFO(c.method);
    const Run want = run(before, c.method, q, c.k, c.v, c.rest);
    const Run got = run(after, c.method, q, c.k, c.v, c.rest);
    CHECK(got.grad_fn.find("Sdpa") != std::string::npos);  // the kernel: each mask is the causal one
    check_close(got, want);
  }
  // No mask: attention over all keys (the kernel's non-causal form).
  const Run want = run(before, "full", q, k, v, {});
  const Run got = run(after, "full", q, k, v, {});
  CHECK(got.grad_fn.find("Sdpa") != std::string::npos);
  check_close(got, want);
  // The run's end-of-run line counts them (mfsdp::sdpa's calls: this test's are the first).
  INFO(describe_fast_attention());
  CHECK(describe_fast_attention().find("5 of 5 calls ran its kernel (4 of them with an explicit causal mask, 0 with "
                                       "dropout, 1 with fewer key/value heads") != std::string::npos);
}

TEST_CASE("Attention written out: a mask other than the causal one is ATen's SDPA with it, as the graph computed") {
  const int64_t B = 2, H = 3, T = 20, D = 8;
  at::manual_seed(42);
  const at::Tensor q = heads(B, H, T, D), k = heads(B, H, T, D), v = heads(B, H, T, D);
  at::Tensor padded = at::ones({1, 1, 32, 32}).tril();
  padded.slice(3, 0, 3).fill_(0);  // the first three keys masked for every query ...
  padded.slice(2, 0, 3).slice(3, 0, 3).fill_(1);  // ... but their own rows (no row fully masked)
  at::Tensor soft = at::zeros({T, T}).masked_fill(at::ones({T, T}, at::kBool).tril().logical_not(), -1e4);
  torch::jit::Module before = forms(), after = forms();
  REQUIRE(use_fast_eager_attention(after) == 6);
  for (const auto& [method, rest] : std::vector<std::pair<std::string, std::vector<c10::IValue>>>{
           {"mingpt", {padded}}, {"meta", {soft, int64_t(D)}}}) {
    INFO(method);
    const Run want = run(before, method, q, k, v, rest);
    const Run got = run(after, method, q, k, v, rest);
    CHECK(got.grad_fn.find("Sdpa") == std::string::npos);
    check_close(got, want);
  }
}

TEST_CASE("Attention written out: bf16 inputs with an fp32 mask, causal (the kernel) and not (ATen's SDPA, the mask "
          "converted to bf16)") {
  const int64_t B = 2, H = 4, T = 24, D = 16;
  at::manual_seed(45);
  const at::Tensor q = heads(B, H, T, D).to(at::kBFloat16), k = heads(B, H, T, D).to(at::kBFloat16),
                   v = heads(B, H, T, D).to(at::kBFloat16);
  const at::Tensor tril = at::ones({T, T}, at::kBool).tril();
  const at::Tensor causal = at::zeros({T, T}).masked_fill(tril.logical_not(), -INFINITY);
  at::Tensor banded = causal.clone();
  banded.slice(1, 0, 2).slice(0, 4).fill_(-INFINITY);  // rows 4.. do not see the first two keys
  for (const at::Tensor& mask : {causal, banded}) {
    const bool is_causal = mask.equal(causal);
    INFO("causal " << is_causal);
    // Fresh modules, each run once: TorchScript's own autodiff of the written-out graph, which the
    // profiling executor builds from a module's second run on, fails on this mixed-dtype graph.
    torch::jit::Module before = forms(), after = forms();
    REQUIRE(use_fast_eager_attention(after) == 6);
    const Run want = run(before, "meta", q, k, v, {mask, int64_t(D)});
    const int64_t ran = kernel_calls();
    const Run got = run(after, "meta", q, k, v, {mask, int64_t(D)});
    CHECK(got.out.scalar_type() == at::kBFloat16);
    CHECK(kernel_calls() - ran == (is_causal ? 1 : 0));
    check_close(got, want, 2e-2);  // bf16: one rounding of the output against the graph's several
  }
}

TEST_CASE("Attention written out: dropout over the probabilities draws PyTorch's masks, in training only") {
  const int64_t B = 2, H = 4, T = 24, D = 16;
  at::manual_seed(43);
  const at::Tensor q = heads(B, H, T, D), k = heads(B, H, T, D), v = heads(B, H, T, D);
  const at::Tensor bias = at::ones({T, T}).tril();
  torch::jit::Module before = forms(), after = forms();
  REQUIRE(use_fast_eager_attention(after) == 6);
  for (bool training : {true, false}) {
    INFO("training " << training);
    before.train(training);
    after.train(training);
    const Run want = run(before, "dropped", q, k, v, {bias, 0.2});
    const at::Tensor state_want = at::detail::getDefaultCPUGenerator().get_state();
    const Run got = run(after, "dropped", q, k, v, {bias, 0.2});
    const at::Tensor state_got = at::detail::getDefaultCPUGenerator().get_state();
    CHECK(got.grad_fn.find("Sdpa") != std::string::npos);
    check_close(got, want);
    CHECK(at::equal(state_got, state_want));  // the same numbers drawn, no more
    // Some probabilities dropped when training: the output differs from the run without dropout.
    const Run none = run(before, "dropped", q, k, v, {bias, 0.0});
    CHECK((scaled(got.out, none.out) > 1e-3) == training);
  }
}

TEST_CASE("Attention written out: near misses are left as written") {
  torch::jit::Module m("m");
  m.define(R"(
    def forward(self, q, k, v, mask):
        # the probabilities returned as well (output_attentions)
        p = torch.softmax(torch.matmul(q, k.transpose(-2, -1)), -1)
        a = torch.matmul(p, v) + p.sum()
        # the scale after the mask
        s = (torch.matmul(q, k.transpose(-2, -1)) + mask) * 0.5
        b = torch.matmul(torch.softmax(s, -1), v)
        # soft-capped logits
        c = torch.matmul(torch.softmax(torch.tanh(torch.matmul(q, k.transpose(-2, -1)) / 30.0) * 30.0, -1), v)
        # a softmax over another dimension
        d = torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)), 2), v)
        # keys not transposed (k as [B, H, D, T] already), probabilities cast to fp16
        e = torch.matmul(torch.softmax(torch.matmul(q, k), -1), v)
        f = torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)), -1).to(5).float(), v)  # to fp16
        return a + b + c + d + e + f
  )");
  CHECK(use_fast_eager_attention(m) == 0);
}

TEST_CASE("mfsdp::attention (scripts/export_hf.py's eager operator) without a soft cap is taken by mfsdp::sdpa") {
  const int64_t B = 2, H = 4, T = 24, D = 16;
  at::manual_seed(44);
  const at::Tensor q = heads(B, H, T, D), k = heads(B, 2, T, D), v = heads(B, 2, T, D);
  const at::Tensor tril = at::ones({T, T}, at::kBool).tril();
  const at::Tensor mask =
      at::zeros({B, 1, T, T}).masked_fill(tril.logical_not(), std::numeric_limits<float>::lowest());
  // A scripted call of an op of mfsdp's: written as SDPA, then given mfsdp::attention's node (a
  // model file from scripts/export_hf.py holds `ops.mfsdp.attention(...)`, which only Python's
  // TorchScript frontend resolves).
  const char* src = R"(
    def plain(self, q, k, v, mask):
        return torch.scaled_dot_product_attention(q, k, v, mask, 0.0, False)

    def capped(self, q, k, v, mask):
        return torch.scaled_dot_product_attention(q, k, v, mask, 0.0, False)
  )";
  auto as_attention_op = [](torch::jit::Module& m, const char* method, std::optional<double> softcap) {
    auto graph = m.get_method(method).graph();
    for (torch::jit::Node* n : graph->nodes()) {
      if (n->kind() != c10::aten::scaled_dot_product_attention) continue;
      torch::jit::Value *scale = nullptr, *cap = nullptr;
      {
        torch::jit::WithInsertPoint guard(n);
        scale = graph->insertConstant(0.25);
        cap = graph->insertConstant(softcap ? c10::IValue(*softcap) : c10::IValue());
      }
      REQUIRE(replace_node_by(n, "mfsdp::attention", {n->input(0), n->input(1), n->input(2), n->input(3), scale, cap}));
      return;
    }
  };
  torch::jit::Module before("m"), after("m");
  before.define(src);
  after.define(src);
  for (torch::jit::Module* m : {&before, &after}) {
    as_attention_op(*m, "plain", std::nullopt);
    as_attention_op(*m, "capped", 30.0);
  }
  REQUIRE(use_fast_eager_attention(after) == 1);
  CHECK(count(after.get_method("capped").graph()->toString(), "mfsdp::attention") == 1);
  const Run want = run(before, "plain", q, k, v, {mask});
  const Run got = run(after, "plain", q, k, v, {mask});
  CHECK(got.grad_fn.find("Sdpa") != std::string::npos);
  check_close(got, want);
}
