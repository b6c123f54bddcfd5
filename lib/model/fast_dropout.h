// Dropout on the CPU with ATen's own masks, drawn fast (DESIGN.md section 7, "Dropout on the CPU"):
// mfsdp::dropout(x, p, train) in place of aten::dropout, and the masks mfsdp::sdpa's kernel applies
// to attention probabilities (model/fast_ops.cpp). The draws are model/cpu_random.h's: the same
// numbers from the same default CPU generator as ATen's bernoulli_, so a run's masks, and therefore
// its losses, are those PyTorch draws (tests/oracle judges dropout models that way).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/api/module.h>

#include <cstdint>

namespace mfsdp {

// Whether ATen's CPU bernoulli_(p) draws element by element from the default generator in this
// process, which is what the draws below replicate: LibTorch without MKL, or a CPU not made by
// Intel (on Intel CPUs ATen's MKL kernel takes one seed from the generator and draws with MKL's
// own stream: fast already, and other numbers).
bool cpu_bernoulli_replicable();

// keep[i] for n elements, exactly the 0/1 values at::empty({n}).bernoulli_(p) would write from the
// default CPU generator now, and the generator advanced as it would be. False (nothing drawn) where
// that cannot be replicated (cpu_bernoulli_replicable, or a generator state ATen's engine would not
// produce); the caller then runs ATen's op.
bool draw_bernoulli_keep(double p, uint8_t* keep, int64_t n);

// The value a kept element is multiplied by, as ATen's dropout computes it in x's dtype: the noise
// 1 / (1 - p), divided in float and stored in the dtype (bf16 rounds it: 1.109375 for p = 0.1).
float dropout_scale(at::ScalarType dtype, double p);

// Replaces aten::dropout(x, p, train) in the module's graphs by mfsdp::dropout(x, p, train), once
// per TorchScript type, when cpu_bernoulli_replicable(); before the model's first call
// (graph_rewrite.h). Returns the calls replaced.
int use_fast_dropout(torch::jit::Module& root);

// mfsdp::dropout: at::dropout's result and gradient bit for bit. Contiguous fp32 or bf16 CPU tensors
// in training with 0 < p < 1 draw their mask with draw_bernoulli_keep and keep it (one byte per
// element) for the backward; everything else is at::dropout.
at::Tensor dropout(const at::Tensor& x, double p, bool train);

}  // namespace mfsdp
