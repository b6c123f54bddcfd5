// mfsdp's CPU ops for the model's graphs (model/cpu_kernels.h), each with its own backward; other
// devices and dtypes compute what the replaced ATen calls did. mfsdp::gelu_tanh(Tensor x): GELU in
// its tanh form. mfsdp::rms_scale(Tensor x, float eps): RMSNorm's scaling.
// DESIGN.md section 7 ("CPU kernels of mfsdp's own").
#pragma once
#include <torch/csrc/jit/api/module.h>

namespace mfsdp {

// Replaces every aten::gelu(x, "tanh") in the module's graphs by mfsdp::gelu_tanh(x), once per
// TorchScript type; before the model's first call (graph_rewrite.h). Returns the calls replaced.
int use_fast_gelu(torch::jit::Module& root);

// Replaces x * rsqrt(mean(pow(x, 2), [-1], keepdim) + eps), RMSNorm's scaling as HF's traced and
// mfsdp's scripted RMSNorm modules write it, by mfsdp::rms_scale(x, eps): one pass over each row
// forward and one backward, for the five ops forward and their backwards. Returns the number replaced.
int use_fast_rms_norm(torch::jit::Module& root);
at::Tensor rms_scale(const at::Tensor& x, double eps);

// The op's forward and backward (for tests): y = GELU_tanh(x); dx = g * GELU_tanh'(x).
at::Tensor gelu_tanh(const at::Tensor& x);
at::Tensor gelu_tanh_backward(const at::Tensor& g, const at::Tensor& x);

}  // namespace mfsdp
