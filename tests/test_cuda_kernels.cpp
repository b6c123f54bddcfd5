// The GPU kernels of mfsdp's fused ops (model/cuda_kernels.cu) without a GPU: each kernel's
// per-element function, run on the host one index after another (cuda_kernels.h: *_host), against
// ATen on the shapes the GPU sees (a transposed query, cos and sin broadcast over the heads). What
// this cannot check (the launches, the streams, the GPU's expf) is checked on the GPU itself before
// a run uses a kernel (fast_ops.h: verify_device_fast_ops) and by tests/gpu/gpu_tests.py.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "catch.h"
#include "kernel_refs.h"
#include "model/cuda_kernels.h"

namespace ck = mfsdp::cuda_kernels;

namespace {
using mfsdp::test::rotate_half_ref;
using mfsdp::test::scaled;
ck::Dtype dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? ck::Dtype::kFloat : ck::Dtype::kBFloat16;
}
}  // namespace

TEST_CASE("GPU SwiGLU kernel's arithmetic (host run) against ATen, fp32 and bf16") {
  at::manual_seed(5);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const int64_t n = 4099;
    at::Tensor a = (at::randn({n}) * 3).to(dt), b = at::randn({n}).to(dt), g = at::randn({n}).to(dt);
    at::Tensor y = at::empty_like(a), da = at::empty_like(a), db = at::empty_like(a);
    ck::silu_mul_forward_host(dtype_of(a), a.const_data_ptr(), b.const_data_ptr(), y.mutable_data_ptr(), n);
    ck::silu_mul_backward_host(dtype_of(a), g.const_data_ptr(), a.const_data_ptr(), b.const_data_ptr(),
                               da.mutable_data_ptr(), db.mutable_data_ptr(), n);
    // The exact values in double from the same (rounded) inputs.
    const at::Tensor ad = a.to(at::kDouble), bd = b.to(at::kDouble), gd = g.to(at::kDouble), s = at::sigmoid(ad);
    const double tol = dt == at::kFloat ? 1e-6 : 1.0 / 128;
    INFO("dtype " << dt);
    CHECK(scaled(y, ad * s * bd) < tol);
    CHECK(scaled(db, gd * ad * s) < tol);
    CHECK(scaled(da, gd * bd * s * (1 + ad * (1 - s))) < tol);
  }
}

TEST_CASE("GPU rotary kernel's indexing and arithmetic (host run): strided x, broadcast tables") {
  at::manual_seed(6);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16})
    for (int64_t d : {2, 16, 34, 128}) {
      // [B, T, H, D] memory seen as [B, H, T, D]; cos and sin [B, 1, T, D] expanded over the heads.
      const at::Tensor x = at::randn({2, 5, 3, d}).to(dt).transpose(1, 2);
      const at::Tensor ang = at::randn({2, 1, 5, d});
      const at::Tensor cos = ang.cos().to(dt).expand(x.sizes()), sin = ang.sin().to(dt).expand(x.sizes());
      const ck::RotaryShape shape = ck::rotary_shape(x, cos, sin);
      at::Tensor fwd = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
      at::Tensor bwd = at::empty_like(fwd);
      ck::rotary_host(dtype_of(x), false, x.const_data_ptr(), cos.const_data_ptr(), sin.const_data_ptr(),
                      fwd.mutable_data_ptr(), shape);
      ck::rotary_host(dtype_of(x), true, x.const_data_ptr(), cos.const_data_ptr(), sin.const_data_ptr(),
                      bwd.mutable_data_ptr(), shape);
      const at::Tensor xd = x.to(at::kDouble), cd = cos.to(at::kDouble), sd = sin.to(at::kDouble);
      // The backward is the adjoint of the forward: dx = g cos + rotate_half^T(g sin).
      at::Tensor xg = xd.clone().requires_grad_(true);
      const at::Tensor want_bwd =
          torch::autograd::grad({xg * cd + rotate_half_ref(xg) * sd}, {xg}, {xd})[0];  // g = x as the gradient
      const double tol = dt == at::kFloat ? 1e-6 : 1.0 / 128;
      INFO("dtype " << dt << " d " << d);
      CHECK(fwd.is_contiguous());
      CHECK(scaled(fwd, xd * cd + rotate_half_ref(xd) * sd) < tol);
      CHECK(scaled(bwd, want_bwd) < tol);
    }
}
