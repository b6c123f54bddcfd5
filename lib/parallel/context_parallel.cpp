#include "parallel/context_parallel.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/autograd.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <set>

#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "data/gpt_dataset.h"
#include "mesh/process_groups.h"
#include "model/graph_rewrite.h"
#include "model/model.h"
#include "parallel/tp_ops.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {
namespace {

std::atomic<Communicator*> g_cp{nullptr};
std::atomic<bool> g_ring{false};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Keys and values of the whole sequence, gathered from the CP group in one collective: rank s
// holds global chunks s and 2C-1-s of each. `buffer` is [C, 2, B, H, T/C, D] (rank-major, the
// layout a reduce-scatter returns to owners); k[j] and v[j] view global chunk j.
struct Gathered {
  at::Tensor buffer;
  std::vector<at::Tensor> k, v;
};

// Views of the 2C global chunks of a rank-major [C, 2, B, H, T/C, D] buffer, for keys (0) or values (1).
std::vector<at::Tensor> chunk_views(const at::Tensor& buffer, int64_t which) {
  const int64_t C = buffer.size(0), half = buffer.size(4) / 2;
  std::vector<at::Tensor> chunks(size_t(2 * C));
  for (int64_t s = 0; s < C; ++s) {
    chunks[size_t(s)] = buffer[s][which].narrow(2, 0, half);
    chunks[size_t(2 * C - 1 - s)] = buffer[s][which].narrow(2, half, half);
  }
  return chunks;
}

Gathered gather_kv(Communicator& c, const at::Tensor& k, const at::Tensor& v) {
  at::Tensor in = at::stack({k.to(at::kFloat), v.to(at::kFloat)});  // [2, B, H, T/C, D], contiguous
  Gathered g;
  g.buffer = at::empty({c.size() * in.numel()}, in.options());
  {
    FlightTag t("context-parallel all-gather of keys/values");
    c.all_gather(g.buffer, in.reshape({-1}));
  }
  std::vector<int64_t> shape{c.size()};
  for (int64_t d : in.sizes()) shape.push_back(d);
  g.buffer = g.buffer.view(shape);
  g.k = chunk_views(g.buffer, 0);
  g.v = chunk_views(g.buffer, 1);
  return g;
}

// Global chunk index of local chunk a (0 or 1) on CP rank r of C.
int64_t global_chunk(int64_t a, int64_t r, int64_t C) { return a == 0 ? r : 2 * C - 1 - r; }

at::Tensor causal_bias(int64_t c, const at::TensorOptions& opt) {
  return at::full({c, c}, -std::numeric_limits<float>::infinity(), opt).triu(1);
}

// Grouped-query attention without repeating the keys and values: query head j*G + g reads
// key/value head j, so a query chunk [B, H, c, D] is viewed as [B, Hk, G*c, D] (the G heads of a
// group stacked along the rows: row g*c + t) and every block is a product against the group's one
// key/value head. The exchange over CP then carries Hk heads, not H. The causal bias of a diagonal
// block is tiled G times along the rows. With G = 1 both maps are the identity.
at::Tensor to_groups(const at::Tensor& x, int64_t hk) { return x.reshape({x.size(0), hk, -1, x.size(3)}); }
at::Tensor from_groups(const at::Tensor& x, int64_t h) { return x.reshape({x.size(0), h, -1, x.size(3)}); }
at::Tensor grouped_bias(int64_t c, int64_t groups, const at::TensorOptions& opt) {
  at::Tensor b = causal_bias(c, opt);
  return groups > 1 ? b.repeat({groups, 1}) : b;
}

// Online-softmax accumulator of one local query chunk: running max, sum of exponentials, and the
// unnormalised output; blocks may arrive in any order. Flash blocks (below) arrive normalised, with
// their log-sum-exp: add_block merges those (then m is the running log-sum-exp and l is unused).
struct Accumulator {
  at::Tensor m, l, acc;
  bool normalised = false;
  void add_block(const at::Tensor& o, const at::Tensor& lse) {
    normalised = true;
    if (!m.defined()) {
      m = lse;
      acc = o;
      return;
    }
    at::Tensor m_new = at::logaddexp(m, lse);
    acc = acc * (m - m_new).exp_().unsqueeze(-1) + o * (lse - m_new).exp_().unsqueeze(-1);
    m = m_new;
  }
  void add(const at::Tensor& s, const at::Tensor& v) {
    at::Tensor bm = std::get<0>(s.max(-1));
    at::Tensor m_new = m.defined() ? at::maximum(m, bm) : bm;
    at::Tensor p = (s - m_new.unsqueeze(-1)).exp_();
    at::Tensor pv = at::matmul(p, v);
    if (!m.defined()) {
      l = p.sum(-1);
      acc = pv;
    } else {
      at::Tensor corr = (m - m_new).exp_();
      l = l * corr + p.sum(-1);
      acc = acc * corr.unsqueeze(-1) + pv;
    }
    m = m_new;
  }
  at::Tensor output() const { return normalised ? acc : acc / l.unsqueeze(-1); }
  at::Tensor lse() const { return normalised ? m : m + l.log(); }
};

// The scores of one block, S = Q_i K_j^T * scale, soft-capped when cap > 0 (Gemma 2's
// attn_logit_softcapping: S = cap * tanh(S / cap), before the mask, as HF's eager attention).
at::Tensor block_scores(const at::Tensor& qi, const at::Tensor& kj, double scale, double cap) {
  at::Tensor s = at::matmul(qi, kj.transpose(-2, -1)).mul_(scale);
  if (cap > 0) s.div_(cap).tanh_().mul_(cap);
  return s;
}

// The gradients of one block (query chunk qi against key chunk kj, `bias` the causal mask of a
// diagonal block or undefined) from the saved log-sum-exp and delta = rowsum(dO o O):
// dV_j += P^T dO_i, dQ_i += dS K_j * scale, dK_j += dS^T Q_i * scale, dS = P o (dO_i V_j^T - delta).
// With a soft cap, S = cap * tanh(R / cap) of the raw scores R, so dR = dS o (1 - tanh^2) and
// tanh = S / cap is recomputed with the scores.
void block_backward(const at::Tensor& qi, const at::Tensor& kj, const at::Tensor& vj, const at::Tensor& doi,
                    const at::Tensor& lsei, const at::Tensor& di, const at::Tensor& bias, double scale, double cap,
                    at::Tensor dqi, at::Tensor dkj, at::Tensor dvj) {
  at::Tensor s = block_scores(qi, kj, scale, cap);
  at::Tensor t = cap > 0 ? s / cap : at::Tensor();
  if (bias.defined()) s.add_(bias);
  at::Tensor p = (s - lsei).exp_();
  dvj.add_(at::matmul(p.transpose(-2, -1), doi));
  at::Tensor ds = p * (at::matmul(doi, vj.transpose(-2, -1)) - di);
  if (cap > 0) ds.mul_(1 - t * t);
  dqi.add_(at::matmul(ds, kj), scale);
  dkj.add_(at::matmul(ds.transpose(-2, -1), qi), scale);
}

// ---- Flash-attention blocks (DESIGN.md section 11). With bf16/fp16 activations on a GPU each
// block runs torch's flash-attention kernel, which returns the block's normalised output and its
// log-sum-exp; the blocks merge by log-sum-exp (Accumulator::add_block). Backward calls the
// kernel's backward per block with the *merged* output and log-sum-exp: it then computes
// P = exp(S - lse) and rowsum(dO o O) of the whole row, i.e. exactly the block's share of dQ, dK,
// dV (ring attention's trick). fp32 runs keep the matmul blocks (bit-for-bit the CPU formulation,
// which the GPU tests hold to 1e-5). The kernels are checked once per process against the matmul
// blocks on a small problem; a failure or mismatch falls back to the matmul blocks with a warning.
// MFSDP_CP_ATTENTION=math forces the matmul blocks.
struct FlashBlock {
  at::Tensor o, lse;  // fp32 [B, H, c, D], [B, H, c]
};

FlashBlock flash_forward(const at::Tensor& qi, const at::Tensor& kj, const at::Tensor& vj, bool diagonal, double scale,
                         at::ScalarType lp) {
  auto r = at::_scaled_dot_product_flash_attention(qi.to(lp).contiguous(), kj.to(lp).contiguous(), vj.to(lp).contiguous(),
                                                   0.0, diagonal, false, scale);
  return {std::get<0>(r).to(at::kFloat), std::get<1>(r).to(at::kFloat)};
}

void flash_backward(const at::Tensor& qi, const at::Tensor& kj, const at::Tensor& vj, const at::Tensor& doi,
                    const at::Tensor& outi, const at::Tensor& lsei, bool diagonal, double scale, at::ScalarType lp,
                    at::Tensor dqi, at::Tensor dkj, at::Tensor dvj) {
  const int64_t cq = qi.size(2), ck = kj.size(2);
  // dropout 0: the random-state arguments are not read; pass well-formed ones.
  at::Tensor philox = at::zeros({2}, at::TensorOptions().dtype(at::kLong));
  auto g = at::_scaled_dot_product_flash_attention_backward(
      doi.to(lp).contiguous(), qi.to(lp).contiguous(), kj.to(lp).contiguous(), vj.to(lp).contiguous(),
      outi.to(lp).contiguous(), lsei.contiguous(), at::Tensor(), at::Tensor(), cq, ck, 0.0, diagonal, philox[0],
      philox[1], scale);
  dqi.add_(std::get<0>(g));
  dkj.add_(std::get<1>(g));
  dvj.add_(std::get<2>(g));
}

std::atomic<int> g_flash_state{0};  // 0 unknown, 1 usable, -1 not

bool check_flash(const at::TensorOptions& opt, at::ScalarType lp, std::string& why) {
  try {
    at::NoGradGuard ng;
    const int64_t B = 1, H = 2, c = 64, D = 64;
    const double scale = 1.0 / std::sqrt(double(D));
    at::Generator gen = at::detail::createCPUGenerator(20261201);
    auto rnd = [&](std::vector<int64_t> shape) { return at::randn(shape, gen, at::kFloat).to(opt.dtype(lp)).to(at::kFloat); };
    at::Tensor q = rnd({B, H, 2 * c, D}), k = rnd({B, H, 2 * c, D}), v = rnd({B, H, 2 * c, D}), dout = rnd({B, H, c, D});
    at::Tensor qi = q.narrow(2, c, c), bias = causal_bias(c, opt.dtype(at::kFloat));
    // Query chunk 1 against key chunks 0 (full) and 1 (diagonal), both ways.
    Accumulator ref, fl;
    for (int64_t j = 0; j < 2; ++j) {
      at::Tensor kj = k.narrow(2, j * c, c), vj = v.narrow(2, j * c, c);
      at::Tensor sc = at::matmul(qi, kj.transpose(-2, -1)).mul_(scale);
      if (j == 1) sc.add_(bias);
      ref.add(sc, vj);
      FlashBlock b = flash_forward(qi, kj, vj, j == 1, scale, lp);
      fl.add_block(b.o, b.lse);
    }
    auto rel = [](const at::Tensor& a, const at::Tensor& b) {
      return (a - b).norm().item<double>() / std::max(1e-30, b.norm().item<double>());
    };
    const double e_out = rel(fl.output(), ref.output()), e_lse = rel(fl.lse(), ref.lse());
    at::Tensor out = ref.output(), lse = ref.lse(), delta = (dout * out).sum(-1).unsqueeze(-1);
    at::Tensor dq_r = at::zeros_like(qi), dk_r = at::zeros({B, H, 2 * c, D}, opt.dtype(at::kFloat)), dv_r = at::zeros_like(dk_r);
    at::Tensor dq_f = at::zeros_like(dq_r), dk_f = at::zeros_like(dk_r), dv_f = at::zeros_like(dk_r);
    for (int64_t j = 0; j < 2; ++j) {
      at::Tensor kj = k.narrow(2, j * c, c), vj = v.narrow(2, j * c, c);
      block_backward(qi, kj, vj, dout, lse.unsqueeze(-1), delta, j == 1 ? bias : at::Tensor(), scale, 0.0, dq_r,
                     dk_r.narrow(2, j * c, c), dv_r.narrow(2, j * c, c));
      flash_backward(qi, kj, vj, dout, out, lse, j == 1, scale, lp, dq_f, dk_f.narrow(2, j * c, c), dv_f.narrow(2, j * c, c));
    }
    const double e_dq = rel(dq_f, dq_r), e_dk = rel(dk_f, dk_r), e_dv = rel(dv_f, dv_r);
    const double worst = std::max({e_out, e_lse, e_dq, e_dk, e_dv});
    why = fmt::format("relative errors out {:.1e}, lse {:.1e}, dq {:.1e}, dk {:.1e}, dv {:.1e}", e_out, e_lse, e_dq, e_dk, e_dv);
    if (worst < 5e-2) return true;
  } catch (const std::exception& e) {
    why = e.what();
    why = why.substr(0, why.find('\n'));
  }
  return false;
}

// Whether the blocks of this call run on flash kernels: bf16/fp16 CUDA inputs, head_dim a multiple
// of 8 up to 256, and the one-time check passed.
bool use_flash(const at::Tensor& q) {
  if (!q.is_cuda() || (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf)) return false;
  if (q.size(3) % 8 != 0 || q.size(3) > 256) return false;
  if (const char* env = std::getenv("MFSDP_CP_ATTENTION"))
    if (std::string(env) == "math") return false;
  int state = g_flash_state.load();
  if (state == 0) {
    std::string why;
    state = check_flash(q.options(), q.scalar_type(), why) ? 1 : -1;
    if (state < 0)
      std::fprintf(stderr, "mfsdp: warning: context parallel: the flash-attention blocks failed their check (%s); "
                   "using the matmul blocks\n", why.c_str());
    else
      std::fprintf(stderr, "mfsdp: context parallel: flash-attention blocks in use (%s)\n", why.c_str());
    g_flash_state.store(state);
  }
  return state > 0;
}

// End of a forward: saves what backward needs (inputs, output, log-sum-exp of both local chunks)
// and returns the output in q's dtype.
at::Tensor finish_forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const Accumulator (&acc)[2]) {
  const int64_t H = q.size(1);
  auto lse_of = [&](const Accumulator& a) { return a.lse().reshape({q.size(0), H, -1}); };
  at::Tensor out = at::cat({from_groups(acc[0].output(), H), from_groups(acc[1].output(), H)}, 2);
  ctx->save_for_backward({q, k, v});
  // A detached alias: the returned tensor may be `out` itself (fp32), and a node holding its own
  // output would be a reference cycle that leaks every step's activations.
  ctx->saved_data["out"] = out.detach();
  ctx->saved_data["lse"] = at::cat({lse_of(acc[0]), lse_of(acc[1])}, 2);
  return out.to(q.scalar_type());
}

struct CpAttention : public torch::autograd::Function<CpAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, double cap) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["cap"] = cap;
    Communicator& c = *g_cp.load();
    const int64_t C = c.size(), r = c.rank(), Tl = q.size(2), half = Tl / 2;
    at::Tensor qf = q.to(at::kFloat);
    const bool flash = cap <= 0 && k.size(1) == q.size(1) && use_flash(q);  // no soft cap, no groups there
    ctx->saved_data["flash"] = flash;
    Gathered kv = gather_kv(c, k, v);
    const int64_t Hk = k.size(1);
    at::Tensor bias = grouped_bias(half, q.size(1) / Hk, qf.options());
    Accumulator acc[2];
    for (int64_t a = 0; a < 2; ++a) {
      const int64_t i = global_chunk(a, r, C);
      at::Tensor qi = flash ? qf.narrow(2, a * half, half) : to_groups(qf.narrow(2, a * half, half), Hk);
      for (int64_t j = 0; j <= i; ++j) {
        if (flash) {
          FlashBlock fb = flash_forward(qi, kv.k[size_t(j)], kv.v[size_t(j)], j == i, scale, q.scalar_type());
          acc[a].add_block(fb.o, fb.lse);
          continue;
        }
        at::Tensor s = block_scores(qi, kv.k[size_t(j)], scale, cap);
        if (j == i) s.add_(bias);
        acc[a].add(s, kv.v[size_t(j)]);
      }
    }
    return finish_forward(ctx, q, k, v, acc);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Communicator& c = *g_cp.load();
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    const int64_t C = c.size(), r = c.rank(), Tl = q.size(2), half = Tl / 2;
    const double scale = ctx->saved_data["scale"].toDouble(), cap = ctx->saved_data["cap"].toDouble();
    at::Tensor qf = q.to(at::kFloat), out = ctx->saved_data["out"].toTensor(), lse = ctx->saved_data["lse"].toTensor();
    at::Tensor dout = grads[0].to(at::kFloat);
    at::Tensor delta = (dout * out).sum(-1);  // rowsum(dO o O)
    const bool flash = ctx->saved_data["flash"].toBool();
    Gathered kv = gather_kv(c, k, v);
    // Gradients of every global key/value chunk, in the gathered (rank-major) layout, so that one
    // reduce-scatter hands each owner the sums for its own chunks.
    at::Tensor dkv_all = at::zeros_like(kv.buffer);
    std::vector<at::Tensor> dk_chunks = chunk_views(dkv_all, 0), dv_chunks = chunk_views(dkv_all, 1);
    at::Tensor dq = at::zeros_like(qf);
    const int64_t B = q.size(0), H = q.size(1), Hk = k.size(1);
    at::Tensor bias = grouped_bias(half, H / Hk, qf.options());
    for (int64_t a = 0; a < 2; ++a) {
      const int64_t i = global_chunk(a, r, C);
      at::Tensor qi = qf.narrow(2, a * half, half), doi = dout.narrow(2, a * half, half);
      at::Tensor lsei = lse.narrow(2, a * half, half).unsqueeze(-1), di = delta.narrow(2, a * half, half).unsqueeze(-1);
      at::Tensor dqi = dq.narrow(2, a * half, half);
      if (!flash) {  // the grouped layout (to_groups); dQ of the chunk is written back below
        qi = to_groups(qi, Hk);
        doi = to_groups(doi, Hk);
        lsei = lsei.reshape({B, Hk, -1, 1});
        di = di.reshape({B, Hk, -1, 1});
        dqi = at::zeros_like(qi);
      }
      for (int64_t j = 0; j <= i; ++j) {
        if (flash)
          flash_backward(qi, kv.k[size_t(j)], kv.v[size_t(j)], doi, out.narrow(2, a * half, half),
                         lse.narrow(2, a * half, half), j == i, scale, q.scalar_type(), dqi, dk_chunks[size_t(j)],
                         dv_chunks[size_t(j)]);
        else
          block_backward(qi, kv.k[size_t(j)], kv.v[size_t(j)], doi, lsei, di, j == i ? bias : at::Tensor(), scale, cap,
                         dqi, dk_chunks[size_t(j)], dv_chunks[size_t(j)]);
      }
      if (!flash) dq.narrow(2, a * half, half).copy_(from_groups(dqi, H));
    }
    at::Tensor dkv = at::empty(kv.buffer.sizes().slice(1), qf.options());  // [2, B, H, T/C, D]
    {
      FlightTag t("context-parallel reduce-scatter of key/value gradients");
      c.reduce_scatter(dkv.view({-1}), dkv_all.view({-1}), ReduceOp::kSum);
    }
    return {dq.to(q.scalar_type()), dkv[0].to(k.scalar_type()), dkv[1].to(v.scalar_type()), at::Tensor(), at::Tensor()};
  }
};

// The ring (cp_comm_type p2p). Step t computes on the keys/values that rank r - t holds (its
// chunks r-t and 2C-1-(r-t)) while those of rank r - t - 1 arrive; a block is skipped when its
// key chunk lies after the query chunk (the causal mask), so every rank does 2C + 1 blocks.
struct RingCpAttention : public torch::autograd::Function<RingCpAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale, double cap) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["cap"] = cap;
    Communicator& c = *g_cp.load();
    const int64_t C = c.size(), r = c.rank(), half = q.size(2) / 2;
    const int next = int((r + 1) % C), prev = int((r + C - 1) % C);
    at::Tensor qf = q.to(at::kFloat);
    const bool flash = cap <= 0 && k.size(1) == q.size(1) && use_flash(q);
    ctx->saved_data["flash"] = flash;
    at::Tensor cur = at::stack({k.to(at::kFloat), v.to(at::kFloat)});  // [2, B, Hk, T/C, D]
    const int64_t Hk = k.size(1);
    at::Tensor bias = grouped_bias(half, q.size(1) / Hk, qf.options());
    at::Tensor qs[2];  // the local query chunks, grouped unless flash
    for (int64_t a = 0; a < 2; ++a)
      qs[a] = flash ? qf.narrow(2, a * half, half) : to_groups(qf.narrow(2, a * half, half), Hk);
    Accumulator acc[2];
    for (int64_t t = 0; t < C; ++t) {
      const int64_t src = (r - t + C) % C;
      at::Tensor incoming;
      WorkHandle w;
      if (t + 1 < C) {  // the next step's keys/values travel while this step computes
        incoming = at::empty_like(cur);
        FlightTag tag("context-parallel ring exchange of keys/values");
        w = c.send_recv_async(cur, next, incoming, prev);
      }
      for (int64_t a = 0; a < 2; ++a) {
        const int64_t i = global_chunk(a, r, C);
        const at::Tensor& qi = qs[a];
        for (int64_t b = 0; b < 2; ++b) {
          const int64_t j = global_chunk(b, src, C);
          if (j > i) continue;
          if (flash) {
            FlashBlock fb = flash_forward(qi, cur[0].narrow(2, b * half, half), cur[1].narrow(2, b * half, half), j == i,
                                          scale, q.scalar_type());
            acc[a].add_block(fb.o, fb.lse);
            continue;
          }
          at::Tensor s = block_scores(qi, cur[0].narrow(2, b * half, half), scale, cap);
          if (j == i) s.add_(bias);
          acc[a].add(s, cur[1].narrow(2, b * half, half));
        }
      }
      if (w) {
        w->wait();
        cur = incoming;
      }
    }
    return finish_forward(ctx, q, k, v, acc);
  }

  // The keys/values travel with their gradient accumulators: after step t the bundle of rank
  // r - t moves on to r + 1, so after C steps every accumulator is back with its owner. The bundle
  // moves after the step's blocks: sending the keys/values ahead (overlapped) was built and
  // measured; it was no faster on the CPU, and in the runs made its peak memory at cp 4 came out
  // higher (134 vs 74 MiB of activations at 4096 tokens), while holding less is the ring's point.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Communicator& c = *g_cp.load();
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    const int64_t C = c.size(), r = c.rank(), half = q.size(2) / 2;
    const int next = int((r + 1) % C), prev = int((r + C - 1) % C);
    const double scale = ctx->saved_data["scale"].toDouble(), cap = ctx->saved_data["cap"].toDouble();
    at::Tensor qf = q.to(at::kFloat), out = ctx->saved_data["out"].toTensor(), lse = ctx->saved_data["lse"].toTensor();
    at::Tensor dout = grads[0].to(at::kFloat);
    at::Tensor delta = (dout * out).sum(-1);
    const bool flash = ctx->saved_data["flash"].toBool();
    // bundle[0] = keys/values [2, B, H, T/C, D], bundle[1] = their gradients so far.
    at::Tensor bundle = at::stack({at::stack({k.to(at::kFloat), v.to(at::kFloat)}), at::zeros({2, k.size(0), k.size(1), k.size(2), k.size(3)}, qf.options())});
    at::Tensor dq = at::zeros_like(qf);
    const int64_t B = q.size(0), H = q.size(1), Hk = k.size(1);
    at::Tensor bias = grouped_bias(half, H / Hk, qf.options());
    // Per local chunk: queries, output gradients, lse and delta (grouped unless flash) and the dQ
    // accumulator (grouped: written back into dq after the ring).
    at::Tensor qs[2], dos[2], lses[2], ds_[2], dqs[2];
    for (int64_t a = 0; a < 2; ++a) {
      qs[a] = qf.narrow(2, a * half, half);
      dos[a] = dout.narrow(2, a * half, half);
      lses[a] = lse.narrow(2, a * half, half).unsqueeze(-1);
      ds_[a] = delta.narrow(2, a * half, half).unsqueeze(-1);
      dqs[a] = dq.narrow(2, a * half, half);
      if (!flash) {
        qs[a] = to_groups(qs[a], Hk);
        dos[a] = to_groups(dos[a], Hk);
        lses[a] = lses[a].reshape({B, Hk, -1, 1});
        ds_[a] = ds_[a].reshape({B, Hk, -1, 1});
        dqs[a] = at::zeros_like(qs[a]);
      }
    }
    for (int64_t t = 0; t < C; ++t) {
      const int64_t src = (r - t + C) % C;
      at::Tensor kv = bundle[0], dkv = bundle[1];
      for (int64_t a = 0; a < 2; ++a) {
        const int64_t i = global_chunk(a, r, C);
        const at::Tensor &qi = qs[a], &doi = dos[a], &lsei = lses[a], &di = ds_[a], &dqi = dqs[a];
        for (int64_t b = 0; b < 2; ++b) {
          const int64_t j = global_chunk(b, src, C);
          if (j > i) continue;
          if (flash) {
            flash_backward(qi, kv[0].narrow(2, b * half, half), kv[1].narrow(2, b * half, half), doi,
                           out.narrow(2, a * half, half), lse.narrow(2, a * half, half), j == i, scale, q.scalar_type(),
                           dqi, dkv[0].narrow(2, b * half, half), dkv[1].narrow(2, b * half, half));
            continue;
          }
          block_backward(qi, kv[0].narrow(2, b * half, half), kv[1].narrow(2, b * half, half), doi, lsei, di,
                         j == i ? bias : at::Tensor(), scale, cap, dqi, dkv[0].narrow(2, b * half, half),
                         dkv[1].narrow(2, b * half, half));
        }
      }
      if (C == 1) break;
      at::Tensor incoming = at::empty_like(bundle);
      {
        FlightTag tag("context-parallel ring exchange of keys/values and their gradients");
        c.send_recv(bundle, next, incoming, prev);
      }
      bundle = incoming;
    }
    if (!flash)
      for (int64_t a = 0; a < 2; ++a) dq.narrow(2, a * half, half).copy_(from_groups(dqs[a], H));
    at::Tensor dkv = bundle[1];  // home again: the gradients of this rank's own chunks
    return {dq.to(q.scalar_type()), dkv[0].to(k.scalar_type()), dkv[1].to(v.scalar_type()), at::Tensor(), at::Tensor()};
  }
};

// Plain causal attention (no CP group): what the replaced core computes, for cp_attention's
// callers without a group (tests) and for inference below autograd.
at::Tensor local_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, double cap) {
  at::Tensor s = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-2, -1)) * scale;
  if (cap > 0) s = at::tanh(s / cap) * cap;
  s = s + causal_bias(q.size(2), s.options());
  return at::matmul(at::softmax(s, -1), v.to(at::kFloat)).to(q.scalar_type());
}

at::Tensor cp_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) { return cp_attention(q, k, v); }

// The mask of a replaced scaled_dot_product_attention must be the causal mask a Hugging Face model
// builds for this rank's tokens, which it then no longer needs (the blockwise attention masks by
// global position): causal over the local sequence, or, because HF reads the jump in CP's
// position ids between the rank's two chunks as two packed sequences, causal within each chunk.
// Boolean (true: attend) or additive (0: attend, <= -1e30 or -inf: not). Checked once per mask
// tensor (HF builds one per forward, shared by every layer).
void check_causal_mask(const at::Tensor& mask, int64_t T, const std::string& where,
                       const char* call = "scaled_dot_product_attention") {
  thread_local const void* last_ok = nullptr;
  thread_local std::vector<int64_t> last_sizes;
  if (mask.data_ptr() == last_ok && mask.sizes().vec() == last_sizes) return;
  at::NoGradGuard ng;
  auto fail = [&](const std::string& why) {
    throw UserError(std::string(kUserErrorTag) + "context parallel: the " + call + " call in " + where +
                    " has an attention mask " +
                    why + "; only the causal mask (as Hugging Face models build it) can be replaced by the blockwise "
                    "causal attention (a padding, sliding-window or document mask cannot)");
  };
  if (mask.dim() < 2 || mask.size(-1) != T || mask.size(-2) != T)
    fail(fmt::format("of shape [{}] (expected [..., {}, {}])", fmt::join(mask.sizes(), ", "), T, T));
  at::Tensor m = mask.to(at::kCPU);
  at::Tensor allowed, ok_values;
  if (m.scalar_type() == at::kBool) {
    allowed = m;
  } else {
    at::Tensor f = m.to(at::kFloat);
    allowed = f.eq(0);
    ok_values = allowed.logical_or(f.le(-1e30)).all();
    if (!ok_values.item<bool>()) fail("with values other than 0 and -inf (or the dtype's lowest)");
  }
  at::Tensor idx = at::arange(T, at::kLong);
  at::Tensor causal = idx.unsqueeze(1).ge(idx.unsqueeze(0));
  at::Tensor chunk = idx.div(std::max<int64_t>(1, T / 2), "floor");
  at::Tensor chunked = causal.logical_and(chunk.unsqueeze(1).eq(chunk.unsqueeze(0)));
  if (!allowed.eq(causal).all().item<bool>() && !allowed.eq(chunked).all().item<bool>()) fail("that is not causal");
  last_ok = mask.data_ptr();
  last_sizes = mask.sizes().vec();
}

at::Tensor cp_sdpa_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                      std::optional<double> scale, c10::string_view where) {
  if (mask && mask->defined()) check_causal_mask(*mask, q.size(2), std::string(where));
  return cp_attention(q, k, v, scale.value_or(0.0));
}

// What CP puts in place of mfsdp::attention: its mask checked as cp_sdpa's, then the blockwise
// causal attention with the same scale and soft cap. Eager attention with no mask attends to the
// whole sequence both ways, which the blockwise causal attention is not.
at::Tensor cp_eager_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                       double scale, std::optional<double> softcap, c10::string_view where) {
  if (!mask || !mask->defined())
    throw UserError(std::string(kUserErrorTag) + "context parallel: the mfsdp::attention call in " + std::string(where) +
                    " has no attention mask (attention over the whole sequence, not causal); only causal attention "
                    "can be replaced by the blockwise causal attention");
  check_causal_mask(*mask, q.size(2), std::string(where), "mfsdp::attention");
  return cp_attention(q, k, v, scale, softcap.value_or(0.0));
}


class ContextParallelImpl final : public ContextParallel {
 public:
  ContextParallelImpl(Model& model, const Config& cfg, ProcessGroups& pg) : model_(model), cfg_(cfg), cp_(pg.get(MeshGroup::kCp)) {
    // Measurement knob (bench/cp_memory.sh): the blockwise attention at cp_size 1 too, to separate
    // what the algorithm saves from what splitting the sequence saves.
    const char* knob = std::getenv("MFSDP_CP_ATTENTION_AT_CP1");
    active_ = cp_.size() > 1 || (knob && std::string(knob) == "1");
    if (!active_) return;
    const auto& patterns = cfg.distributed.core_attention_modules;
    core_paths_ = model.modules_matching(patterns);
    std::set<const c10::ClassType*> core_types;
    for (const auto& path : core_paths_) core_types.insert(submodule_at(model.module(), path).type().get());
    std::set<const c10::ClassType*> seen;
    for (const auto& nm : model.module().named_modules()) {
      torch::jit::Module m = nm.value;
      if (!seen.insert(m.type().get()).second || !m.find_method("forward")) continue;
      auto& fn = torch::jit::toGraphFunction(m.get_method("forward").function());
      // No core-attention module (Hugging Face models call a function): the scaled_dot_product_
      // attention calls themselves are replaced.
      if (core_types.empty())
        replace_sdpa(fn.graph()->block(), nm.name.empty() ? "the model's forward" : nm.name + ".forward");
      else
        replace_calls(fn.graph()->block(), core_types, nm.name);
    }
    // Repeated calls the trace recorded as graphs of their own that differ from forward
    // (graph_rewrite.h, unify_traced_repeats): their attention is replaced too.
    for (const std::string& repeat : model.traced_repeats()) {
      const auto [path, method] = split_traced_repeat(repeat);
      torch::jit::Module m = path.empty() ? model.module() : submodule_at(model.module(), path);
      auto& fn = torch::jit::toGraphFunction(m.get_method(method).function());
      if (core_types.empty()) replace_sdpa(fn.graph()->block(), repeat);
      else replace_calls(fn.graph()->block(), core_types, path);
    }
    if (core_types.empty() && replaced_ == 0)
      throw ConfigError(cfg.where("distributed.core_attention_modules") +
                        ": distributed.cp_size > 1 replaces the model's attention core, and distributed.core_attention_modules [" +
                        join(patterns, ", ") + "] matches no module of " + model.path() +
                        ", nor does the model call aten::scaled_dot_product_attention (or mfsdp::attention, scripts/export_hf.py's eager "
                        "attention). The model contract: "
                        "softmax(QK^T/sqrt(d))V with a causal mask is a submodule of its own, "
                        "forward(q, k, v) on [batch, heads, seq, head_dim] (README \"Model contract\"). The model's modules:\n" +
                        model.module_tree());
    if (core_types.empty()) {
      core_paths_ = {fmt::format("{} in {}", replaced_op_, sdpa_where_)};
      refuse_local_attention(model, cfg);
    }
    if (replaced_ == 0)
      throw ConfigError(cfg.where("distributed.core_attention_modules") + ": the attention-core modules (" +
                        core_paths_.front() + ", ...) are never called through their forward in the model's graphs");
    set_cp_context(&cp_, cfg.distributed.cp_comm_type == "p2p");
  }
  ~ContextParallelImpl() override {
    if (active_) set_cp_context(nullptr);
  }

  Batch slice(const Batch& b) const override {
    if (cp_.size() == 1) return b;
    const int64_t C = cp_.size(), r = cp_.rank(), T = b.tokens.size(1), c = T / (2 * C);
    auto take = [&](const at::Tensor& x) {
      return at::cat({x.narrow(1, r * c, c), x.narrow(1, (2 * C - 1 - r) * c, c)}, 1);
    };
    return Batch{take(b.tokens), take(b.targets), take(b.loss_mask), take(b.position_ids)};
  }

  std::string describe() const override {
    if (!active_) return "";
    return fmt::format("context parallel: cp_size {}, rank {} holds sequence chunks {} and {} of {} ({} tokens each); {} "
                       "attention-core calls replaced (module {}{}): {}, blockwise causal attention with log-sum-exp merging "
                       "(blocks: flash-attention kernels for bf16/fp16 on GPUs, checked at first use; else fp32 matmuls)",
                       cp_.size(), cp_.rank(), cp_.rank(), 2 * cp_.size() - 1 - cp_.rank(), 2 * cp_.size(),
                       cfg_.training.seq_length / (2 * cp_.size()), replaced_, core_paths_.front(),
                       core_paths_.size() > 1 ? fmt::format(" and {} more", core_paths_.size() - 1) : "",
                       cfg_.distributed.cp_comm_type == "p2p"
                           ? "keys/values passed around a ring (overlapped with the blocks), their gradients riding along"
                           : "keys/values all-gathered, their gradients reduce-scattered");
  }

 private:
  void replace_calls(torch::jit::Block* block, const std::set<const c10::ClassType*>& core, const std::string& where) {
    for (auto it = block->nodes().begin(); it != block->nodes().end();) {
      torch::jit::Node* node = *it;
      ++it;
      for (auto* sub : node->blocks()) replace_calls(sub, core, where);
      if (node->kind() != c10::prim::CallMethod || node->s(c10::attr::name) != "forward") continue;
      auto cls = node->input(0)->type()->cast<c10::ClassType>();
      if (!cls || !core.count(cls.get())) continue;
      if (node->inputs().size() != 4 || !is_tensor_value(node->input(1)) || !is_tensor_value(node->input(2)) ||
          !is_tensor_value(node->input(3)) || node->outputs().size() != 1)
        throw UserError("context parallel: a call of attention core " + cls->name()->name() + " in " +
                        (where.empty() ? "the model's forward" : where + ".forward") +
                        " is not forward(q, k, v) -> Tensor on [batch, heads, seq, head_dim] (model contract)");
      torch::jit::Graph& g = *node->owningGraph();
      torch::jit::WithInsertPoint guard(node);
      torch::jit::Value* out =
          g.insert(c10::Symbol::fromQualString("mfsdp::cp_attention"), {node->input(1), node->input(2), node->input(3)});
      out->setType(node->output()->type());
      node->output()->replaceAllUsesWith(out);
      node->destroy();
      ++replaced_;
    }
  }

  // Each aten::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale[, enable_gqa])
  // becomes mfsdp::cp_sdpa(q, k, v, mask, scale, where) when its arguments say causal attention:
  // dropout_p the constant 0, is_causal a constant (true with no mask; false with a mask that
  // cp_sdpa checks to be causal when it runs), enable_gqa a constant, scale a constant or None.
  // Fewer key/value heads than query heads (enable_gqa, or one head broadcast) are repeated by
  // cp_attention.
  void replace_sdpa(torch::jit::Block* block, const std::string& where) {
    static const c10::Symbol sdpa = c10::Symbol::fromQualString("aten::scaled_dot_product_attention");
    static const c10::Symbol eager = c10::Symbol::fromQualString("mfsdp::attention");
    for (auto it = block->nodes().begin(); it != block->nodes().end();) {
      torch::jit::Node* node = *it;
      ++it;
      for (auto* sub : node->blocks()) replace_sdpa(sub, where);
      if (node->kind() == eager) {
        replace_eager(node, where);
        continue;
      }
      if (node->kind() != sdpa) continue;
      auto bad = [&](const std::string& why) {
        throw UserError("context parallel: the scaled_dot_product_attention call in " + where + " " + why +
                        "; context parallelism replaces only causal attention without dropout (export the model "
                        "with its attention dropout 0, or give it a core-attention module: README \"Model contract\")");
      };
      if (node->inputs().size() < 7) bad("has an unexpected signature");
      auto constant = [](torch::jit::Value* v) { return torch::jit::toIValue(v); };
      auto dropout = constant(node->input(4));
      if (!dropout || !dropout->isDouble() || dropout->toDouble() != 0.0) bad("has dropout (dropout_p is not the constant 0)");
      auto causal = constant(node->input(5));
      if (!causal || !causal->isBool()) bad("takes is_causal from a value computed at run time");
      const bool mask_none = node->input(3)->type()->kind() == c10::TypeKind::NoneType;
      if (!causal->toBool() && mask_none) bad("is not causal (is_causal false and no mask)");
      if (causal->toBool() && !mask_none) bad("has both is_causal and a mask");
      auto scale = constant(node->input(6));
      if (!scale || !(scale->isNone() || scale->isDouble())) bad("takes its scale from a value computed at run time");
      if (node->inputs().size() > 7) {
        auto gqa = constant(node->input(7));
        if (!gqa || !gqa->isBool()) bad("takes enable_gqa from a value computed at run time");
      }
      torch::jit::Graph& g = *node->owningGraph();
      torch::jit::WithInsertPoint guard(node);
      torch::jit::Value* where_v = g.insertConstant(where);
      torch::jit::Value* out = g.insert(c10::Symbol::fromQualString("mfsdp::cp_sdpa"),
                                        {node->input(0), node->input(1), node->input(2), node->input(3), node->input(6), where_v});
      out->setType(node->output()->type());
      node->output()->replaceAllUsesWith(out);
      node->destroy();
      if (replaced_++ == 0) {
        sdpa_where_ = where;
        replaced_op_ = "aten::scaled_dot_product_attention";
      }
    }
  }

  // mfsdp::attention(q, k, v, mask, scale, softcap) becomes mfsdp::cp_eager(q, k, v, mask, scale,
  // softcap, where); a call without a mask is non-causal (refused here when the trace says so, at
  // run time when the mask turns out undefined).
  void replace_eager(torch::jit::Node* node, const std::string& where) {
    if (node->inputs().size() != 6 || node->outputs().size() != 1)
      throw UserError("context parallel: the mfsdp::attention call in " + where + " has an unexpected signature");
    if (node->input(3)->type()->kind() == c10::TypeKind::NoneType)
      throw UserError("context parallel: the mfsdp::attention call in " + where +
                      " has no attention mask (attention over the whole sequence, not causal); only causal attention "
                      "can be replaced by the blockwise causal attention");
    torch::jit::Graph& g = *node->owningGraph();
    torch::jit::WithInsertPoint guard(node);
    torch::jit::Value* where_v = g.insertConstant(where);
    torch::jit::Value* out = g.insert(c10::Symbol::fromQualString("mfsdp::cp_eager"),
                                      {node->input(0), node->input(1), node->input(2), node->input(3), node->input(4),
                                       node->input(5), where_v});
    out->setType(node->output()->type());
    node->output()->replaceAllUsesWith(out);
    node->destroy();
    if (replaced_++ == 0) {
      sdpa_where_ = where;
      replaced_op_ = "mfsdp::attention";
    }
  }

  // A Hugging Face model whose layers attend within a window (sliding or chunked attention) shorter
  // than the sequence cannot be made context parallel by replacing its sdpa calls: the blockwise
  // attention is causal over the whole sequence. The mask check in cp_sdpa does not always see it:
  // a rank holds two chunks of the sequence, and a window or attention chunk as long as a CP chunk
  // builds the same mask as the one HF builds from CP's position ids (causal within each chunk). So
  // the exporter's record of the config's window (mfsdp/hf_export.json attention_window) decides.
  static void refuse_local_attention(const Model& model, const Config& cfg) {
    if (model.stored_hf_export().empty()) return;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(model.stored_hf_export());
    } catch (const std::exception&) {
      return;  // checkpoint export reports a broken record; nothing here depends on the rest of it
    }
    auto w = j.find("attention_window");
    if (w == j.end() || !w->is_object() || !(*w)["size"].is_number_integer()) return;
    const int64_t size = (*w)["size"].get<int64_t>();
    const std::string layers = (*w).value("layers", std::string("its layers"));
    const std::string source = (*w).value("source", std::string("the model's config"));
    if (size <= 0)
      throw ConfigError(cfg.where("distributed.cp_size") +
                        fmt::format(": context parallelism splits the sequence and replaces {}'s attention calls, but "
                                    "its config gives {} a sequence mixing that is no softmax attention ({}), which "
                                    "would then see only this rank's chunks; train it without CP",
                                    model.path(), layers, source));
    if (size >= cfg.training.seq_length) return;
    throw ConfigError(cfg.where("distributed.cp_size") +
                      fmt::format(": context parallelism replaces {}'s attention by causal attention over the whole "
                                  "sequence, but its config restricts {} to a window of {} tokens ({}), shorter than "
                                  "training.seq_length {}; train it without CP, or with a sequence no longer than the window",
                                  model.path(), layers, size, source, cfg.training.seq_length));
  }

  Model& model_;
  const Config& cfg_;
  Communicator& cp_;
  bool active_ = false;
  std::string sdpa_where_, replaced_op_;
  std::vector<std::string> core_paths_;
  int replaced_ = 0;
};

}  // namespace

void set_cp_context(Communicator* cp, bool ring) {
  g_cp.store(cp);
  g_ring.store(ring);
}

at::Tensor cp_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, double softcap) {
  if (scale <= 0) scale = 1.0 / std::sqrt(double(q.size(3)));
  Communicator* c = g_cp.load();
  // Grouped-query and multi-query attention (Falcon's single key/value head, sdpa's enable_gqa):
  // key/value head j serves query heads j*G .. j*G+G-1. The matmul blocks take the groups as they
  // are (to_groups above: the keys and values exchanged over CP are the Hk heads); the flash
  // kernels and the plain attention without a CP group need equal head counts, so there the heads
  // are repeated G times (repeat_interleave; its backward sums each group's gradients back onto
  // the shared head).
  const bool grouped = q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() &&
                       k.size(1) != q.size(1) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
                       k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3);
  // Measurement knob (bench/cp_memory.sh): MFSDP_CP_GQA=repeat repeats the heads everywhere, as
  // before the grouped blocks existed.
  static const bool repeat_knob = [] {
    const char* e = std::getenv("MFSDP_CP_GQA");
    return e && std::string(e) == "repeat";
  }();
  if (grouped && (!c || repeat_knob || (softcap <= 0 && use_flash(q)))) {
    const int64_t groups = q.size(1) / k.size(1);
    return cp_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), scale, softcap);
  }
  if (!c) return local_attention(q, k, v, scale, softcap);
  // Values of another head size than the queries' and keys' (DeepSeek's MLA: q/k heads of
  // qk_nope + qk_rope = 192, values of 128): the blocks and the exchange hold keys and values
  // stacked in one tensor, so the smaller side is padded with zeros to the larger. Zero value
  // columns give zero output columns (cut off again); zero query/key columns add nothing to the
  // scores (the scale is fixed above, from the real head size). Autograd drops the pads'
  // gradients. It costs the padding's share of the exchange and the P.V products (HF's flash path
  // pads MLA's values the same way).
  if (q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.size(3) == q.size(3) && v.size(3) != q.size(3)) {
    const int64_t dqk = q.size(3), dv = v.size(3);
    if (dv < dqk) return cp_attention(q, k, at::constant_pad_nd(v, {0, dqk - dv}), scale, softcap).narrow(3, 0, dv);
    return cp_attention(at::constant_pad_nd(q, {0, dv - dqk}), at::constant_pad_nd(k, {0, dv - dqk}), v, scale, softcap);
  }
  if (q.dim() != 4 || (!grouped && (k.sizes() != q.sizes() || v.sizes() != q.sizes())))
    throw UserError(fmt::format("context parallel attention: q, k, v must be [batch, heads, seq, head_dim] of one shape, "
                                "got [{}], [{}], [{}] (keys and values may have fewer heads only if theirs divide the "
                                "queries', and values another head_dim)",
                                fmt::join(q.sizes(), ", "), fmt::join(k.sizes(), ", "), fmt::join(v.sizes(), ", ")));
  if (q.size(2) % 2 != 0) throw UserError("context parallel attention: the local sequence must hold two equal chunks");
  return g_ring.load() ? RingCpAttention::apply(q, k, v, scale, softcap) : CpAttention::apply(q, k, v, scale, softcap);
}

std::unique_ptr<ContextParallel> apply_context_parallel(Model& model, const Config& cfg, ProcessGroups& pg) {
  return std::make_unique<ContextParallelImpl>(model, cfg, pg);
}

}  // namespace mfsdp

TORCH_LIBRARY_FRAGMENT(mfsdp, m) {
  m.def(torch::schema("mfsdp::cp_attention(Tensor q, Tensor k, Tensor v) -> Tensor", c10::AliasAnalysisKind::CONSERVATIVE));
  m.def(torch::schema("mfsdp::cp_sdpa(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale, str where) -> Tensor",
                      c10::AliasAnalysisKind::CONSERVATIVE));
  // (mfsdp::attention, which cp_eager replaces, is model/eager_attention.cpp's.)
  m.def(torch::schema("mfsdp::cp_eager(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float? softcap, str where) "
                      "-> Tensor",
                      c10::AliasAnalysisKind::CONSERVATIVE));
}

TORCH_LIBRARY_IMPL(mfsdp, CompositeImplicitAutograd, m) {
  m.impl("cp_attention", mfsdp::cp_attention_op);
  m.impl("cp_sdpa", mfsdp::cp_sdpa_op);
  m.impl("cp_eager", mfsdp::cp_eager_op);
}
