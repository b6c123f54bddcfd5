// The GPU side of mfsdp's fused ops (model/fast_ops.h): SwiGLU's gate and the rotary embedding as
// one CUDA kernel each way, for fp32 and bf16 (computed in fp32, rounded once, as the CPU kernels of
// model/cpu_kernels.h). Plain pointers and a stream, no Torch headers: nvcc compiles
// model/cuda_kernels.cu into the CUDA plugin, and device/cuda_fast_ops.cpp adapts tensors to these.
// DESIGN.md section 11 ("Fused ops on the GPU").
#pragma once
#include <cstdint>

namespace mfsdp::cuda_kernels {

// The element type behind the pointers: fp32, or bf16 as its 16 bits.
enum class Dtype { kFloat, kBFloat16 };

// y = silu(a) * b over n contiguous elements.
void silu_mul_forward(Dtype t, const void* a, const void* b, void* y, int64_t n, void* stream);
// da = g b s (1 + a (1 - s)), db = g a s, s = sigmoid(a).
void silu_mul_backward(Dtype t, const void* g, const void* a, const void* b, void* da, void* db, int64_t n,
                       void* stream);

// The rotary embedding over rows of the last dimension d (even), split at d / 2:
//   forward   y = x cos + [-x2, x1] sin
//   backward  dx = g cos + [(g sin)2, -(g sin)1]
// `in`, `cos` and `sin` share one shape (cos and sin expanded: strides may be 0) with a unit-stride
// last dimension; `out` is contiguous. At most kRotaryDims dimensions.
inline constexpr int kRotaryDims = 8;
struct RotaryShape {
  int dims;
  int64_t size[kRotaryDims];
  int64_t in_stride[kRotaryDims], cos_stride[kRotaryDims], sin_stride[kRotaryDims];
};
// The shape of `in` with the strides of in, cos and sin (any tensor type with dim, size, stride;
// the caller checks dims <= kRotaryDims).
template <typename Tensor>
RotaryShape rotary_shape(const Tensor& in, const Tensor& cos, const Tensor& sin) {
  RotaryShape shape{};
  shape.dims = int(in.dim());
  for (int k = 0; k < shape.dims; ++k) {
    shape.size[k] = in.size(k);
    shape.in_stride[k] = in.stride(k);
    shape.cos_stride[k] = cos.stride(k);
    shape.sin_stride[k] = sin.stride(k);
  }
  return shape;
}
void rotary(Dtype t, bool backward, const void* in, const void* cos, const void* sin, void* out,
            const RotaryShape& shape, void* stream);

// The same per-element work run on the host, one index after another: the kernels' arithmetic and
// indexing, which tests/test_kernels.cpp checks against ATen on a machine without a GPU.
void silu_mul_forward_host(Dtype t, const void* a, const void* b, void* y, int64_t n);
void silu_mul_backward_host(Dtype t, const void* g, const void* a, const void* b, void* da, void* db, int64_t n);
void rotary_host(Dtype t, bool backward, const void* in, const void* cos, const void* sin, void* out,
                 const RotaryShape& shape);

// The last CUDA error of a launch as text, or nullptr when there was none.
const char* last_launch_error();

}  // namespace mfsdp::cuda_kernels
