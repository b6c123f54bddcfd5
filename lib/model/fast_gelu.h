// mfsdp::gelu_tanh(Tensor x) -> Tensor: GELU in its tanh form with mfsdp's CPU kernels
// (model/gelu_kernel.h) and its own backward; other devices and dtypes call ATen's gelu.
// DESIGN.md section 7 ("Elementwise kernels").
#pragma once
#include <torch/csrc/jit/api/module.h>

namespace mfsdp {

// Replaces every aten::gelu(x, "tanh") in the module's graphs by mfsdp::gelu_tanh(x), once per
// TorchScript type; before the model's first call (graph_rewrite.h). Returns the calls replaced.
int use_fast_gelu(torch::jit::Module& root);

// The op's forward and backward (for tests): y = GELU_tanh(x); dx = g * GELU_tanh'(x).
at::Tensor gelu_tanh(const at::Tensor& x);
at::Tensor gelu_tanh_backward(const at::Tensor& g, const at::Tensor& x);

}  // namespace mfsdp
