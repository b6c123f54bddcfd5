// mfsdp's CPU kernels (DESIGN.md section 7, "CPU kernels of mfsdp's own"): GELU in its tanh form, forward
// and backward, on floats and bfloat16; the RMS scaling of RMSNorm, forward and backward, on float
// rows; SwiGLU's silu(a) * b and the rotary embedding's x cos + rotate_half(x) sin, each one pass
// forward and one backward where ATen makes two to five (floats and bfloat16). No LibTorch here: plain C++ with GCC vector extensions, one function
// body compiled for AVX-512, AVX2 and the x86-64 baseline (target_clones: the loader picks one by
// the CPU it runs on), so the binary still runs on any x86-64 machine.
//
// Why: ATen's tanh GELU calls Sleef's tanh, 2.5 ns per element on this project's Xeon (1 thread;
// erf GELU 0.57 ns, a plain tanh 0.44 ns): in the GPT of bench/train_step.sh forward and backward
// were 8% of an fp32 step and 11% of a bf16 one (bench/results_profile.md). The trick: with
// u = sqrt(2/pi) (x + 0.044715 x^3), 0.5 (1 + tanh(u)) = sigmoid(2u) = 1 / (1 + exp(-2u)), so
//     y  = x * s,                       s = 1 / (1 + exp(-2u))
//     dy = s + 2 x s (1 - s) du/dx,     du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// one exp and one division per element. exp is Cody-Waite range reduction (t = n ln2 + r,
// |r| <= ln2/2, ln2 in two parts) and a degree-7 Taylor polynomial (truncation r^8/8! < 6e-9
// relative), scaled by 2^n through the exponent bits: within a few ulp of libm's expf. Results
// differ from ATen's by rounding only (tests/test_kernels.cpp bounds it).
#include "model/cpu_kernels.h"

#include <cmath>

#include <cstring>

namespace mfsdp {
namespace {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int vi __attribute__((vector_size(kLanes * sizeof(int))));

constexpr float kC0 = 0.7978845608028654f;             // sqrt(2/pi)
constexpr float kC1 = 0.7978845608028654f * 0.044715f;  // sqrt(2/pi) * 0.044715
constexpr float kC3 = 3.0f * kC1;

inline vf splat(float v) { return vf{} + v; }

// exp(t) lane by lane, t clamped to [-87, 80]: results stay finite and normal, and so does
// 1 / (1 + exp(t)) (no denormals, which cost a microcode assist each); below that the callers'
// sigmoid is under 2e-35 either way.
inline vf vexp(vf t) {
  t = t < splat(80.0f) ? t : splat(80.0f);
  t = t > splat(-87.0f) ? t : splat(-87.0f);
  // n = round(t / ln2): adding 1.5 * 2^23 rounds to an integer in the low mantissa bits.
  const vf magic = splat(12582912.0f);
  vf n = (t * splat(1.4426950408889634f) + magic) - magic;
  vf r = t - n * splat(0.693145751953125f);   // ln2 high part: exact in n * hi
  r = r - n * splat(1.428606765330187e-06f);  // ln2 low part
  vf p = splat(1.0f / 5040.0f);
  p = p * r + splat(1.0f / 720.0f);
  p = p * r + splat(1.0f / 120.0f);
  p = p * r + splat(1.0f / 24.0f);
  p = p * r + splat(1.0f / 6.0f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n as float bits
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

// s = sigmoid(2u) for one vector of x.
inline vf sig(vf x) {
  const vf u = x * (splat(kC0) + splat(kC1) * x * x);
  return splat(1.0f) / (splat(1.0f) + vexp(splat(-2.0f) * u));
}

inline vf forward_vec(vf x) { return x * sig(x); }

inline vf backward_vec(vf g, vf x) {
  const vf s = sig(x);
  const vf du = splat(kC0) + splat(kC3) * x * x;
  return g * (s + splat(2.0f) * x * s * (splat(1.0f) - s) * du);
}

// Full vectors from float or bfloat16 memory. bfloat16 is the upper half of a float; float to
// bfloat16 rounds to nearest even and keeps NaN a quiet NaN, as c10::BFloat16 does.
typedef unsigned vu __attribute__((vector_size(kLanes * sizeof(unsigned))));
typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf load(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
inline void store(uint16_t* p, vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof(u));
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const vu nan = (vu)(v != v);  // all ones where NaN
  u = (u & ~nan) | (nan & 0x7FC0u);
  const vh h = __builtin_convertvector(u, vh);
  std::memcpy(p, &h, sizeof(h));
}

// Whole vectors, then the tail through a zero-padded vector of lanes.
template <typename T, typename F>
inline void unary(const T* x, T* y, int64_t n, F f) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, f(load(x + i)));
  if (i == n) return;
  T xt[kLanes] = {}, yt[kLanes];
  std::memcpy(xt, x + i, size_t(n - i) * sizeof(T));
  store(yt, f(load(xt)));
  std::memcpy(y + i, yt, size_t(n - i) * sizeof(T));
}

template <typename T, typename F>
inline void binary(const T* a, const T* b, T* y, int64_t n, F f) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, f(load(a + i), load(b + i)));
  if (i == n) return;
  T at[kLanes] = {}, bt[kLanes] = {}, yt[kLanes];
  std::memcpy(at, a + i, size_t(n - i) * sizeof(T));
  std::memcpy(bt, b + i, size_t(n - i) * sizeof(T));
  store(yt, f(load(at), load(bt)));
  std::memcpy(y + i, yt, size_t(n - i) * sizeof(T));
}

// bfloat16 elementwise without shuffles: 32 bf16 read as 16 u32 hold elements 2i (low half) and 2i+1
// (high half), so `u << 16` is the vector of even elements as floats and `u & 0xFFFF0000` the odd
// ones; results go back the same way (`even >> 16 | odd & 0xFFFF0000`, after rounding). The
// widening and narrowing conversions GCC emits for a 16-lane u16 <-> u32 convert are shuffles
// (vpmovzxwd halves, vinserti, vpermt2w) that share a port with the FMAs: this kernel body ran 2.7x
// slower than its float twin with them, 1.1-1.3x with pairs.
struct Pair {
  vf even, odd;
};
inline vf bits_to_float(vu u) {
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
inline Pair load_pair(const uint16_t* p) {
  vu u;
  std::memcpy(&u, p, sizeof(u));
  return {bits_to_float(u << 16), bits_to_float(u & 0xFFFF0000u)};
}
// v rounded to bfloat16 (nearest even; NaN a quiet NaN), in the upper 16 bits of each lane.
inline vu round_bf16(vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof(u));
  u = u + 0x7FFFu + ((u >> 16) & 1u);
  const vu nan = (vu)(v != v);
  return (u & ~nan) | (nan & 0x7FC00000u);
}
inline void store_pair(uint16_t* p, vf even, vf odd) {
  const vu u = (round_bf16(even) >> 16) | (round_bf16(odd) & 0xFFFF0000u);
  std::memcpy(p, &u, sizeof(u));
}
constexpr int kPair = 2 * kLanes;

template <typename F>
inline void unary(const uint16_t* x, uint16_t* y, int64_t n, F f) {
  auto one = [&](const uint16_t* xp, uint16_t* yp) {
    const Pair p = load_pair(xp);
    store_pair(yp, f(p.even), f(p.odd));
  };
  int64_t i = 0;
  for (; i + kPair <= n; i += kPair) one(x + i, y + i);
  if (i == n) return;
  uint16_t xt[kPair] = {}, yt[kPair];
  std::memcpy(xt, x + i, size_t(n - i) * sizeof(uint16_t));
  one(xt, yt);
  std::memcpy(y + i, yt, size_t(n - i) * sizeof(uint16_t));
}

template <typename F>
inline void binary(const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n, F f) {
  auto one = [&](const uint16_t* ap, const uint16_t* bp, uint16_t* yp) {
    const Pair pa = load_pair(ap), pb = load_pair(bp);
    store_pair(yp, f(pa.even, pb.even), f(pa.odd, pb.odd));
  };
  int64_t i = 0;
  for (; i + kPair <= n; i += kPair) one(a + i, b + i, y + i);
  if (i == n) return;
  uint16_t at[kPair] = {}, bt[kPair] = {}, yt[kPair];
  std::memcpy(at, a + i, size_t(n - i) * sizeof(uint16_t));
  std::memcpy(bt, b + i, size_t(n - i) * sizeof(uint16_t));
  one(at, bt, yt);
  std::memcpy(y + i, yt, size_t(n - i) * sizeof(uint16_t));
}

template <typename T>
inline void forward_impl(const T* x, T* y, int64_t n) {
  unary(x, y, n, forward_vec);
}

template <typename T>
inline void backward_impl(const T* g, const T* x, T* dx, int64_t n) {
  binary(g, x, dx, n, backward_vec);
}

// The first n (< kLanes) elements through a zero-padded vector.
template <typename T>
inline vf load_n(const T* p, int64_t n) {
  T t[kLanes] = {};
  std::memcpy(t, p, size_t(n) * sizeof(T));
  return load(t);
}
template <typename T>
inline void store_n(T* p, vf v, int64_t n) {
  T t[kLanes];
  store(t, v);
  std::memcpy(p, t, size_t(n) * sizeof(T));
}

// sigmoid(a) = 1 / (1 + exp(-a)); vexp's clamp keeps it finite for any a (NaN in a is kept by the
// callers' product with a).
inline vf sigmoid(vf a) { return splat(1.0f) / (splat(1.0f) + vexp(-a)); }

template <typename T>
inline void silu_mul_forward_impl(const T* a, const T* b, T* y, int64_t n) {
  binary(a, b, y, n, [](vf av, vf bv) { return av * sigmoid(av) * bv; });
}

inline void silu_mul_grads(vf gv, vf av, vf bv, vf& dav, vf& dbv) {
  const vf s = sigmoid(av);
  dbv = gv * av * s;
  dav = gv * bv * s * (splat(1.0f) + av * (splat(1.0f) - s));
}

inline void silu_mul_backward_impl(const uint16_t* g, const uint16_t* a, const uint16_t* b, uint16_t* da,
                                   uint16_t* db, int64_t n) {
  auto one = [](const uint16_t* gp, const uint16_t* ap, const uint16_t* bp, uint16_t* dap, uint16_t* dbp) {
    const Pair pg = load_pair(gp), pa = load_pair(ap), pb = load_pair(bp);
    vf da0, db0, da1, db1;
    silu_mul_grads(pg.even, pa.even, pb.even, da0, db0);
    silu_mul_grads(pg.odd, pa.odd, pb.odd, da1, db1);
    store_pair(dap, da0, da1);
    store_pair(dbp, db0, db1);
  };
  int64_t i = 0;
  for (; i + kPair <= n; i += kPair) one(g + i, a + i, b + i, da + i, db + i);
  if (i == n) return;
  uint16_t gt[kPair] = {}, at[kPair] = {}, bt[kPair] = {}, dat[kPair], dbt[kPair];
  const size_t bytes = size_t(n - i) * sizeof(uint16_t);
  std::memcpy(gt, g + i, bytes);
  std::memcpy(at, a + i, bytes);
  std::memcpy(bt, b + i, bytes);
  one(gt, at, bt, dat, dbt);
  std::memcpy(da + i, dat, bytes);
  std::memcpy(db + i, dbt, bytes);
}

inline void silu_mul_backward_impl(const float* g, const float* a, const float* b, float* da, float* db, int64_t n) {
  auto one = silu_mul_grads;
  int64_t i = 0;
  vf dav, dbv;
  for (; i + kLanes <= n; i += kLanes) {
    one(load(g + i), load(a + i), load(b + i), dav, dbv);
    store(da + i, dav);
    store(db + i, dbv);
  }
  if (i == n) return;
  one(load_n(g + i, n - i), load_n(a + i, n - i), load_n(b + i, n - i), dav, dbv);
  store_n(da + i, dav, n - i);
  store_n(db + i, dbv, n - i);
}

// One row each way, by vectors over the half h (the last one partial). Forward
//   y1 = x1 c1 - x2 s1,  y2 = x2 c2 + x1 s2;
// backward (the transpose: rotate_half^T [u1, u2] = [u2, -u1])
//   dx1 = g1 c1 + g2 s2,  dx2 = g2 c2 - g1 s1.
template <typename T, bool kBackward>
inline void rotary_impl(const T* x, int64_t xs, const T* c, int64_t cs, const T* s, int64_t ss, T* y, int64_t ys,
                        int64_t rows, int64_t h) {
  for (int64_t row = 0; row < rows; ++row, x += xs, c += cs, s += ss, y += ys) {
    for (int64_t i = 0; i < h; i += kLanes) {
      const int64_t m = h - i < kLanes ? h - i : kLanes;
      auto ld = [m](const T* p) { return m == kLanes ? load(p) : load_n(p, m); };
      const vf x1 = ld(x + i), x2 = ld(x + h + i), c1 = ld(c + i), c2 = ld(c + h + i), s1 = ld(s + i),
               s2 = ld(s + h + i);
      const vf y1 = kBackward ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1;
      const vf y2 = kBackward ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2;
      if (m == kLanes) {
        store(y + i, y1);
        store(y + h + i, y2);
      } else {
        store_n(y + i, y1, m);
        store_n(y + h + i, y2, m);
      }
    }
  }
}

// Horizontal sum of a vector's lanes, in a fixed order (the same on every clone).
inline float hsum(vf v) {
  float f[kLanes];
  std::memcpy(f, &v, sizeof(f));
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += f[i];
  return s;
}

// sum of a[i] * b[i] over a row: 16 lanes of partial sums, then the lanes in order.
inline float dot(const float* a, const float* b, int64_t d) {
  vf acc = vf{};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) acc += load(a + i) * load(b + i);
  float s = hsum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline float hmax(vf v) {
  float f[kLanes];
  std::memcpy(f, &v, sizeof(f));
  float m = f[0];
  for (int i = 1; i < kLanes; ++i) m = f[i] > m ? f[i] : m;
  return m;
}

}  // namespace

#define MFSDP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), flatten))

MFSDP_CLONES void gelu_tanh_forward(const float* x, float* y, int64_t n) { forward_impl(x, y, n); }
MFSDP_CLONES void gelu_tanh_backward(const float* g, const float* x, float* dx, int64_t n) {
  backward_impl(g, x, dx, n);
}
MFSDP_CLONES void gelu_tanh_forward_bf16(const uint16_t* x, uint16_t* y, int64_t n) { forward_impl(x, y, n); }
MFSDP_CLONES void gelu_tanh_backward_bf16(const uint16_t* g, const uint16_t* x, uint16_t* dx, int64_t n) {
  backward_impl(g, x, dx, n);
}

MFSDP_CLONES void silu_mul_forward(const float* a, const float* b, float* y, int64_t n) {
  silu_mul_forward_impl(a, b, y, n);
}
MFSDP_CLONES void silu_mul_backward(const float* g, const float* a, const float* b, float* da, float* db, int64_t n) {
  silu_mul_backward_impl(g, a, b, da, db, n);
}
MFSDP_CLONES void silu_mul_forward_bf16(const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n) {
  silu_mul_forward_impl(a, b, y, n);
}
MFSDP_CLONES void silu_mul_backward_bf16(const uint16_t* g, const uint16_t* a, const uint16_t* b, uint16_t* da,
                                         uint16_t* db, int64_t n) {
  silu_mul_backward_impl(g, a, b, da, db, n);
}

MFSDP_CLONES void rotary_forward(const float* x, int64_t xs, const float* c, int64_t cs, const float* s, int64_t ss,
                                 float* y, int64_t ys, int64_t rows, int64_t h) {
  rotary_impl<float, false>(x, xs, c, cs, s, ss, y, ys, rows, h);
}
MFSDP_CLONES void rotary_backward(const float* g, int64_t gs, const float* c, int64_t cs, const float* s, int64_t ss,
                                  float* dx, int64_t dxs, int64_t rows, int64_t h) {
  rotary_impl<float, true>(g, gs, c, cs, s, ss, dx, dxs, rows, h);
}
MFSDP_CLONES void rotary_forward_bf16(const uint16_t* x, int64_t xs, const uint16_t* c, int64_t cs, const uint16_t* s,
                                      int64_t ss, uint16_t* y, int64_t ys, int64_t rows, int64_t h) {
  rotary_impl<uint16_t, false>(x, xs, c, cs, s, ss, y, ys, rows, h);
}
MFSDP_CLONES void rotary_backward_bf16(const uint16_t* g, int64_t gs, const uint16_t* c, int64_t cs, const uint16_t* s,
                                       int64_t ss, uint16_t* dx, int64_t dxs, int64_t rows, int64_t h) {
  rotary_impl<uint16_t, true>(g, gs, c, cs, s, ss, dx, dxs, rows, h);
}

// RMS scaling: y = x r, r = 1 / sqrt(mean(x^2) + eps) per row of d; the backward of y with
// respect to x is dx = r g - x r^3 mean(g x).
// Both forwards: y = x r, then times w when there is one (kWeight), rounded after each product.
template <bool kWeight>
inline void rms_forward_rows(const float* x, const float* w, float* y, float* r, int64_t rows, int64_t d, double eps) {
  for (int64_t row = 0; row < rows; ++row) {
    const float* xr = x + row * d;
    float* yr = y + row * d;
    const float inv = 1.0f / __builtin_sqrtf(dot(xr, xr, d) / float(d) + float(eps));
    r[row] = inv;
    const vf vinv = splat(inv);
    int64_t i = 0;
    for (; i + kLanes <= d; i += kLanes) {
      const vf v = load(xr + i) * vinv;
      if constexpr (kWeight) store(yr + i, v * load(w + i)); else store(yr + i, v);
    }
    for (; i < d; ++i) yr[i] = kWeight ? (xr[i] * inv) * w[i] : xr[i] * inv;
  }
}

MFSDP_CLONES void rms_scale_forward(const float* x, float* y, float* r, int64_t rows, int64_t d, double eps) {
  rms_forward_rows<false>(x, nullptr, y, r, rows, d, eps);
}

MFSDP_CLONES void rms_scale_backward(const float* g, const float* x, const float* r, float* dx, int64_t rows,
                                     int64_t d) {
  for (int64_t row = 0; row < rows; ++row) {
    const float* gr = g + row * d;
    const float* xr = x + row * d;
    float* out = dx + row * d;
    const float inv = r[row];
    const float c = inv * inv * inv * dot(gr, xr, d) / float(d);
    const vf vinv = splat(inv), vc = splat(c);
    int64_t i = 0;
    for (; i + kLanes <= d; i += kLanes) store(out + i, vinv * load(gr + i) - vc * load(xr + i));
    for (; i < d; ++i) out[i] = inv * gr[i] - c * xr[i];
  }
}

MFSDP_CLONES void rms_norm_forward(const float* x, const float* w, float* y, float* r, int64_t rows, int64_t d,
                                   double eps) {
  rms_forward_rows<true>(x, w, y, r, rows, d, eps);
}

// Per row: u = g w into dx (the row's output, read back by the second pass), c = r^3 mean(u x), then
// dx = r u - c x, and dw += g (x r) in the same pass.
MFSDP_CLONES void rms_norm_backward(const float* g, const float* x, const float* w, const float* r, float* dx,
                                    float* dw, int64_t rows, int64_t d) {
  for (int64_t row = 0; row < rows; ++row) {
    const float* gr = g + row * d;
    const float* xr = x + row * d;
    float* out = dx + row * d;
    const float inv = r[row];
    const vf vinv = splat(inv);
    vf acc = splat(0.0f);
    int64_t i = 0;
    for (; i + kLanes <= d; i += kLanes) {
      const vf u = load(gr + i) * load(w + i);
      store(out + i, u);
      acc += u * load(xr + i);
    }
    float sum = hsum(acc);  // dot(u, x)'s order: the lanes, then the tail
    for (; i < d; ++i) {
      out[i] = gr[i] * w[i];
      sum += out[i] * xr[i];
    }
    const float c = inv * inv * inv * sum / float(d);
    const vf vc = splat(c);
    i = 0;
    for (; i + kLanes <= d; i += kLanes) {
      const vf xv = load(xr + i);
      store(out + i, vinv * load(out + i) - vc * xv);
      store(dw + i, load(dw + i) + load(gr + i) * (xv * vinv));
    }
    for (; i < d; ++i) {
      out[i] = inv * out[i] - c * xr[i];
      dw[i] += gr[i] * (xr[i] * inv);
    }
  }
}

// The maximum of x[0:n] (-inf for n == 0), and whether any of them is NaN. Inlined into each
// caller's target clone (flatten).
namespace {
inline float row_max(const float* x, int64_t n, bool& nan) {
  vf vm = splat(-INFINITY);
  vi bad = vi{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = load(x + i);
    vm = v > vm ? v : vm;
    bad |= v != v;
  }
  float m = hmax(vm);
  for (int64_t j = 0; j < kLanes; ++j) nan |= bad[j] != 0;
  for (int64_t j = i; j < n; ++j) {
    m = x[j] > m ? x[j] : m;
    nan |= x[j] != x[j];
  }
  return m;
}
}  // namespace

// Attention's softmax, one row of logits in place: s[0:n] = exp(s - max) / sum, s[n:len] = 0 (the
// keys a causal row does not see). The max first keeps every exp <= 1; a NaN or an infinite
// logit makes the row NaN, as ATen's softmax does (vexp would clamp it to a finite value).
MFSDP_CLONES float softmax_row(float* s, int64_t n, int64_t len) {
  bool nan = false;
  const float m = row_max(s, n, nan);
  int64_t i = 0;
  float lse = NAN;
  if (nan || !std::isfinite(m)) {
    for (int64_t j = 0; j < n; ++j) s[j] = NAN;
  } else {
    const vf vmax = splat(m);
    vf acc = vf{};
    for (i = 0; i + kLanes <= n; i += kLanes) {
      const vf e = vexp(load(s + i) - vmax);
      store(s + i, e);
      acc += e;
    }
    if (i < n) {  // the tail through a padded vector, its pad lanes left out of the sum
      float t[kLanes] = {};
      std::memcpy(t, s + i, size_t(n - i) * sizeof(float));
      float e[kLanes];
      store(e, vexp(load(t) - vmax));
      std::memcpy(s + i, e, size_t(n - i) * sizeof(float));
      for (int64_t j = 0; j < n - i; ++j) acc[j] += e[j];
    }
    const float sum = hsum(acc);
    const vf inv = splat(1.0f / sum);
    for (i = 0; i + kLanes <= n; i += kLanes) store(s + i, load(s + i) * inv);
    for (; i < n; ++i) s[i] *= inv[0];
    lse = m + std::log(sum);
  }
  if (len > n) std::memset(s + n, 0, size_t(len - n) * sizeof(float));
  return lse;
}

// The probabilities again from the logits and their row's log-sum-exp: s[0:n] = exp(s - lse),
// s[n:len] = 0. A NaN lse (the forward's row was NaN) gives a NaN row: vexp's clamp would turn
// NaN into a finite number, so it is caught here.
MFSDP_CLONES void softmax_from_lse_row(float* s, float lse, int64_t n, int64_t len) {
  if (lse != lse) {
    for (int64_t j = 0; j < n; ++j) s[j] = NAN;
  } else {
    const vf vl = splat(lse);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store(s + i, vexp(load(s + i) - vl));
    if (i < n) {
      float t[kLanes] = {};
      std::memcpy(t, s + i, size_t(n - i) * sizeof(float));
      float e[kLanes];
      store(e, vexp(load(t) - vl));
      std::memcpy(s + i, e, size_t(n - i) * sizeof(float));
    }
  }
  if (len > n) std::memset(s + n, 0, size_t(len - n) * sizeof(float));
}

// Its backward on one row: g[0:n] = p (g - d), d = sum(dO o) of the row; g[n:len] = 0.
MFSDP_CLONES void softmax_backward_row(const float* p, float* g, float d, int64_t n, int64_t len) {
  const vf vd = splat(d);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(g + i, load(p + i) * (load(g + i) - vd));
  for (; i < n; ++i) g[i] = p[i] * (g[i] - d);
  if (len > n) std::memset(g + n, 0, size_t(len - n) * sizeof(float));
}

MFSDP_CLONES float dot_row(const float* a, const float* b, int64_t n) { return dot(a, b, n); }

// Two passes over a row of the logits (a vocabulary's row, 50257 floats of GPT-2, stays in L2 for the
// second): the maximum, then the sum of exp(x - max). ATen's logsumexp makes four (amax, a subtracted
// copy, exp in place, sum), the copy a fresh [rows, vocab] temporary.
MFSDP_CLONES float logsumexp_row(const float* x, int64_t n) {
  bool nan = false;
  const float m = row_max(x, n, nan);
  int64_t i = 0;
  if (nan) return NAN;
  if (!std::isfinite(m)) return m;  // +inf (a +inf logit), or -inf (every logit -inf, or n == 0)
  const vf vmax = splat(m);
  vf acc = vf{};
  for (i = 0; i + kLanes <= n; i += kLanes) acc += vexp(load(x + i) - vmax);
  float tail = 0.0f;
  for (; i < n; ++i) tail += std::exp(x[i] - m);
  return m + std::log(hsum(acc) + tail);
}

MFSDP_CLONES void xent_grad_row(const float* x, float lse, int64_t target, float onehot, float g, float* out,
                                int64_t n) {
  const bool hit = target >= 0 && target < n;
  const float xt = hit ? x[target] : 0.0f;  // read before an in-place row overwrites it
  if (!std::isfinite(lse)) {
    // A NaN or infinite row (the step will be skipped or stopped by its non-finite gradient norm):
    // exp as the C library computes it, so that NaN and inf come out as ATen's would; vexp clamps.
    for (int64_t j = 0; j < n; ++j) out[j] = std::exp(x[j] - lse) * g;
  } else {
    const vf vl = splat(lse), vg = splat(g);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store(out + i, vexp(load(x + i) - vl) * vg);
    for (; i < n; ++i) out[i] = std::exp(x[i] - lse) * g;
  }
  if (hit) out[target] = (std::exp(xt - lse) - onehot) * g;
}

// The same two rows on bf16 logits, computed in float (as ATen's path computes them: the logits
// converted to float, then logsumexp; the gradient rounded once to bf16). 32 elements at a time as
// even/odd pairs (load_pair: no shuffles); the order of the sum differs from the float kernel's, by
// float rounding only.
namespace {
inline float bf16_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint16_t float_bf16(float f) {  // nearest even; NaN a quiet NaN (c10::BFloat16's rounding)
  if (f != f) return 0x7FC0u;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
}  // namespace

// Rows of floats rounded to bf16 (nearest even, as c10::BFloat16): what attention's bf16 products
// take of its fp32 probabilities and their gradients, and how their fp32 results reach bf16 outputs.
MFSDP_CLONES void round_rows_bf16(const float* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    uint16_t* yr = y + r * ldy;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store(yr + i, load(xr + i));
    for (; i < n; ++i) yr[i] = float_bf16(xr[i]);
  }
}

namespace {
inline float as_float(float v) { return v; }
inline float as_float(uint16_t h) { return bf16_float(h); }
// Column sums of `rows` rows of n (ld apart) into fp32 out[0:n], added to it or (not `accumulate`)
// written: rows in order, each added in float (a bias's gradient, model/linear.cpp). out stays in
// L1 while the rows stream by once.
// Four rows per walk over out: one load and one store of out for four rows' adds, made in row order
// (the same bits as a row at a time).
template <typename T>
inline void col_sums_impl(const T* x, int64_t ld, int64_t rows, int64_t n, float* out, bool accumulate) {
  if (!accumulate) std::memset(out, 0, size_t(n) * sizeof(float));
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const T *x0 = x + r * ld, *x1 = x0 + ld, *x2 = x1 + ld, *x3 = x2 + ld;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      store(out + i, (((load(out + i) + load(x0 + i)) + load(x1 + i)) + load(x2 + i)) + load(x3 + i));
    for (; i < n; ++i) out[i] = (((out[i] + as_float(x0[i])) + as_float(x1[i])) + as_float(x2[i])) + as_float(x3[i]);
  }
  for (; r < rows; ++r) {
    const T* xr = x + r * ld;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store(out + i, load(out + i) + load(xr + i));
    for (; i < n; ++i) out[i] += as_float(xr[i]);
  }
}
}  // namespace

MFSDP_CLONES void col_sums_f32(const float* x, int64_t ld, int64_t rows, int64_t n, float* out, bool accumulate) {
  col_sums_impl(x, ld, rows, n, out, accumulate);
}
MFSDP_CLONES void col_sums_bf16(const uint16_t* x, int64_t ld, int64_t rows, int64_t n, float* out, bool accumulate) {
  col_sums_impl(x, ld, rows, n, out, accumulate);
}

// sum of a[i] * b[i] over bf16 rows, in float: 16 lanes of partial sums, then the lanes in order.
MFSDP_CLONES float dot_row_bf16(const uint16_t* a, const uint16_t* b, int64_t n) {
  vf acc = vf{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += bf16_float(a[i]) * bf16_float(b[i]);
  return s;
}

MFSDP_CLONES float logsumexp_row_bf16(const uint16_t* x, int64_t n) {
  vf vm = splat(-INFINITY);
  vi bad = vi{};
  int64_t i = 0;
  for (; i + kPair <= n; i += kPair) {
    const Pair p = load_pair(x + i);
    vm = p.even > vm ? p.even : vm;
    vm = p.odd > vm ? p.odd : vm;
    bad |= (p.even != p.even) | (p.odd != p.odd);
  }
  float m = hmax(vm);
  bool nan = false;
  for (int64_t j = 0; j < kLanes; ++j) nan |= bad[j] != 0;
  for (int64_t j = i; j < n; ++j) {
    const float v = bf16_float(x[j]);
    m = v > m ? v : m;
    nan |= v != v;
  }
  if (nan) return NAN;
  if (!std::isfinite(m)) return m;
  const vf vmax = splat(m);
  vf acc = vf{};
  for (i = 0; i + kPair <= n; i += kPair) {
    const Pair p = load_pair(x + i);
    acc += vexp(p.even - vmax) + vexp(p.odd - vmax);
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += std::exp(bf16_float(x[i]) - m);
  return m + std::log(hsum(acc) + tail);
}

MFSDP_CLONES void xent_grad_row_bf16(const uint16_t* x, float lse, int64_t target, float onehot, float g,
                                     uint16_t* out, int64_t n) {
  const bool hit = target >= 0 && target < n;
  const float xt = hit ? bf16_float(x[target]) : 0.0f;  // read before an in-place row overwrites it
  int64_t i = 0;
  if (std::isfinite(lse)) {
    const vf vl = splat(lse), vg = splat(g);
    for (; i + kPair <= n; i += kPair) {
      const Pair p = load_pair(x + i);
      store_pair(out + i, vexp(p.even - vl) * vg, vexp(p.odd - vl) * vg);
    }
  }
  // The tail, and a NaN or infinite row whole (the C library's exp, as the float kernel).
  for (; i < n; ++i) out[i] = float_bf16(std::exp(bf16_float(x[i]) - lse) * g);
  if (hit) out[target] = float_bf16((std::exp(xt - lse) - onehot) * g);
}

}  // namespace mfsdp
