// mfsdp's CPU kernels on contiguous memory; no LibTorch (model/fast_ops.cpp wraps them as ops).
// GELU in its tanh form (x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))), forward and backward
// (dx = g * dGELU/dx), in float and in bfloat16 (computed in float, rounded to nearest even):
// mfsdp::gelu_tanh.
#pragma once
#include <cstdint>

namespace mfsdp {
void gelu_tanh_forward(const float* x, float* y, int64_t n);
void gelu_tanh_backward(const float* g, const float* x, float* dx, int64_t n);
void gelu_tanh_forward_bf16(const uint16_t* x, uint16_t* y, int64_t n);
void gelu_tanh_backward_bf16(const uint16_t* g, const uint16_t* x, uint16_t* dx, int64_t n);
// RMSNorm's scaling over rows of d floats: y = x r with r = 1 / sqrt(mean(x^2) + eps), r kept per
// row for the backward dx = r g - x r^3 mean(g x): mfsdp::rms_scale.
void rms_scale_forward(const float* x, float* y, float* r, int64_t rows, int64_t d, double eps);
void rms_scale_backward(const float* g, const float* x, const float* r, float* dx, int64_t rows, int64_t d);
}  // namespace mfsdp
