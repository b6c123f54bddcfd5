// mfsdp's CPU ops against the ATen ops they replace, forward + backward through autograd, on the
// shapes of bench/train_step.sh's Llama and GPT (micro-batch 8 x 128 tokens, d 256, 4 heads of 64,
// FFN 704 / 1024), and causal attention at 128 to 2048 tokens (the probabilities kept up to 256,
// recomputed from a log-sum-exp beyond: model/cpu_attention.cpp), and in bf16 at 128, 512 and 1024.
// Writes one markdown row per op: ms per call of each, their ratio.
//   build/tests/kernels_bench [ROUNDS] [THREADS] [ROWS]   (ROWS: only the rows whose name contains it)
// Linked with its symbols exported, as the mfsdp executable: MKL then picks its kernels as in a run
// (train/system.cpp, "MKL's dispatch"; the first line says which).
// Rounds alternate the two sides; each side's figure is its best round (this machine is shared: a
// neighbour slows single rounds, never speeds them up).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "model/cpu_attention.h"
#include "model/fast_dropout.h"
#include "model/fast_ops.h"
#include "train/system.h"

namespace {

using Clock = std::chrono::steady_clock;

// ms per call of f (forward and backward), over `calls` calls.
double time_ms(const std::function<void()>& f, int calls) {
  f();  // warm: allocations, first-touch
  const auto t0 = Clock::now();
  for (int i = 0; i < calls; ++i) f();
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / calls;
}

struct Row {
  std::string name;
  std::function<void()> aten, ours;
};

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
  at::set_num_threads(argc > 2 ? std::atoi(argv[2]) : 1);
  at::manual_seed(0);
  std::vector<Row> rows;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const std::string dt = dtype == at::kFloat ? "fp32" : "bf16";
    auto opt = at::TensorOptions().dtype(dtype);
    // SwiGLU: silu(gate) * up on [8, 128, 704].
    at::Tensor a = at::randn({8, 128, 704}, opt).requires_grad_(true), b = at::randn({8, 128, 704}, opt).requires_grad_(true);
    at::Tensor g = at::randn({8, 128, 704}, opt);
    rows.push_back({"SwiGLU silu(a) * b, [8, 128, 704], " + dt,
                    [=] { torch::autograd::grad({at::silu(a) * b}, {a, b}, {g}); },
                    [=] { torch::autograd::grad({mfsdp::silu_mul(a, b)}, {a, b}, {g}); }});
    // Rotary: q [8, 4, 128, 64] as attention makes it (a transposed view), cos/sin [8, 1, 128, 64].
    at::Tensor q = at::randn({8, 128, 4, 64}, opt).transpose(1, 2).detach().requires_grad_(true);
    at::Tensor ang = at::randn({8, 1, 128, 64});
    at::Tensor cos = ang.cos().to(dtype), sin = ang.sin().to(dtype), gq = at::randn({8, 4, 128, 64}, opt);
    rows.push_back({"rotary x cos + rotate_half(x) sin, [8, 4, 128, 64], " + dt,
                    [=] {
                      at::Tensor r = at::cat({-q.slice(3, 32), q.slice(3, 0, 32)}, -1);
                      torch::autograd::grad({q * cos + r * sin}, {q}, {gq});
                    },
                    [=] { torch::autograd::grad({mfsdp::rotary(q, cos, sin, 3, -1, -1)}, {q}, {gq}); }});
    // GELU (tanh form) on the GPT's [8, 128, 1024].
    at::Tensor x = at::randn({8, 128, 1024}, opt).requires_grad_(true), gx = at::randn({8, 128, 1024}, opt);
    rows.push_back({"GELU tanh, [8, 128, 1024], " + dt,
                    [=] { torch::autograd::grad({at::gelu(x, "tanh")}, {x}, {gx}); },
                    [=] {
                      // mfsdp::gelu_tanh through the dispatcher: its autograd kernel (fast_ops.h's
                      // gelu_tanh is the forward alone).
                      static auto op = c10::Dispatcher::singleton()
                                           .findSchemaOrThrow("mfsdp::gelu_tanh", "")
                                           .typed<at::Tensor(const at::Tensor&)>();
                      torch::autograd::grad({op.call(x)}, {x}, {gx});
                    }});
  }
  // RMSNorm's scaling (fp32: the kernel's dtype) on [8, 128, 256].
  at::Tensor h = at::randn({8, 128, 256}).requires_grad_(true), gh = at::randn({8, 128, 256});
  rows.push_back({"RMS scaling x rsqrt(mean(x^2) + eps), [8, 128, 256], fp32",
                  [=] { torch::autograd::grad({h * at::rsqrt(h.pow(2).mean({-1}, true) + 1e-6)}, {h}, {gh}); },
                  [=] { torch::autograd::grad({mfsdp::rms_scale(h, 1e-6)}, {h}, {gh}); }});
  // RMSNorm with its weight, as HF's RMSNorm computes it: weight * (x rsqrt(...)), ATen's ops against
  // mfsdp's one weighted op (model/fast_ops.h: the weight's gradient too).
  at::Tensor nw = (at::randn({256}) * 0.1 + 1).requires_grad_(true);
  rows.push_back({"RMSNorm with weight w (x rsqrt(mean(x^2) + eps)), [8, 128, 256], fp32",
                  [=] { torch::autograd::grad({nw * (h * at::rsqrt(h.pow(2).mean({-1}, true) + 1e-6))}, {h, nw}, {gh}); },
                  [=] {
                    torch::autograd::grad({mfsdp::rms_norm_weight(h, nw, 1e-6)}, {h, nw}, {gh});
                  }});
  // Dropout 0.2 on a nanoGPT residual, [8, 256, 384] (model/fast_dropout.h: ATen's masks, drawn by
  // mfsdp where ATen draws element by element; on Intel CPUs both sides are ATen's), and causal
  // attention with dropout 0.2 at nanoGPT's [8, 6, 256, 64] (ATen: its math attention).
  at::Tensor dx = at::randn({8, 256, 384}).requires_grad_(true), gdx = at::randn({8, 256, 384});
  rows.push_back({"dropout 0.2, [8, 256, 384], fp32",
                  [=] { torch::autograd::grad({at::dropout(dx, 0.2, true)}, {dx}, {gdx}); },
                  [=] { torch::autograd::grad({mfsdp::dropout(dx, 0.2, true)}, {dx}, {gdx}); }});
  {
    auto qkv = [] { return at::randn({8, 256, 6, 64}).transpose(1, 2).detach().requires_grad_(true); };
    at::Tensor aq = qkv(), ak = qkv(), av = qkv(), ag = at::randn({8, 6, 256, 64});
    rows.push_back({"causal attention, dropout 0.2, [8, 6, 256, 64], fp32",
                    [=] {
                      at::Tensor o = at::scaled_dot_product_attention(aq, ak, av, std::nullopt, 0.2, true);
                      torch::autograd::grad({o}, {aq, ak, av}, {ag});
                    },
                    [=] {
                      at::Tensor o = mfsdp::sdpa(aq, ak, av, std::nullopt, 0.2, true, std::nullopt);
                      torch::autograd::grad({o}, {aq, ak, av}, {ag});
                    }});
  }
  // Causal attention on q, k, v [B, 4, T, 64] as attention makes them (transposed views), 1024
  // tokens per call up to 1024 per sequence (the bench's 8 x 128; 4 x 256, the longest with the
  // probabilities kept; 512 and 1024 with them recomputed), then one sequence of 2048; in fp32, and
  // in bf16 at 128, 512 and 1024: with bf16 products where mfsdp::cpu_attention_bf16_products()
  // (MFSDP_ATTENTION_BF16=bf16), else converted to fp32 for the fp32 kernels and the output rounded
  // (MFSDP_ATTENTION_BF16=fp32: the conversions and their backward are in its time).
  const std::vector<std::pair<at::ScalarType, int64_t>> attention = {
      {at::kFloat, 128}, {at::kFloat, 256}, {at::kFloat, 512}, {at::kFloat, 1024}, {at::kFloat, 2048},
      {at::kBFloat16, 128}, {at::kBFloat16, 512}, {at::kBFloat16, 1024}};
  for (const auto& [dtype, t] : attention) {
    const int64_t bs = std::max<int64_t>(1, 1024 / t);
    auto qkv = [&] { return at::randn({bs, t, 4, 64}).to(dtype).transpose(1, 2).detach().requires_grad_(true); };
    at::Tensor aq = qkv(), ak = qkv(), av = qkv(), ag = at::randn({bs, 4, t, 64}).to(dtype);
    rows.push_back({"causal attention, [" + std::to_string(bs) + ", 4, " + std::to_string(t) + ", 64], " +
                        (dtype == at::kFloat                  ? "fp32"
                         : mfsdp::cpu_attention_bf16_products() ? "bf16 (bf16 products)"
                                                                : "bf16 (computed in fp32)"),
                    [=] {
                      at::Tensor o = at::scaled_dot_product_attention(aq, ak, av, std::nullopt, 0.0, true);
                      torch::autograd::grad({o}, {aq, ak, av}, {ag});
                    },
                    [=] {
                      at::Tensor o = mfsdp::sdpa(aq, ak, av, std::nullopt, 0.0, true, std::nullopt);
                      torch::autograd::grad({o}, {aq, ak, av}, {ag});
                    }});
  }
  // Grouped-query causal attention, 4 query heads reading 2 key/value heads, [8, 4, 128, 64]:
  // ATen's SDPA with enable_gqa against mfsdp::sdpa with it (the kernels read each key/value head in
  // place); the gradients of k and v have 2 heads.
  {
    auto heads = [](int64_t h) { return at::randn({8, 128, h, 64}).transpose(1, 2).detach().requires_grad_(true); };
    at::Tensor aq = heads(4), ak = heads(2), av = heads(2), ag = at::randn({8, 4, 128, 64});
    rows.push_back({"causal attention, 4 query heads on 2 key/value heads (enable_gqa), [8, 4, 128, 64], fp32",
                    [=] {
                      at::Tensor o = at::scaled_dot_product_attention(aq, ak, av, std::nullopt, 0.0, true,
                                                                      std::nullopt, true);
                      torch::autograd::grad({o}, {aq, ak, av}, {ag});
                    },
                    [=] {
                      at::Tensor o = mfsdp::sdpa(aq, ak, av, std::nullopt, 0.0, true, std::nullopt, true);
                      torch::autograd::grad({o}, {aq, ak, av}, {ag});
                    }});
  }
  const std::string only = argc > 3 ? argv[3] : "";
  std::printf("%s; %d thread(s)\n\n", mfsdp::blas_description().c_str(), at::get_num_threads());
  std::printf("| op (forward + backward) | ATen ms | mfsdp ms | mfsdp/ATen |\n|---|---|---|---|\n");
  for (const Row& r : rows) {
    if (r.name.find(only) == std::string::npos) continue;
    double best_a = 1e30, best_o = 1e30;
    for (int i = 0; i < rounds; ++i) {
      best_a = std::min(best_a, time_ms(r.aten, 20));
      best_o = std::min(best_o, time_ms(r.ours, 20));
    }
    std::printf("| %s | %.3f | %.3f | %.2f |\n", r.name.c_str(), best_a, best_o, best_o / best_a);
  }
  return 0;
}
