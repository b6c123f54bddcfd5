// mfsdp's CPU ops for the model's graphs (model/cpu_kernels.h), each with its own backward; other
// devices and dtypes compute what the replaced ATen calls did. mfsdp::gelu_tanh(Tensor x): GELU in
// its tanh form. mfsdp::rms_scale(Tensor x, float eps): RMSNorm's scaling; mfsdp::rms_norm(x, shape,
// weight, eps): aten::rms_norm through that kernel. mfsdp::silu_mul(a, b):
// SwiGLU's silu(a) * b. mfsdp::rotary(x, cos, sin, ...): the rotary embedding (rotate-half form).
// mfsdp::sdpa(q, k, v, mask, dropout_p, is_causal, scale): scaled dot-product attention.
// DESIGN.md section 7 ("CPU kernels of mfsdp's own").
#pragma once
#include <torch/csrc/jit/api/module.h>

#include <optional>
#include <string>

namespace mfsdp {

// Replaces every aten::gelu(x, "tanh") in the module's graphs by mfsdp::gelu_tanh(x), once per
// TorchScript type; before the model's first call (graph_rewrite.h). Returns the calls replaced.
int use_fast_gelu(torch::jit::Module& root);

// Replaces x * rsqrt(mean(pow(x, 2), [-1], keepdim) + eps), RMSNorm's scaling as HF's traced and
// mfsdp's scripted RMSNorm modules write it, by mfsdp::rms_scale(x, eps): one pass over each row
// forward and one backward, for the five ops forward and their backwards; then a product of that
// with a weight (through one cast or none: HF's `weight * y.to(dtype)`) by
// mfsdp::rms_norm_weight(x, w, eps, dtype). Returns the number of scalings replaced.
int use_fast_rms_norm(torch::jit::Module& root);
at::Tensor rms_scale(const at::Tensor& x, double eps);
// w * rms_scale(x, eps).to(dtype) (dtype none: no cast) in one pass forward and one backward (the
// weight's gradient too) where x is fp32 CPU rows, w one fp32 element per column and dtype fp32
// or none; elsewhere those ops.
at::Tensor rms_norm_weight(const at::Tensor& x, const at::Tensor& w, double eps,
                           std::optional<at::ScalarType> dtype = std::nullopt);
// Replaces aten::rms_norm(x, [D], weight, eps) (torch.nn.RMSNorm, F.rms_norm) by mfsdp::rms_norm:
// on fp32 CPU rows, mfsdp::rms_norm_weight's kernel; elsewhere ATen's rms_norm itself.
// CPU only (on a GPU ATen's rms_norm is already one fused kernel). Returns the number replaced.
int use_fast_rms_norm_op(torch::jit::Module& root);

// Replaces silu(a) * b (SwiGLU's gate: aten::silu, torch.nn.functional.silu scripted, or a call of a
// module that returns silu of its input, as transformers' SiLUActivation traced) by
// mfsdp::silu_mul(a, b). Returns the number replaced.
int use_fast_swiglu(torch::jit::Module& root);
at::Tensor silu_mul(const at::Tensor& a, const at::Tensor& b);

// Replaces x * cos + rotate_half(x) * sin, rotate_half(x) = cat([-x2, x1]) of the halves of x (by
// chunk, or by slices at size // 2 or a constant; in the graph, or a called function that is
// exactly that), by mfsdp::rotary(x, cos, sin, dim, split, cat_dim). Returns the number replaced.
int use_fast_rotary(torch::jit::Module& root);
// split: >= 0 a constant, -1 size(x, dim) // 2, -2 x.chunk(2, dim)'s.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t dim, int64_t split,
                  int64_t cat_dim);
// "mfsdp's rotary embedding: N of M calls ran its kernel; ...": mfsdp::rotary's calls in this process
// so far, and why the others ran ATen's ops; empty when there were none.
std::string describe_fast_rotary();

// Replaces scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
// (causal or not, any scale, dropout constant or not, enable_gqa constant) by mfsdp::sdpa(q, k, v,
// mask, dropout_p, is_causal, scale, enable_gqa), keys and values that are repeats of their heads
// (HF's or torchtitan's repeat_kv, repeat_interleave) taken before the repeat with enable_gqa (the
// same attention): on fp32 or bf16 CPU
// tensors the kernel takes (cpu_attention_takes) with no mask or
// exactly the causal one (is_causal_mask), mfsdp's attention (model/cpu_attention.h), its dropout
// mask the numbers ATen's math attention draws (fast_dropout.h's draws, or ATen's bernoulli_ where
// those do not replicate it); elsewhere ATen's call as the graph made it. CPU runs only; after
// context parallelism has replaced the calls it splits. Returns the number replaced.
int use_fast_attention(torch::jit::Module& root);
// Replaces attention written out, softmax(q @ k^T * scale + mask) @ v (minGPT's, Meta's reference
// Llama's, a Hugging Face model traced with eager attention; masked_fill and where masks, casts
// and dropout around the softmax: model/eager_attention.cpp lists the forms), and
// scripts/export_hf.py's mfsdp::attention operator without a soft cap, by mfsdp::sdpa with the
// same mask (a boolean one made additive), scale and dropout: the kernel where that is the causal
// mask, ATen's SDPA elsewhere. CPU runs only, after context parallelism. Returns the number replaced.
int use_fast_eager_attention(torch::jit::Module& root);
at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                double dropout_p, bool causal, std::optional<double> scale, bool gqa = false);
// "mfsdp's CPU attention: N of M calls ran its kernel (...)": mfsdp::sdpa's calls in this process so far.
std::string describe_fast_attention();

// On a GPU, RMSNorm's scaling, SwiGLU's gate and the rotary embedding take kernels of the CUDA
// plugin (model/device_fast_ops.h; RMSNorm's is ATen's fused one) only once they have been run
// here, forward and backward in fp32 and bf16 on small random inputs, against ATen's ops on `device`: fp32 within 1e-5 and bf16 within 2e-2 of
// the largest value (the kernels were built on a machine without a GPU). Those that differ, fail
// or are absent stay ATen's; `report` names them ("; <op> kept ATen's (why)" each). On the CPU the
// same comparison runs the CPU kernels and switches nothing. GELU stays ATen's on the GPU (one
// kernel each way already).
struct DeviceKernelCheck {
  bool rms = false, swiglu = false, rotary = false;
  std::string report;
};
DeviceKernelCheck verify_device_fast_ops(c10::Device device);

// The op's forward and backward (for tests): y = GELU_tanh(x); dx = g * GELU_tanh'(x), written over
// g's elements when `overwrite` (g contiguous, of x's dtype and sizes) and returned as g.
at::Tensor gelu_tanh(const at::Tensor& x);
at::Tensor gelu_tanh_backward(const at::Tensor& g, const at::Tensor& x, bool overwrite = false);

// Whether a custom autograd function's backward may write its result over the incoming gradient
// `g` (its `variable_list` element): nothing else can read g once the backward has run. Grad mode
// off (no double backward records g), g contiguous, and the only holders of its storage g's own
// tensor object (and a view's base) held by the backward's argument and autograd's copy of it:
// torch::autograd::Function moves the engine's input into a list it passes by value, so a
// gradient that another node's input buffer also holds, a retained .grad, or a second view of the
// same storage shows up as one reference more, and gets a fresh result.
bool may_overwrite_grad(const at::Tensor& g);

}  // namespace mfsdp
