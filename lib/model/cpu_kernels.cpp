// mfsdp's CPU kernels (DESIGN.md section 7, "CPU kernels of mfsdp's own"): GELU in its tanh form, forward
// and backward, on floats and bfloat16; the RMS scaling of RMSNorm, forward and backward, on float
// rows. No LibTorch here: plain C++ with GCC vector extensions, one function
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

template <typename T>
inline void forward_impl(const T* x, T* y, int64_t n) {
  unary(x, y, n, forward_vec);
}

template <typename T>
inline void backward_impl(const T* g, const T* x, T* dx, int64_t n) {
  binary(g, x, dx, n, backward_vec);
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

// RMS scaling: y = x r, r = 1 / sqrt(mean(x^2) + eps) per row of d; the backward of y with
// respect to x is dx = r g - x r^3 mean(g x).
MFSDP_CLONES void rms_scale_forward(const float* x, float* y, float* r, int64_t rows, int64_t d, double eps) {
  for (int64_t row = 0; row < rows; ++row) {
    const float* xr = x + row * d;
    float* yr = y + row * d;
    const float inv = 1.0f / __builtin_sqrtf(dot(xr, xr, d) / float(d) + float(eps));
    r[row] = inv;
    const vf vinv = splat(inv);
    int64_t i = 0;
    for (; i + kLanes <= d; i += kLanes) store(yr + i, load(xr + i) * vinv);
    for (; i < d; ++i) yr[i] = xr[i] * inv;
  }
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

}  // namespace mfsdp
