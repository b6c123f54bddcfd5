// The BLAS products mfsdp calls itself on CPU tensors, beside ATen's: MKL's product of bf16 matrices
// into fp32, which LibTorch's MKL exports (cblas_gemm_bf16bf16f32). bf16 attention's products
// (model/cpu_attention.cpp) and bf16 weight gradients written into fp32 buckets (model/linear.cpp).
#pragma once
#include <cstdint>

namespace at {
class Tensor;
}

namespace mfsdp {

// Whether bf16 products into fp32 run in hardware here: the process has MKL's cblas_gemm_bf16bf16f32,
// the CPU has AVX-512 BF16 or AMX, and MKL picks its kernels by instruction set (always on Intel's
// CPUs; on others with mfsdp's answer to MKL's vendor check, train/system.cpp). Elsewhere MKL's
// bf16 product was slower than its fp32 one (an AMD EPYC with MKL's generic kernels: 0.8-0.95x
// sgemm's rate at attention's shapes), and callers keep their fp32 or ATen paths.
bool cpu_bf16_products_native();
// Whether the process has cblas_gemm_bf16bf16f32 at all (the functions below need it).
bool cpu_bf16_products_available();

// Row-major C[M, N] = alpha op(A) op(B) + beta C with A, B bf16 (their bits) and C fp32.
void gemm_bf16_f32(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A, int64_t lda,
                   const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc);

// c = a b, or c += a b when `accumulate`: a [M, K] and b [K, N] bf16 CPU matrices of any strides (a
// transposed view is read as one; other layouts are made contiguous), c an fp32 [M, N] CPU matrix
// whose rows have unit stride. The products accumulate in fp32; nothing is rounded to bf16.
void mm_bf16_into_f32(at::Tensor& c, const at::Tensor& a, const at::Tensor& b, bool accumulate);

}  // namespace mfsdp
