// GELU in its tanh form (x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))) on contiguous CPU
// memory, forward and backward (dx = g * dGELU/dx), in float and in bfloat16 (computed in float,
// rounded to nearest even). No LibTorch: model/fast_gelu.cpp wraps them as mfsdp::gelu_tanh.
#pragma once
#include <cstdint>

namespace mfsdp {
void gelu_tanh_forward(const float* x, float* y, int64_t n);
void gelu_tanh_backward(const float* g, const float* x, float* dx, int64_t n);
void gelu_tanh_forward_bf16(const uint16_t* x, uint16_t* y, int64_t n);
void gelu_tanh_backward_bf16(const uint16_t* g, const uint16_t* x, uint16_t* dx, int64_t n);
}  // namespace mfsdp
