// The CUDA plugin's side of model/device_fast_ops.h: tensors to pointers, shapes and the current
// stream for model/cuda_kernels.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <stdexcept>
#include <string>

#include "device/cuda_plugin.h"
#include "model/cuda_kernels.h"
#include "model/device_fast_ops.h"

namespace mfsdp {
namespace {

namespace ck = cuda_kernels;

ck::Dtype dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? ck::Dtype::kFloat : ck::Dtype::kBFloat16;
}

void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

void check_launch(const char* what) {
  if (const char* e = ck::last_launch_error()) throw std::runtime_error(std::string("CUDA kernel ") + what + ": " + e);
}

at::Tensor silu_mul(const at::Tensor& a, const at::Tensor& b) {
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor y = at::empty_like(a, at::MemoryFormat::Contiguous);
  ck::silu_mul_forward(dtype_of(a), a.const_data_ptr(), b.const_data_ptr(), y.mutable_data_ptr(), a.numel(),
                       stream_of(a));
  check_launch("silu_mul");
  return y;
}

std::pair<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& g, const at::Tensor& a, const at::Tensor& b) {
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor da = at::empty_like(a, at::MemoryFormat::Contiguous), db = at::empty_like(b, at::MemoryFormat::Contiguous);
  ck::silu_mul_backward(dtype_of(a), g.const_data_ptr(), a.const_data_ptr(), b.const_data_ptr(), da.mutable_data_ptr(),
                        db.mutable_data_ptr(), a.numel(), stream_of(a));
  check_launch("silu_mul backward");
  return {da, db};
}

static_assert(DeviceFastOps::kRotaryMaxDims == ck::kRotaryDims, "fast_ops.cpp keeps ATen's ops beyond the kernel's dims");

at::Tensor rotary(const at::Tensor& in, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  if (in.dim() > ck::kRotaryDims)
    throw std::runtime_error("rotary on the GPU: " + std::to_string(in.dim()) + " dimensions, at most " +
                std::to_string(ck::kRotaryDims));
  const c10::cuda::CUDAGuard guard(in.device());
  const ck::RotaryShape shape = ck::rotary_shape(in, cos, sin);
  at::Tensor out = at::empty(in.sizes(), in.options().memory_format(at::MemoryFormat::Contiguous));
  ck::rotary(dtype_of(in), backward, in.const_data_ptr(), cos.const_data_ptr(), sin.const_data_ptr(),
             out.mutable_data_ptr(), shape, stream_of(in));
  check_launch("rotary");
  return out;
}

}  // namespace

const DeviceFastOps* cuda_plugin::fast_ops() {
  static const DeviceFastOps ops{silu_mul, silu_mul_backward, rotary};
  return &ops;
}

}  // namespace mfsdp
