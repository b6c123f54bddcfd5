// The table through which the CUDA plugin lends model/fast_ops.cpp its GPU kernels
// (model/cuda_kernels.h, adapted to tensors by device/cuda_fast_ops.cpp). The executable holds the
// table once the plugin is loaded (device/cuda_loader.cpp); fast_ops.cpp checks each kernel against
// ATen on the run's GPU before a graph uses it (verify_device_fast_ops, fast_ops.h).
#pragma once
#include <ATen/core/Tensor.h>

#include <utility>

namespace mfsdp {

struct DeviceFastOps {
  // y = silu(a) * b; a and b contiguous, of one shape and dtype (fp32 or bf16), on one GPU.
  at::Tensor (*silu_mul)(const at::Tensor& a, const at::Tensor& b);
  // (da, db) for the gradient g of y (contiguous, a's dtype).
  std::pair<at::Tensor, at::Tensor> (*silu_mul_backward)(const at::Tensor& g, const at::Tensor& a,
                                                         const at::Tensor& b);
  // The rotary embedding forward (y from x) or backward (dx from dy) over the last dimension, split
  // at its half: in, cos and sin of one shape (cos and sin expanded), each with a unit-stride last
  // dimension, one dtype (fp32 or bf16), at most kRotaryMaxDims dimensions (callers keep ATen's
  // ops beyond). Returns a contiguous tensor.
  static constexpr int64_t kRotaryMaxDims = 8;  // cuda_kernels.h's kRotaryDims
  at::Tensor (*rotary)(const at::Tensor& in, const at::Tensor& cos, const at::Tensor& sin, bool backward);
};

// Called by the CUDA plugin's loader; nullptr when the plugin was built without nvcc.
void set_device_fast_ops(const DeviceFastOps* ops);

}  // namespace mfsdp
