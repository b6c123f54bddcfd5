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
// RMSNorm with its weight w (d floats): y = (x r) w, the order HF's `weight * (x * rsqrt(...))`
// rounds in; backward with u = g w: dx = r u - x r^3 mean(u x) (rms_scale_backward of u), and
// dw += g (x r) summed over the rows into dw (d floats, accumulated: the caller zeroes it).
void rms_norm_forward(const float* x, const float* w, float* y, float* r, int64_t rows, int64_t d, double eps);
void rms_norm_backward(const float* g, const float* x, const float* w, const float* r, float* dx, float* dw,
                       int64_t rows, int64_t d);
// SwiGLU's gate: y = silu(a) b = a sigmoid(a) b, and its backward da = g b s (1 + a (1 - s)),
// db = g a s (s = sigmoid(a)), in one pass each: mfsdp::silu_mul.
void silu_mul_forward(const float* a, const float* b, float* y, int64_t n);
void silu_mul_backward(const float* g, const float* a, const float* b, float* da, float* db, int64_t n);
void silu_mul_forward_bf16(const uint16_t* a, const uint16_t* b, uint16_t* y, int64_t n);
void silu_mul_backward_bf16(const uint16_t* g, const uint16_t* a, const uint16_t* b, uint16_t* da, uint16_t* db,
                            int64_t n);
// Rotary embedding, "rotate half" form, on `rows` rows of 2h elements (row strides in elements):
// y = x c + [-x2, x1] s, with x1, x2 the halves of a row; backward dx = g c + [(g s)2, -(g s)1]:
// mfsdp::rotary.
void rotary_forward(const float* x, int64_t xs, const float* c, int64_t cs, const float* s, int64_t ss, float* y,
                    int64_t ys, int64_t rows, int64_t h);
void rotary_backward(const float* g, int64_t gs, const float* c, int64_t cs, const float* s, int64_t ss, float* dx,
                     int64_t dxs, int64_t rows, int64_t h);
void rotary_forward_bf16(const uint16_t* x, int64_t xs, const uint16_t* c, int64_t cs, const uint16_t* s, int64_t ss,
                         uint16_t* y, int64_t ys, int64_t rows, int64_t h);
void rotary_backward_bf16(const uint16_t* g, int64_t gs, const uint16_t* c, int64_t cs, const uint16_t* s, int64_t ss,
                          uint16_t* dx, int64_t dxs, int64_t rows, int64_t h);
// Attention's row passes (mfsdp::sdpa, model/cpu_attention.cpp): softmax of s[0:n] in place with
// s[n:len] zeroed, returning the row's log-sum-exp (NaN for a row with a NaN or an infinite
// maximum, which becomes all NaN); the probabilities again from logits and that log-sum-exp,
// exp(s - lse); the softmax's backward g = p (g - d) on [0, n) with g[n:len] zeroed; sum of a[i] b[i].
float softmax_row(float* s, int64_t n, int64_t len);
void softmax_from_lse_row(float* s, float lse, int64_t n, int64_t len);
void softmax_backward_row(const float* p, float* g, float d, int64_t n, int64_t len);
float dot_row(const float* a, const float* b, int64_t n);
// Their bf16 companions: `rows` rows of n floats (ldx apart) rounded to bf16 rows (ldy apart), nearest
// even; sum of a[i] b[i] over bf16 rows, in float.
void round_rows_bf16(const float* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t rows, int64_t n);
float dot_row_bf16(const uint16_t* a, const uint16_t* b, int64_t n);
// Column sums of `rows` rows of n (ld apart; fp32 or bf16) into fp32 out[0:n], rows in order, each
// added in float; out first zeroed unless `accumulate`.
void col_sums_f32(const float* x, int64_t ld, int64_t rows, int64_t n, float* out, bool accumulate);
void col_sums_bf16(const uint16_t* x, int64_t ld, int64_t rows, int64_t n, float* out, bool accumulate);

// Cross entropy's rows (parallel/cross_entropy.cpp). log(sum(exp(x[0:n]))), as ATen's logsumexp
// computes it: the row's maximum first; NaN for a row with a NaN, +inf with a +inf, -inf when all
// are -inf.
float logsumexp_row(const float* x, int64_t n);
// The loss's gradient on one row: out[j] = (exp(x[j] - lse) - (j == target ? onehot : 0)) * g for
// j < n; out may be x (in place). A NaN lse gives a NaN row.
void xent_grad_row(const float* x, float lse, int64_t target, float onehot, float g, float* out, int64_t n);
// Both on bf16 logits, computed in float; the gradient rounded to bf16 (nearest even).
float logsumexp_row_bf16(const uint16_t* x, int64_t n);
void xent_grad_row_bf16(const uint16_t* x, float lse, int64_t target, float onehot, float g, uint16_t* out, int64_t n);
}  // namespace mfsdp
