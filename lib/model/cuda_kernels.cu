// SwiGLU's gate and the rotary embedding on the GPU (model/cuda_kernels.h): what model/cpu_kernels.cpp
// does on the CPU, one kernel each way.
//
// Why: on the GPU these ops are memory-bound, and ATen makes one kernel per op of the model's
// graph. silu(a) * b is two kernels forward (5 tensor passes: read a, write silu(a), read it and b,
// write y) and three backward (9 passes), where one kernel each way needs 3 and 5; the rotary
// embedding's slice, neg, cat, two muls and an add are six kernels forward and as many backward,
// for one pass over x (and over its gradient). For the ~1B Llama of bench/gpu_llama.py (sequence
// 2048, micro-batch 4) the gate's tensors are 128 MiB in bf16 per layer, the queries' 32 MiB.
//
// Elements are read as fp32 (bf16 widened), computed in fp32 and rounded once when stored, as the
// CPU kernels do. Grid-stride loops: any grid gives the same result (each element is its own).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "model/cuda_kernels.h"

namespace mfsdp::cuda_kernels {
namespace {

#define MFSDP_HD __host__ __device__ __forceinline__

MFSDP_HD float widen(float v) { return v; }
MFSDP_HD float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
MFSDP_HD T narrow(float v);
template <>
MFSDP_HD float narrow<float>(float v) { return v; }
template <>
MFSDP_HD __nv_bfloat16 narrow<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// 1 / (1 + exp(-a)) with the accurate expf (not __expf): the result is compared with ATen's at
// 1e-5 relative on fp32 losses (tests/gpu/gpu_tests.py).
MFSDP_HD float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

// Each kernel's work for one index, as a function the host can run too (the *_host functions of
// cuda_kernels.h: tests/test_kernels.cpp checks the arithmetic and the indexing without a GPU).
template <typename T>
MFSDP_HD void silu_mul_forward_at(const T* a, const T* b, T* y, int64_t i) {
  const float av = widen(a[i]);
  y[i] = narrow<T>(av * sigmoid(av) * widen(b[i]));
}

template <typename T>
MFSDP_HD void silu_mul_backward_at(const T* g, const T* a, const T* b, T* da, T* db, int64_t i) {
  const float gv = widen(g[i]), av = widen(a[i]), bv = widen(b[i]);
  const float s = sigmoid(av);
  db[i] = narrow<T>(gv * av * s);
  da[i] = narrow<T>(gv * bv * s * (1.0f + av * (1.0f - s)));
}

// Pair t = (row, i): elements i and i + h of a row, the row's offset in each tensor from its
// multi-index over the dimensions before the last.
template <typename T, bool kBackward>
MFSDP_HD void rotary_at(const T* in, const T* cos, const T* sin, T* out, const RotaryShape& shape, int64_t t) {
  const int last = shape.dims - 1;
  const int64_t d = shape.size[last], h = d / 2;
  const int64_t row = t / h, i = t % h;
  int64_t rest = row, io = 0, co = 0, so = 0;
  for (int k = last - 1; k >= 0; --k) {
    const int64_t idx = rest % shape.size[k];
    rest /= shape.size[k];
    io += idx * shape.in_stride[k];
    co += idx * shape.cos_stride[k];
    so += idx * shape.sin_stride[k];
  }
  const float x1 = widen(in[io + i]), x2 = widen(in[io + h + i]);
  const float c1 = widen(cos[co + i]), c2 = widen(cos[co + h + i]);
  const float s1 = widen(sin[so + i]), s2 = widen(sin[so + h + i]);
  const float y1 = kBackward ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1;
  const float y2 = kBackward ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2;
  out[row * d + i] = narrow<T>(y1);
  out[row * d + h + i] = narrow<T>(y2);
}

#define MFSDP_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

template <typename T>
__global__ void silu_mul_forward_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y,
                                        int64_t n) {
  MFSDP_GRID_STRIDE(i, n) silu_mul_forward_at(a, b, y, i);
}

template <typename T>
__global__ void silu_mul_backward_kernel(const T* __restrict__ g, const T* __restrict__ a, const T* __restrict__ b,
                                         T* __restrict__ da, T* __restrict__ db, int64_t n) {
  MFSDP_GRID_STRIDE(i, n) silu_mul_backward_at(g, a, b, da, db, i);
}

template <typename T, bool kBackward>
__global__ void rotary_kernel(const T* __restrict__ in, const T* __restrict__ cos, const T* __restrict__ sin,
                              T* __restrict__ out, RotaryShape shape, int64_t pairs) {
  MFSDP_GRID_STRIDE(t, pairs) rotary_at<T, kBackward>(in, cos, sin, out, shape, t);
}

int64_t pairs_of(const RotaryShape& shape) {
  int64_t numel = 1;
  for (int k = 0; k < shape.dims; ++k) numel *= shape.size[k];
  return numel / 2;
}

// Enough blocks to fill the GPU several times over (the grid-stride loops take the rest).
unsigned blocks_for(int64_t n, int threads) {
  const int64_t want = (n + threads - 1) / threads;
  return unsigned(want < 65536 ? (want > 0 ? want : 1) : 65536);
}

constexpr int kThreads = 256;

thread_local cudaError_t last_error = cudaSuccess;

void note_launch() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) last_error = e;
}

}  // namespace

void silu_mul_forward(Dtype t, const void* a, const void* b, void* y, int64_t n, void* stream) {
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (t == Dtype::kFloat)
    silu_mul_forward_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(
        static_cast<const float*>(a), static_cast<const float*>(b), static_cast<float*>(y), n);
  else
    silu_mul_forward_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(
        static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b), static_cast<__nv_bfloat16*>(y), n);
  note_launch();
}

void silu_mul_backward(Dtype t, const void* g, const void* a, const void* b, void* da, void* db, int64_t n,
                       void* stream) {
  if (n == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (t == Dtype::kFloat)
    silu_mul_backward_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(
        static_cast<const float*>(g), static_cast<const float*>(a), static_cast<const float*>(b),
        static_cast<float*>(da), static_cast<float*>(db), n);
  else
    silu_mul_backward_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(
        static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(a),
        static_cast<const __nv_bfloat16*>(b), static_cast<__nv_bfloat16*>(da), static_cast<__nv_bfloat16*>(db), n);
  note_launch();
}

void rotary(Dtype t, bool backward, const void* in, const void* cos, const void* sin, void* out,
            const RotaryShape& shape, void* stream) {
  const int64_t pairs = pairs_of(shape);
  if (pairs == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const unsigned grid = blocks_for(pairs, kThreads);
  if (t == Dtype::kFloat) {
    auto i = static_cast<const float*>(in), c = static_cast<const float*>(cos), n = static_cast<const float*>(sin);
    auto o = static_cast<float*>(out);
    if (backward) rotary_kernel<float, true><<<grid, kThreads, 0, s>>>(i, c, n, o, shape, pairs);
    else rotary_kernel<float, false><<<grid, kThreads, 0, s>>>(i, c, n, o, shape, pairs);
  } else {
    auto i = static_cast<const __nv_bfloat16*>(in), c = static_cast<const __nv_bfloat16*>(cos),
         n = static_cast<const __nv_bfloat16*>(sin);
    auto o = static_cast<__nv_bfloat16*>(out);
    if (backward) rotary_kernel<__nv_bfloat16, true><<<grid, kThreads, 0, s>>>(i, c, n, o, shape, pairs);
    else rotary_kernel<__nv_bfloat16, false><<<grid, kThreads, 0, s>>>(i, c, n, o, shape, pairs);
  }
  note_launch();
}

void silu_mul_forward_host(Dtype t, const void* a, const void* b, void* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (t == Dtype::kFloat)
      silu_mul_forward_at(static_cast<const float*>(a), static_cast<const float*>(b), static_cast<float*>(y), i);
    else
      silu_mul_forward_at(static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b),
                          static_cast<__nv_bfloat16*>(y), i);
}

void silu_mul_backward_host(Dtype t, const void* g, const void* a, const void* b, void* da, void* db, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (t == Dtype::kFloat)
      silu_mul_backward_at(static_cast<const float*>(g), static_cast<const float*>(a), static_cast<const float*>(b),
                           static_cast<float*>(da), static_cast<float*>(db), i);
    else
      silu_mul_backward_at(static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(a),
                           static_cast<const __nv_bfloat16*>(b), static_cast<__nv_bfloat16*>(da),
                           static_cast<__nv_bfloat16*>(db), i);
}

void rotary_host(Dtype t, bool backward, const void* in, const void* cos, const void* sin, void* out,
                 const RotaryShape& shape) {
  const int64_t pairs = pairs_of(shape);
  for (int64_t p = 0; p < pairs; ++p) {
    if (t == Dtype::kFloat) {
      auto i = static_cast<const float*>(in), c = static_cast<const float*>(cos), n = static_cast<const float*>(sin);
      auto o = static_cast<float*>(out);
      if (backward) rotary_at<float, true>(i, c, n, o, shape, p);
      else rotary_at<float, false>(i, c, n, o, shape, p);
    } else {
      auto i = static_cast<const __nv_bfloat16*>(in), c = static_cast<const __nv_bfloat16*>(cos),
           n = static_cast<const __nv_bfloat16*>(sin);
      auto o = static_cast<__nv_bfloat16*>(out);
      if (backward) rotary_at<__nv_bfloat16, true>(i, c, n, o, shape, p);
      else rotary_at<__nv_bfloat16, false>(i, c, n, o, shape, p);
    }
  }
}

const char* last_launch_error() {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace mfsdp::cuda_kernels
