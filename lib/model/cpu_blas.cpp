// cpu_blas.h: MKL's bf16 product into fp32, called directly.
#include "model/cpu_blas.h"

#include <ATen/ATen.h>
#include <dlfcn.h>

#include <algorithm>

// CBLAS's bf16 product (row-major or column-major; bf16 as uint16_t). Weak, as attention's sgemm_: a
// LibTorch without it links, and the callers keep their other paths (cpu_bf16_products_available).
extern "C" void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                       const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                                       int ldc) __attribute__((weak));

namespace mfsdp {

bool cpu_bf16_products_available() { return cblas_gemm_bf16bf16f32 != nullptr; }

bool cpu_bf16_products_native() {
  static const bool native = [] {
    if (!cpu_bf16_products_available()) return false;
#if defined(__x86_64__)
    if (!__builtin_cpu_supports("avx512bf16") && !__builtin_cpu_supports("amx-bf16")) return false;
#else
    return false;
#endif
    // 0 is MKL's generic code path (train/system.cpp, "MKL's dispatch").
    using DetectFn = int (*)();
    auto detect = reinterpret_cast<DetectFn>(dlsym(RTLD_DEFAULT, "mkl_serv_cpu_detect"));
    return detect != nullptr && detect() != 0;
  }();
  return native;
}

void gemm_bf16_f32(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const uint16_t* A, int64_t lda,
                   const uint16_t* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
  TORCH_CHECK(cblas_gemm_bf16bf16f32 != nullptr, "bf16 products need MKL's cblas_gemm_bf16bf16f32");
  cblas_gemm_bf16bf16f32(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, int(M), int(N), int(K), alpha, A,
                         int(lda), B, int(ldb), beta, C, int(ldc));
}

namespace {
// A matrix as the BLAS reads it: row-major rows `ld` apart, or (trans) the row-major storage of its
// transpose; a layout that is neither is copied contiguous.
struct Operand {
  at::Tensor t;
  bool trans;
  int64_t ld;
};
Operand operand(const at::Tensor& m) {
  const int64_t rows = m.size(0), cols = m.size(1);
  if ((m.stride(1) == 1 || cols <= 1) && m.stride(0) >= std::max<int64_t>(1, cols)) return {m, false, m.stride(0)};
  if ((m.stride(0) == 1 || rows <= 1) && m.stride(1) >= std::max<int64_t>(1, rows)) return {m, true, m.stride(1)};
  at::Tensor c = m.contiguous();
  return {c, false, std::max<int64_t>(1, cols)};
}
const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::BFloat16>()); }
}  // namespace

void mm_bf16_into_f32(at::Tensor& c, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) && c.size(0) == a.size(0) &&
                  c.size(1) == b.size(1),
              "mm_bf16_into_f32: shapes ", a.sizes(), " x ", b.sizes(), " into ", c.sizes());
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && c.scalar_type() == at::kFloat &&
                  a.is_cpu() && b.is_cpu() && c.is_cpu(),
              "mm_bf16_into_f32: bf16 CPU operands into an fp32 CPU matrix");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  TORCH_CHECK((c.stride(1) == 1 || N <= 1) && c.stride(0) >= std::max<int64_t>(1, N),
              "mm_bf16_into_f32: the result's rows need unit stride");
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate) c.zero_();
    return;
  }
  const Operand A = operand(a), B = operand(b);
  gemm_bf16_f32(A.trans, B.trans, M, N, K, 1.0f, bits(A.t), A.ld, bits(B.t), B.ld, accumulate ? 1.0f : 0.0f,
                c.mutable_data_ptr<float>(), std::max<int64_t>(1, c.stride(0)));
}

}  // namespace mfsdp
