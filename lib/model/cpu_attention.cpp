// Attention on the CPU for short sequences (DESIGN.md section 7, "Attention on the CPU").
//
// Why: ATen's CPU flash attention walks 32-row query blocks against 512-key blocks with an online
// softmax, and its backward recomputes the logits: at bench/train_step.sh's shapes (8 x 4 heads x
// 128 tokens x 64) that is many small products around a rescaling loop, about 5 ms forward + backward
// per layer on one thread. Here each (batch, head) pair is a handful of BLAS products over 32-row
// blocks of the causal triangle (the blocks above the diagonal are never computed), the softmax is
// one vectorised pass per row (model/cpu_kernels.cpp), and the probabilities are kept for the
// backward, which is then four products and one pass: 2.8 against 5.1 ms per call (1 thread), 1.7
// against 3.0 ms (2 threads) at those shapes (bench/results_kernels.md, 2026-12-06). Keeping
// B x H x T x T floats is what bounds it to short sequences (kCpuAttentionMaxKeys).
//
// Layout: row-major per pair, rows strided as the tensors come (a q that is [B, T, H, D]
// transposed has rows H*D apart): the products read them in place, no copies. Pairs split over
// ATen's threads; each product runs on its thread (the BLAS runs single-threaded inside an OpenMP
// region).
#include "model/cpu_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "model/cpu_blas.h"
#include "model/cpu_kernels.h"
#include "model/cpu_random.h"
#include "util/error.h"

// The BLAS's Fortran sgemm, which LibTorch's MKL (and an OpenBLAS build) exports; weak, so that a
// LibTorch without one links and keeps ATen's attention (cpu_attention_takes says no).
extern "C" void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                       const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

namespace mfsdp {
namespace {

constexpr int64_t kRows = 32;  // query rows (and key columns) per block

// Row-major C[M, N] = alpha op(A) op(B) + beta C. A row-major matrix is its transpose in the
// BLAS's column-major order, so this is C^T = op(B)^T op(A)^T there: the operands swap.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc) {
  const char opa = tb ? 'T' : 'N', opb = ta ? 'T' : 'N';
  const int m = int(N), n = int(M), k = int(K), la = int(ldb), lb = int(lda), lc = int(ldc);
  sgemm_(&opa, &opb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

// The same on bf16 operands, accumulated and returned in fp32 (C is fp32): MKL's (model/cpu_blas.h).
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A, int64_t lda,
          const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  gemm_bf16_f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// Element types of the kernels: float, or bf16 as its bits (uint16_t). A bf16 call's products take
// bf16 operands and accumulate in fp32, as ATen's bf16 flash attention and flash attention on GPUs
// do: q, k, v and dO as they are; the probabilities and dS (fp32 here) rounded to bf16 for the
// products they enter; the products' fp32 results rounded into the bf16 outputs once (dK and dV
// after the last query head of their group, accumulated in fp32 until then).
template <typename T>
constexpr bool kIsBf16 = std::is_same_v<T, uint16_t>;
template <typename T>
const T* data_of(const at::Tensor& t) {
  if constexpr (kIsBf16<T>) return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::BFloat16>());
  else return t.const_data_ptr<float>();
}
template <typename T>
T* data_of(at::Tensor& t) {
  if constexpr (kIsBf16<T>) return reinterpret_cast<uint16_t*>(t.mutable_data_ptr<at::BFloat16>());
  else return t.mutable_data_ptr<float>();
}
float dot_of(const float* a, const float* b, int64_t n) { return dot_row(a, b, n); }
float dot_of(const uint16_t* a, const uint16_t* b, int64_t n) { return dot_row_bf16(a, b, n); }

// Operand rows for a product: fp32 rows as they are (T float), or rounded into `buf` (T bf16).
template <typename T>
const T* operand(const float* x, int64_t rows, int64_t n, std::vector<uint16_t>& buf) {
  if constexpr (kIsBf16<T>) {
    round_rows_bf16(x, n, buf.data(), n, rows, n);
    return buf.data();
  } else {
    (void)rows, (void)n, (void)buf;
    return x;
  }
}

// Where a product for output rows of T goes: a float output's own rows, or (bf16) an fp32 scratch
// of `ld` floats per row, rounded into the output by flush().
template <typename T>
struct OutRows {
  T* out;
  int64_t ld_out;
  float* acc;  // bf16: the fp32 scratch
  int64_t ld_acc;
  float* rows() {
    if constexpr (kIsBf16<T>) return acc;
    else return out;
  }
  int64_t ld() const { return kIsBf16<T> ? ld_acc : ld_out; }
  void flush(int64_t n_rows, int64_t n) {
    if constexpr (kIsBf16<T>) round_rows_bf16(acc, ld_acc, out, ld_out, n_rows, n);
  }
};

// A [B, H, T, D] tensor whose rows the products can read in place: unit stride within a row and
// rows at least a row apart (as the BLAS requires of its leading dimension).
bool rows_readable(const at::Tensor& t) {
  return (t.stride(3) == 1 || t.size(3) == 1) && (t.size(2) == 1 || t.stride(2) >= t.size(3));
}
at::Tensor readable(const at::Tensor& t) { return rows_readable(t) ? t : t.contiguous(); }
int64_t row_stride(const at::Tensor& t) { return t.size(2) == 1 ? t.size(3) : t.stride(2); }

// Pair (b, h)'s first row.
template <typename T>
const T* rows_of(const at::Tensor& t, int64_t b, int64_t h) {
  return data_of<T>(t) + b * t.stride(0) + h * t.stride(1);
}
template <typename T>
T* rows_of(at::Tensor& t, int64_t b, int64_t h) {
  return data_of<T>(t) + b * t.stride(0) + h * t.stride(1);
}

// [B, H, T, D] with the strides of a transposed [B, T, H, D]: what ATen's flash attention returns
// for the output and its gradients, so the caller's transpose back is a view.
at::Tensor heads_view(const at::Tensor& like, int64_t b, int64_t h, int64_t t, int64_t d) {
  return at::empty({b, t, h, d}, like.options()).transpose(1, 2);
}

// Where a block's logits go: its first row, and the distance between rows (in floats).
struct BlockRows {
  float* s;
  int64_t ld;
};

// A row of probabilities with dropout applied: from p into a (in place when they are one).
void drop_row(const AttentionDropout& drop, int64_t bh, int64_t Tq, int64_t Tk, int64_t r, const float* p, float* a,
              int64_t n) {
  dropout_apply(p, drop.keep + (bh * Tq + r) * Tk, drop.scale, a, n);
}

// The forward over every (batch, head) pair, by blocks of `rows` query rows: a block's scaled logits
// against the keys it reaches (causal: up to its last row) go where place(pair, first row, keys,
// this thread's scratch of `scratch_elems` floats) says, become probabilities in place (zero beyond
// a row's keys, to the row's end), and multiply v into o. L, when given, receives each row's
// log-sum-exp [B, H, Tq]. The two kernels differ only in where the logits live. With dropout the
// product takes the dropped probabilities: a copy when `kept` (the probabilities stay for the
// backward), else in place.
template <typename T, typename Place>
at::Tensor forward_blocks(const at::Tensor& q0, const at::Tensor& k0, const at::Tensor& v0, bool causal, double scale,
                          int64_t rows, size_t scratch_elems, float* L, const AttentionDropout* drop, bool kept,
                          Place place) {
  const at::Tensor q = readable(q0), k = readable(k0), v = readable(v0);
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2), D = q.size(3), Dv = v.size(3);
  const int64_t rep = H / k.size(1);  // query heads per key/value head (grouped-query attention)
  at::Tensor o = heads_view(q, B, H, Tq, Dv);
  const int64_t lq = row_stride(q), lk = row_stride(k), lv = row_stride(v), lo = row_stride(o);
  const size_t block = size_t(std::min(Tq, rows));
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(scratch_elems), dropped(drop && kept ? block * size_t(Tk) : 0);
    // bf16: a block's probabilities rounded, and its rows of o in fp32 before their rounding.
    std::vector<uint16_t> Ab(kIsBf16<T> ? block * size_t(Tk) : 0);
    std::vector<float> Of(kIsBf16<T> ? block * size_t(Dv) : 0);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const T *Q = rows_of<T>(q, b, h), *K = rows_of<T>(k, b, h / rep), *V = rows_of<T>(v, b, h / rep);
      T* O = rows_of<T>(o, b, h);
      for (int64_t r0 = 0; r0 < Tq; r0 += rows) {
        const int64_t r1 = std::min(Tq, r0 + rows), n = causal ? r1 : Tk;
        const BlockRows S = place(bh, r0, n, scratch.data());
        gemm(false, true, r1 - r0, n, D, float(scale), Q + r0 * lq, lq, K, lk, 0.0f, S.s, S.ld);
        for (int64_t r = r0; r < r1; ++r) {
          const float l = softmax_row(S.s + (r - r0) * S.ld, causal ? r + 1 : n, S.ld);
          if (L) L[bh * Tq + r] = l;
        }
        BlockRows A = S;
        if (drop) {
          if (kept) A = BlockRows{dropped.data(), n};
          for (int64_t r = r0; r < r1; ++r)
            drop_row(*drop, bh, Tq, Tk, r, S.s + (r - r0) * S.ld, A.s + (r - r0) * A.ld, n);
        }
        OutRows<T> out{O + r0 * lo, lo, Of.data(), Dv};
        if constexpr (kIsBf16<T>) {
          round_rows_bf16(A.s, A.ld, Ab.data(), n, r1 - r0, n);
          gemm(false, false, r1 - r0, Dv, n, 1.0f, Ab.data(), n, V, lv, 0.0f, out.rows(), out.ld());
        } else {
          gemm(false, false, r1 - r0, Dv, n, 1.0f, A.s, A.ld, V, lv, 0.0f, out.rows(), out.ld());
        }
        out.flush(r1 - r0, Dv);
      }
    }
  });
  return o;
}

// A backward's operands made readable, their sizes and row strides, and its gradients allocated as
// flash attention returns them.
// With grouped-query attention (Hk key/value heads, each read by rep = H / Hk query heads) dk and dv
// have Hk heads, and a key/value head's gradient sums its query heads': the backwards walk the
// (batch, key/value head) groups, each group's query heads one after the other on one thread, the
// first writing dK and dV (beta 0) and the others adding to them (beta 1).
struct BackwardOperands {
  at::Tensor q, k, v, o, g, dq, dk, dv;
  int64_t B, H, Hk, rep, Tq, Tk, D, Dv, lq, lk, lv, lo, lg, ldq, ldk, ldv;
  BackwardOperands(const at::Tensor& g0, const at::Tensor& q0, const at::Tensor& k0, const at::Tensor& v0,
                   const at::Tensor& o0)
      : q(readable(q0)), k(readable(k0)), v(readable(v0)), o(readable(o0)), g(readable(g0)), B(q.size(0)),
        H(q.size(1)), Hk(k.size(1)), rep(H / Hk), Tq(q.size(2)), Tk(k.size(2)), D(q.size(3)), Dv(v.size(3)) {
    dq = heads_view(q, B, H, Tq, D);
    dk = heads_view(k, B, Hk, Tk, D);
    dv = heads_view(v, B, Hk, Tk, Dv);
    lq = row_stride(q), lk = row_stride(k), lv = row_stride(v), lo = row_stride(o), lg = row_stride(g);
    ldq = row_stride(dq), ldk = row_stride(dk), ldv = row_stride(dv);
  }
};

}  // namespace

bool cpu_attention_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, bool gqa) {
  if (sgemm_ == nullptr) return false;
  const at::ScalarType dtype = q.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16) return false;
  for (const at::Tensor* t : {&q, &k, &v})
    if (!t->device().is_cpu() || t->scalar_type() != dtype || t->layout() != at::kStrided || t->dim() != 4)
      return false;
  const int64_t tk = k.size(2), hk = k.size(1);
  const bool heads = gqa ? hk >= 1 && v.size(1) == hk && q.size(1) % hk == 0 : hk == q.size(1) && v.size(1) == hk;
  return k.size(0) == q.size(0) && v.size(0) == q.size(0) && heads &&
         v.size(2) == tk && k.size(3) == q.size(3) && q.size(3) >= 1 && v.size(3) >= 1 && q.size(2) >= 1 && tk >= 1 &&
         (!causal || q.size(2) == tk) && (tk <= kCpuAttentionMaxKeys || causal);
}

bool cpu_attention_keeps_probs(int64_t keys) { return keys <= kCpuAttentionMaxKeys; }

void check_attention_bf16_knob() {
  const char* knob = std::getenv("MFSDP_ATTENTION_BF16");
  if (knob && *knob && std::string(knob) != "bf16" && std::string(knob) != "fp32")
    throw UserError(std::string("environment variable MFSDP_ATTENTION_BF16=") + knob +
                    ": expected \"bf16\" (bf16 products accumulated in fp32) or \"fp32\" (bf16 calls computed in fp32)");
}

bool cpu_attention_bf16_products() {
  if (!cpu_bf16_products_available()) return false;
  const char* knob = std::getenv("MFSDP_ATTENTION_BF16");
  if (knob && std::string(knob) == "fp32") return false;
  if (knob && std::string(knob) == "bf16") return true;
  return cpu_bf16_products_native();
}

bool is_causal_mask(const at::Tensor& mask, int64_t T) {
  if (!mask.device().is_cpu() || mask.layout() != at::kStrided || mask.dim() < 2 || mask.size(-1) != T ||
      mask.size(-2) != T)
    return false;
  const bool boolean = mask.scalar_type() == at::kBool;
  if (!boolean && !at::isFloatingType(mask.scalar_type())) return false;
  const at::Tensor m = boolean || mask.scalar_type() == at::kFloat ? mask.contiguous() : mask.to(at::kFloat).contiguous();
  const int64_t planes = m.numel() / (T * T);
  if (boolean) {  // each [T, T] plane byte for byte against the causal one (a bool is stored as 0 or 1)
    std::vector<uint8_t> causal(size_t(T * T), 0);
    for (int64_t i = 0; i < T; ++i) std::memset(causal.data() + i * T, 1, size_t(i + 1));
    const bool* at = m.const_data_ptr<bool>();
    for (int64_t p = 0; p < planes; ++p)
      if (std::memcmp(at + p * T * T, causal.data(), causal.size()) != 0) return false;
    return true;
  }
  const float* at = m.const_data_ptr<float>();
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t i = 0; i < T; ++i) {
      const float* row = at + (p * T + i) * T;
      bool ok = true;  // no early exit inside the row: the loops vectorise
      for (int64_t j = 0; j <= i; ++j) ok &= row[j] == 0.0f;
      for (int64_t j = i + 1; j < T; ++j) ok &= row[j] <= -1e9f;
      if (!ok) return false;
    }
  return true;
}

namespace {
// The element type's kernel for a call's dtype: bf16 calls need MKL's bf16 product.
template <typename Fn>
auto by_dtype(const at::Tensor& q, Fn fn) {
  if (q.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(cpu_bf16_products_available(), "mfsdp attention: bf16 products need MKL's cblas_gemm_bf16bf16f32");
    return fn(uint16_t{});
  }
  return fn(float{});
}
}  // namespace

at::Tensor cpu_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                 double scale, at::Tensor* probs, const AttentionDropout* drop) {
  const int64_t Tq = q.size(2), Tk = k.size(2);
  if (probs) *probs = at::empty({q.size(0), q.size(1), Tq, Tk}, q.options().dtype(at::kFloat));
  float* P = probs ? probs->mutable_data_ptr<float>() : nullptr;
  // Each pair's probabilities whole (kept, or a scratch of one pair without a backward), rows Tk apart.
  return by_dtype(q, [&](auto t) {
    return forward_blocks<decltype(t)>(q, k, v, causal, scale, kRows, P ? 0 : size_t(Tq * Tk), nullptr, drop,
                                       P != nullptr, [&](int64_t bh, int64_t r0, int64_t, float* scratch) {
                                         return BlockRows{(P ? P + bh * Tq * Tk : scratch) + r0 * Tk, Tk};
                                       });
  });
}

namespace {
template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_kept(const at::Tensor& g0, const at::Tensor& q0,
                                                             const at::Tensor& k0, const at::Tensor& v0,
                                                             const at::Tensor& o0, const at::Tensor& probs, bool causal,
                                                             double scale, const AttentionDropout* drop) {
  BackwardOperands x(g0, q0, k0, v0, o0);
  const float s = float(scale);
  constexpr bool bf16 = kIsBf16<T>;
  const size_t pair = size_t(x.Tq * x.Tk);
  at::parallel_for(0, x.B * x.Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> dS(pair), rowdot(static_cast<size_t>(x.Tq));
    std::vector<float> dropped(drop ? pair : 0);
    // bf16: A and dS rounded for their products; dK and dV of the group in fp32; a block of dQ in fp32.
    std::vector<uint16_t> Ab(bf16 ? pair : 0), dSb(bf16 ? pair : 0);
    std::vector<float> dKf(bf16 ? size_t(x.Tk * x.D) : 0), dVf(bf16 ? size_t(x.Tk * x.Dv) : 0),
        dQf(bf16 ? size_t(kRows * x.D) : 0);
    // Groups [begin, end) are the pairs [begin rep, end rep): a group's query heads are consecutive.
    for (int64_t bh = begin * x.rep; bh < end * x.rep; ++bh) {
      const int64_t b = bh / x.H, h = bh % x.H, hk = h / x.rep;
      const float beta = h % x.rep == 0 ? 0.0f : 1.0f;  // the group's first query head writes dK, dV
      const T *Q = rows_of<T>(x.q, b, h), *K = rows_of<T>(x.k, b, hk), *V = rows_of<T>(x.v, b, hk),
              *O = rows_of<T>(x.o, b, h), *G = rows_of<T>(x.g, b, h);
      OutRows<T> dK{rows_of<T>(x.dk, b, hk), x.ldk, dKf.data(), x.D}, dV{rows_of<T>(x.dv, b, hk), x.ldv, dVf.data(), x.Dv};
      T* dQ = rows_of<T>(x.dq, b, h);
      const float* P = probs.const_data_ptr<float>() + bh * x.Tq * x.Tk;
      // With dropout o = A v with A = P D (D the mask times its scale): dV takes A, and dP = dA D.
      // A causal row writes its first r + 1 entries only: above the diagonal `dropped` keeps the
      // zeros it was made with, as P has there.
      const float* A = P;
      if (drop) {
        for (int64_t r = 0; r < x.Tq; ++r)
          drop_row(*drop, bh, x.Tq, x.Tk, r, P + r * x.Tk, dropped.data() + r * x.Tk, causal ? r + 1 : x.Tk);
        A = dropped.data();
      }
      const T* Aop = operand<T>(A, x.Tq, x.Tk, Ab);
      // The softmax's backward needs sum_j P dP over a row, which is sum(dO o) of that row (with
      // dropout too: sum_j P dP = sum_j A dA = dO . o).
      for (int64_t r = 0; r < x.Tq; ++r) rowdot[size_t(r)] = dot_of(G + r * x.lg, O + r * x.lo, x.Dv);
      // dV = A^T dO, by blocks of keys; a causal block's rows start at its first key (A is 0 above).
      for (int64_t c0 = 0; c0 < x.Tk; c0 += kRows) {
        const int64_t c1 = std::min(x.Tk, c0 + kRows), from = causal ? c0 : 0;
        gemm(true, false, c1 - c0, x.Dv, x.Tq - from, 1.0f, Aop + from * x.Tk + c0, x.Tk, G + from * x.lg, x.lg, beta,
             dV.rows() + c0 * dV.ld(), dV.ld());
      }
      // dP = dO V^T, dS = P (dP - rowdot), dQ = scale dS K, by blocks of query rows.
      for (int64_t r0 = 0; r0 < x.Tq; r0 += kRows) {
        const int64_t r1 = std::min(x.Tq, r0 + kRows), n = causal ? r1 : x.Tk;
        float* block = dS.data() + r0 * x.Tk;
        gemm(false, true, r1 - r0, n, x.Dv, 1.0f, G + r0 * x.lg, x.lg, V, x.lv, 0.0f, block, x.Tk);
        for (int64_t r = r0; r < r1; ++r) {
          float* row = dS.data() + r * x.Tk;
          if (drop) drop_row(*drop, bh, x.Tq, x.Tk, r, row, row, causal ? r + 1 : x.Tk);
          softmax_backward_row(P + r * x.Tk, row, rowdot[size_t(r)], causal ? r + 1 : x.Tk, x.Tk);
        }
        OutRows<T> dQr{dQ + r0 * x.ldq, x.ldq, dQf.data(), x.D};
        if constexpr (bf16) {
          round_rows_bf16(block, x.Tk, dSb.data() + r0 * x.Tk, x.Tk, r1 - r0, x.Tk);
          gemm(false, false, r1 - r0, x.D, n, s, dSb.data() + r0 * x.Tk, x.Tk, K, x.lk, 0.0f, dQr.rows(), dQr.ld());
        } else {
          gemm(false, false, r1 - r0, x.D, n, s, block, x.Tk, K, x.lk, 0.0f, dQr.rows(), dQr.ld());
        }
        dQr.flush(r1 - r0, x.D);
      }
      // dK = scale dS^T Q, by blocks of keys as dV.
      const T* dSop;
      if constexpr (bf16) dSop = dSb.data();
      else dSop = dS.data();
      for (int64_t c0 = 0; c0 < x.Tk; c0 += kRows) {
        const int64_t c1 = std::min(x.Tk, c0 + kRows), from = causal ? c0 : 0;
        gemm(true, false, c1 - c0, x.D, x.Tq - from, s, dSop + from * x.Tk + c0, x.Tk, Q + from * x.lq, x.lq, beta,
             dK.rows() + c0 * dK.ld(), dK.ld());
      }
      if (h % x.rep == x.rep - 1) {  // the group's last query head: its dK, dV are complete
        dK.flush(x.Tk, x.D);
        dV.flush(x.Tk, x.Dv);
      }
    }
  });
  return {x.dq, x.dk, x.dv};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_attention_backward(const at::Tensor& g0, const at::Tensor& q0,
                                                                      const at::Tensor& k0, const at::Tensor& v0,
                                                                      const at::Tensor& o0, const at::Tensor& probs,
                                                                      bool causal, double scale,
                                                                      const AttentionDropout* drop) {
  return by_dtype(q0, [&](auto t) {
    return backward_kept<decltype(t)>(g0, q0, k0, v0, o0, probs, causal, scale, drop);
  });
}

// ---- causal attention over longer sequences: the probabilities recomputed in backward ----------
//
// Beyond kCpuAttentionMaxKeys the kept probabilities would outgrow the cache and q, k, v together,
// so this keeps one log-sum-exp per query row instead (as flash attention does) and recomputes a
// block's probabilities from it in backward: one product more than the kept-probabilities kernel,
// against ATen's flash attention, which at these lengths computes every key block of 512 up to the
// diagonal's (all of them at 512 tokens) and masks inside it. Here a block of kLongRows query rows
// takes exactly the keys up to its last row: a causal step does little more than half the
// products' work (the masked half of each block's diagonal 64 x 64 square is all it computes in
// vain). A whole row of logits is one block of the scratch (kLongRows x Tk floats per thread), so
// the softmax needs no online rescaling.
namespace {
constexpr int64_t kLongRows = 64;
}  // namespace

at::Tensor cpu_attention_forward_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                     double scale, at::Tensor* lse, const AttentionDropout* drop) {
  const int64_t Tq = q.size(2), Tk = k.size(2);
  if (lse) *lse = at::empty({q.size(0), q.size(1), Tq}, q.options().dtype(at::kFloat));
  // One block's logits at a time against its n keys, rows n apart (compact: the products stream them).
  return by_dtype(q, [&](auto t) {
    return forward_blocks<decltype(t)>(q, k, v, causal, scale, kLongRows, size_t(std::min(Tq, kLongRows) * Tk),
                                       lse ? lse->mutable_data_ptr<float>() : nullptr, drop, false,
                                       [](int64_t, int64_t, int64_t n, float* scratch) { return BlockRows{scratch, n}; });
  });
}

namespace {
template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_lse(const at::Tensor& g0, const at::Tensor& q0,
                                                            const at::Tensor& k0, const at::Tensor& v0,
                                                            const at::Tensor& o0, const at::Tensor& lse, bool causal,
                                                            double scale, const AttentionDropout* drop) {
  BackwardOperands x(g0, q0, k0, v0, o0);
  const float s = float(scale);
  constexpr bool bf16 = kIsBf16<T>;
  const at::Tensor lse_c = lse.contiguous();
  const int64_t blocks = (x.Tq + kLongRows - 1) / kLongRows;
  at::parallel_for(0, x.B * x.Hk, 1, [&](int64_t begin, int64_t end) {
    const size_t block_elems = static_cast<size_t>(std::min(x.Tq, kLongRows) * x.Tk);
    std::vector<float> P(block_elems), dS(block_elems), dropped(drop ? block_elems : 0);
    // bf16: as backward_kept's.
    std::vector<uint16_t> Ab(bf16 ? block_elems : 0), dSb(bf16 ? block_elems : 0);
    std::vector<float> dKf(bf16 ? size_t(x.Tk * x.D) : 0), dVf(bf16 ? size_t(x.Tk * x.Dv) : 0),
        dQf(bf16 ? size_t(kLongRows * x.D) : 0);
    for (int64_t bh = begin * x.rep; bh < end * x.rep; ++bh) {  // as backward_kept
      const int64_t b = bh / x.H, h = bh % x.H, hk = h / x.rep;
      const bool first_head = h % x.rep == 0;
      const T *Q = rows_of<T>(x.q, b, h), *K = rows_of<T>(x.k, b, hk), *V = rows_of<T>(x.v, b, hk),
              *O = rows_of<T>(x.o, b, h), *G = rows_of<T>(x.g, b, h);
      OutRows<T> dK{rows_of<T>(x.dk, b, hk), x.ldk, dKf.data(), x.D}, dV{rows_of<T>(x.dv, b, hk), x.ldv, dVf.data(), x.Dv};
      T* dQ = rows_of<T>(x.dq, b, h);
      const float* L = lse_c.const_data_ptr<float>() + bh * x.Tq;
      // Query blocks from the last: it reaches every key (causal: Tq = Tk), so its products write
      // dK and dV whole (beta 0, over the uninitialised outputs) and every earlier block adds to
      // the keys it reaches (beta 1).
      for (int64_t bi = blocks - 1; bi >= 0; --bi) {
        const int64_t r0 = bi * kLongRows, r1 = std::min(x.Tq, r0 + kLongRows), rows = r1 - r0;
        const int64_t n = causal ? r1 : x.Tk;
        const float beta = first_head && bi == blocks - 1 ? 0.0f : 1.0f;
        // P again: the forward's logits, then exp(logit - lse) row by row.
        gemm(false, true, rows, n, x.D, s, Q + r0 * x.lq, x.lq, K, x.lk, 0.0f, P.data(), n);
        for (int64_t r = r0; r < r1; ++r) softmax_from_lse_row(P.data() + (r - r0) * n, L[r], causal ? r + 1 : n, n);
        // dV[0:n] += A^T dO (A = P, or P D with dropout); dP = dO V^T (times D with dropout);
        // dS = P (dP - sum(dO o)) row by row.
        const float* A = P.data();
        if (drop) {
          for (int64_t r = r0; r < r1; ++r)
            drop_row(*drop, bh, x.Tq, x.Tk, r, P.data() + (r - r0) * n, dropped.data() + (r - r0) * n, n);
          A = dropped.data();
        }
        gemm(true, false, n, x.Dv, rows, 1.0f, operand<T>(A, rows, n, Ab), n, G + r0 * x.lg, x.lg, beta, dV.rows(),
             dV.ld());
        gemm(false, true, rows, n, x.Dv, 1.0f, G + r0 * x.lg, x.lg, V, x.lv, 0.0f, dS.data(), n);
        for (int64_t r = r0; r < r1; ++r) {
          const float rowdot = dot_of(G + r * x.lg, O + r * x.lo, x.Dv);
          float* row = dS.data() + (r - r0) * n;
          if (drop) drop_row(*drop, bh, x.Tq, x.Tk, r, row, row, n);
          softmax_backward_row(P.data() + (r - r0) * n, row, rowdot, causal ? r + 1 : n, n);
        }
        // dQ = scale dS K; dK[0:n] += scale dS^T Q.
        const T* dSop = operand<T>(dS.data(), rows, n, dSb);
        OutRows<T> dQr{dQ + r0 * x.ldq, x.ldq, dQf.data(), x.D};
        gemm(false, false, rows, x.D, n, s, dSop, n, K, x.lk, 0.0f, dQr.rows(), dQr.ld());
        dQr.flush(rows, x.D);
        gemm(true, false, n, x.D, rows, s, dSop, n, Q + r0 * x.lq, x.lq, beta, dK.rows(), dK.ld());
      }
      if (h % x.rep == x.rep - 1) {
        dK.flush(x.Tk, x.D);
        dV.flush(x.Tk, x.Dv);
      }
    }
  });
  return {x.dq, x.dk, x.dv};
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_attention_backward_lse(const at::Tensor& g0, const at::Tensor& q0,
                                                                          const at::Tensor& k0, const at::Tensor& v0,
                                                                          const at::Tensor& o0, const at::Tensor& lse,
                                                                          bool causal, double scale,
                                                                          const AttentionDropout* drop) {
  return by_dtype(q0, [&](auto t) {
    return backward_lse<decltype(t)>(g0, q0, k0, v0, o0, lse, causal, scale, drop);
  });
}

}  // namespace mfsdp
