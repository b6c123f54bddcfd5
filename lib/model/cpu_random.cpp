// ATen's Bernoulli draws without its per-element cost (model/cpu_random.h says what and why). Plain
// C++ with GCC vector extensions, cloned for x86-64-v4, v3 and the baseline as model/cpu_kernels.cpp.
//
// The twister (Matsumoto and Nishimura's MT19937, as at::mt19937 writes it): 624 words of state;
// each output is one word tempered; after 624 outputs every word is replaced by
//     s[i] = s[i + 397] ^ twist(s[i], s[i + 1])          (indices mod 624)
// in increasing i, so words below i are already new. For i < 227 both s[i + 1] and s[i + 397] are
// old words; for 227 <= i < 623 s[i - 227] is a new one, 227 places back: either way 16 lanes at a
// time see what the one-word loop sees (the reads that must be old come before the stores that
// replace them; the ones that must be new were stored by earlier vectors). The last word wraps to
// the new s[0], as ATen's does.
#include "model/cpu_random.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace mfsdp {
namespace {

constexpr int kN = 624, kM = 397;
constexpr int kLanes = 16;
typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vu loadu(const uint32_t* p) {
  vu v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storeu(uint32_t* p, vu v) { std::memcpy(p, &v, sizeof(v)); }

inline uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}
inline vu twist(vu u, vu v) {
  const vu odd = (v & 1u) != 0u;  // all ones where v is odd
  return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ (odd & 0x9908b0dfu);
}
inline uint32_t temper(uint32_t y) {
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  return y ^ (y >> 18);
}
inline vu temper(vu y) {
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  return y ^ (y >> 18);
}

// All 624 words anew (the comment at the top says why the vectors are exact).
inline void regenerate(uint32_t* s) {
  int i = 0;
  for (; i + kLanes <= kN - kM; i += kLanes) storeu(s + i, loadu(s + i + kM) ^ twist(loadu(s + i), loadu(s + i + 1)));
  for (; i < kN - kM; ++i) s[i] = s[i + kM] ^ twist(s[i], s[i + 1]);
  for (; i + kLanes <= kN - 1; i += kLanes)
    storeu(s + i, loadu(s + i + kM - kN) ^ twist(loadu(s + i), loadu(s + i + 1)));
  for (; i < kN - 1; ++i) s[i] = s[i + kM - kN] ^ twist(s[i], s[i + 1]);
  s[kN - 1] = s[kM - 1] ^ twist(s[kN - 1], s[0]);
}

// The next m outputs into out, as m calls of at::mt19937's operator() would give them.
inline void outputs(Mt19937State& st, uint32_t* out, int64_t m) {
  while (m > 0) {
    if (st.left <= 1) {  // ATen regenerates on the call that takes left to 0
      regenerate(st.state);
      st.left = kN + 1;
      st.next = 0;
    }
    const int64_t take = std::min<int64_t>(m, st.left - 1);
    const uint32_t* from = st.state + st.next;
    int64_t i = 0;
    for (; i + kLanes <= take; i += kLanes) storeu(out + i, temper(loadu(from + i)));
    for (; i < take; ++i) out[i] = temper(from[i]);
    st.next += uint32_t(take);
    st.left -= int32_t(take);
    out += take;
    m -= take;
  }
}

inline void bernoulli_impl(Mt19937State& st, double p, uint8_t* keep, int64_t n) {
  // u = k 2^-53 with k < 2^53 an integer, and p 2^53 is exact: u < p exactly when k < ceil(p 2^53).
  const double scaled = std::ldexp(std::min(std::max(p, 0.0), 1.0), 53);
  const uint64_t bound = uint64_t(std::ceil(scaled));
  constexpr int64_t kChunk = 1024;
  uint32_t words[2 * kChunk];
  while (n > 0) {
    const int64_t c = std::min(n, kChunk);
    outputs(st, words, 2 * c);
    for (int64_t i = 0; i < c; ++i) {
      const uint64_t k = (uint64_t(words[2 * i] & 0x1fffffu) << 32) | words[2 * i + 1];
      keep[i] = k < bound ? 1 : 0;
    }
    keep += c;
    n -= c;
  }
}

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (f != f) return 0x7fc0;  // NaN stays a quiet NaN, as c10::BFloat16 makes it
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace

#define MFSDP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), flatten))

MFSDP_CLONES void mt19937_bernoulli(Mt19937State& s, double p, uint8_t* keep, int64_t n) {
  bernoulli_impl(s, p, keep, n);
}

MFSDP_CLONES void dropout_apply(const float* x, const uint8_t* keep, float scale, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * (keep[i] ? scale : 0.0f);
}

MFSDP_CLONES void dropout_apply_bf16(const uint16_t* x, const uint8_t* keep, float scale, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = to_bf16(from_bf16(x[i]) * (keep[i] ? scale : 0.0f));
}

}  // namespace mfsdp
