// Scaled dot-product attention on the CPU in fp32 for short sequences, forward and backward, with the
// attention probabilities kept for the backward (DESIGN.md section 7, "Attention on the CPU"):
// mfsdp::sdpa's kernel (model/fast_ops.cpp), in place of ATen's flash attention.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace mfsdp {

// Keys per head up to which the kernel runs (and keeps B x H x Tq x Tk probabilities per call for
// the backward: for head dim 64 at most the size of q, k, v and the output together). Beyond it
// ATen's flash attention is faster and holds only a log-sum-exp per row (bench/results_kernels.md).
constexpr int64_t kCpuAttentionMaxKeys = 256;

// Whether the kernel takes these inputs: fp32 CPU tensors [B, H, Tq, D], [B, H, Tk, D], [B, H, Tk, Dv]
// (any strides; the last dimension is made contiguous when it is not), Tq >= 1, 1 <= Tk <= kCpuAttentionMaxKeys,
// Tq == Tk when causal, and a BLAS sgemm_ in the process (LibTorch's MKL or OpenBLAS exports one).
bool cpu_attention_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal);

// Whether `mask`, an attn_mask for Tq = Tk = T rows and keys (any leading dimensions), is exactly the
// causal mask: bool with true on and below the diagonal only, or additive with 0 there and -inf
// (or at most -1e30, as the dtype's lowest that Hugging Face models fill with) above. Such a mask
// computes what is_causal does, so mfsdp::sdpa can take the call. Checked on every call, element
// by element (a cached answer could outlive the mask it was for).
bool is_causal_mask(const at::Tensor& mask, int64_t T);

// o = softmax(scale q k^T [+ causal mask]) v, shaped [B, H, Tq, Dv] with the strides of a transposed
// [B, Tq, H, Dv] (as ATen's flash attention returns it). When `probs` is given it receives the
// probabilities [B, H, Tq, Tk] (zeros above the diagonal when causal) for the backward.
at::Tensor cpu_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                 double scale, at::Tensor* probs);

// dq, dk, dv of the forward above from the output's gradient, the inputs, the output and its probs.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_attention_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                                      const at::Tensor& k, const at::Tensor& v,
                                                                      const at::Tensor& out, const at::Tensor& probs,
                                                                      bool causal, double scale);

}  // namespace mfsdp
