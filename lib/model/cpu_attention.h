// Scaled dot-product attention on the CPU in fp32 or bf16, forward and backward (DESIGN.md section
// 7, "Attention on the CPU"): for short sequences with the attention probabilities kept for the
// backward, for long causal ones with a log-sum-exp per row and the probabilities recomputed.
// mfsdp::sdpa's kernels (model/fast_ops.cpp), in place of ATen's flash attention. The softmax and
// its backward run in fp32 either way; bf16 calls' products take bf16 operands (the probabilities
// and dS rounded to bf16, as flash attention does) and accumulate in fp32 (MKL's
// cblas_gemm_bf16bf16f32).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace mfsdp {

// Dropout of the attention probabilities, where ATen's math attention applies it (after the
// softmax, before the product with v): keep [B, H, Tq, Tk] row-major (1 kept, 0 dropped, drawn as
// ATen draws its noise: model/fast_dropout.h), kept probabilities times `scale` (1 / (1 - p)). The
// probabilities kept for the backward stay undropped; the backward applies the mask again.
struct AttentionDropout {
  const uint8_t* keep = nullptr;
  float scale = 1.0f;
};

// Keys per head up to which the kernel keeps the B x H x Tq x Tk probabilities of a call for the
// backward (for head dim 64 at most the size of q, k, v and the output together). Beyond it ATen's
// flash attention was faster than keeping them (bench/results_kernels.md), and a causal call runs
// the kernel that keeps one log-sum-exp per query row and recomputes the probabilities in backward
// (cpu_attention_forward_lse); a call that is not causal goes to ATen's flash attention.
constexpr int64_t kCpuAttentionMaxKeys = 256;

// Whether the kernels take these inputs: CPU tensors [B, H, Tq, D], [B, Hk, Tk, D], [B, Hk, Tk, Dv] with
// Hk = H, or with `gqa` (grouped-query attention, SDPA's enable_gqa) any Hk that divides H (query
// head h reads key/value head h / (H / Hk), as ATen's enable_gqa and HF's repeat_kv do), all
// fp32 or all bf16 (any strides; the last dimension is made contiguous when it is not), Tq >= 1,
// Tk >= 1, Tq == Tk when causal, Tk <= kCpuAttentionMaxKeys when not, and a BLAS sgemm_ in the
// process (LibTorch's MKL or OpenBLAS exports one). bf16 inputs run the kernels below in bf16 when
// cpu_attention_bf16_products(), else mfsdp::sdpa converts them to fp32 (exactly) and rounds the
// output once (model/fast_ops.cpp).
bool cpu_attention_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, bool gqa = false);

// Whether bf16 calls run the kernels in bf16 (products of bf16 operands into fp32): MKL's
// cblas_gemm_bf16bf16f32 is in the process, and MFSDP_ATTENTION_BF16=bf16, or it is unset and the
// CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX) with MKL's kernels for it. MFSDP_ATTENTION_BF16=fp32
// computes bf16 calls in fp32 (the probabilities kept in fp32: nearer the exact result, slower).
bool cpu_attention_bf16_products();
// A value of MFSDP_ATTENTION_BF16 other than bf16 or fp32 is a UserError (checked before a run writes anything).
void check_attention_bf16_knob();

// Which of the two a taken call runs: probabilities kept (cpu_attention_forward with probs, then
// cpu_attention_backward) up to kCpuAttentionMaxKeys keys, the log-sum-exp kernels beyond.
bool cpu_attention_keeps_probs(int64_t keys);

// Whether `mask`, an attn_mask for Tq = Tk = T rows and keys (any leading dimensions), is exactly the
// causal mask: bool with true on and below the diagonal only, or additive with 0 there and at most
// -1e9 above (-inf; the dtype's lowest that Hugging Face models fill with; the -1e9 of older code).
// Such a mask computes what is_causal does, so mfsdp::sdpa can take the call: a masked key's
// exp(logit - 1e9 - row max) is 0 in fp32 for any logits within 1e9 - 104 of the diagonal's, which
// every row has. A softer fill (-1e4) is not taken. Checked on every call, element by element (a
// cached answer could outlive the mask it was for).
bool is_causal_mask(const at::Tensor& mask, int64_t T);

// o = softmax(scale q k^T [+ causal mask]) v, shaped [B, H, Tq, Dv] with the strides of a transposed
// [B, Tq, H, Dv] (as ATen's flash attention returns it), in q's dtype. When `probs` is given it
// receives the probabilities [B, H, Tq, Tk] in fp32 (zeros above the diagonal when causal) for the
// backward. bf16 inputs need cpu_attention_bf16_products()'s MKL product.
at::Tensor cpu_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                 double scale, at::Tensor* probs, const AttentionDropout* drop = nullptr);

// dq, dk, dv of the forward above from the output's gradient, the inputs, the output and its probs.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_attention_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                                      const at::Tensor& k, const at::Tensor& v,
                                                                      const at::Tensor& out, const at::Tensor& probs,
                                                                      bool causal, double scale,
                                                                      const AttentionDropout* drop = nullptr);

// The same attention for long causal sequences: o as above, and when `lse` is given the log-sum-exp
// of each query row's scaled logits [B, H, Tq] in fp32 (NaN for a NaN row), all the backward keeps.
at::Tensor cpu_attention_forward_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                     double scale, at::Tensor* lse, const AttentionDropout* drop = nullptr);

// dq, dk, dv of cpu_attention_forward_lse, its probabilities recomputed block by block from lse.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_attention_backward_lse(const at::Tensor& grad_out,
                                                                          const at::Tensor& q, const at::Tensor& k,
                                                                          const at::Tensor& v, const at::Tensor& out,
                                                                          const at::Tensor& lse, bool causal,
                                                                          double scale,
                                                                          const AttentionDropout* drop = nullptr);

}  // namespace mfsdp
