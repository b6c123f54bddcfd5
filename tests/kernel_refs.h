// References shared by the kernel tests (test_kernels.cpp, test_cuda_kernels.cpp).
#pragma once
#include <ATen/ATen.h>

namespace mfsdp::test {

// Largest |a - b| over the largest |b|: the error against the tensor's scale, for results that cancel
// to near zero (x1 c - x2 s; the slope of silu near its minimum).
inline double scaled(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / b.to(at::kDouble).abs().max().item<double>();
}

// rotate_half as the models write it: cat([-x2, x1]) of the halves of the last dimension.
inline at::Tensor rotate_half_ref(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.slice(-1, h), x.slice(-1, 0, h)}, -1);
}

}  // namespace mfsdp::test
