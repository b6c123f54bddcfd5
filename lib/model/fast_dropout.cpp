// mfsdp::dropout and the draws behind it (model/fast_dropout.h; DESIGN.md section 7, "Dropout on
// the CPU").
//
// What ATen's dropout computes on a CPU tensor (at::native::dropout, not fused on the CPU):
//     noise = empty_like(x).bernoulli_(1 - p)   one draw per element, in memory order
//     noise.div_(1 - p)                         1 / float(1 - p), stored in x's dtype
//     y = x * noise                             autograd: dx = g * noise
// Here the same noise is a byte per element and a scale, drawn by model/cpu_random.h from the same
// generator; the products are the same products, so y and dx are ATen's bit for bit.
#include "model/fast_dropout.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/autograd.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <cstring>
#include <mutex>

#include "model/cpu_random.h"
#include "model/graph_rewrite.h"

namespace mfsdp {
namespace {

// ATen's test is cpuinfo's vendor of processor 0; CPUID's vendor string is where cpuinfo reads it.
bool cpu_made_by_intel() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  char vendor[13];
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  vendor[12] = '\0';
  return std::strcmp(vendor, "GenuineIntel") == 0;
#else
  return false;
#endif
}

// x * noise over n elements, split over ATen's threads (a memory-bound pass).
at::Tensor apply_noise(const at::Tensor& x0, const at::Tensor& keep, float scale) {
  const at::Tensor x = x0.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const uint8_t* k = keep.const_data_ptr<uint8_t>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    if (bf16)
      dropout_apply_bf16(reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>()) + begin, k + begin, scale,
                         reinterpret_cast<uint16_t*>(y.mutable_data_ptr<at::BFloat16>()) + begin, end - begin);
    else
      dropout_apply(x.const_data_ptr<float>() + begin, k + begin, scale, y.mutable_data_ptr<float>() + begin,
                    end - begin);
  });
  return y;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Dropout : public torch::autograd::Function<Dropout> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& keep, double scale) {
    ctx->save_for_backward({keep});
    ctx->saved_data["scale"] = scale;
    return apply_noise(x, keep, float(scale));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const at::Tensor keep = ctx->get_saved_variables()[0];
    return {apply_noise(g[0], keep, float(ctx->saved_data["scale"].toDouble())), at::Tensor(), at::Tensor()};
  }
};

// The kept mask when mfsdp draws this call's noise; undefined when at::dropout must run.
at::Tensor draw_noise(const at::Tensor& x, double p, bool train) {
  if (!train || !(p > 0.0 && p < 1.0) || !x.device().is_cpu() || x.layout() != at::kStrided || !x.is_contiguous() ||
      x.numel() == 0 || (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16))
    return {};
  at::Tensor keep = at::empty(x.sizes(), x.options().dtype(at::kByte));
  if (!draw_bernoulli_keep(1.0 - p, keep.mutable_data_ptr<uint8_t>(), x.numel())) return {};
  return keep;
}

at::Tensor dropout_autograd(const at::Tensor& x, double p, bool train) {
  const at::Tensor keep = draw_noise(x, p, train);
  if (!keep.defined()) return at::dropout(x, p, train);
  const double scale = dropout_scale(x.scalar_type(), p);
  if (at::GradMode::is_enabled() && x.requires_grad()) return Dropout::apply(x, keep, scale);
  return apply_noise(x, keep, float(scale));
}

at::Tensor dropout_plain(const at::Tensor& x, double p, bool train) {
  const at::Tensor keep = draw_noise(x, p, train);
  if (!keep.defined()) return at::dropout(x, p, train);
  return apply_noise(x, keep, dropout_scale(x.scalar_type(), p));
}

bool replace_dropout(torch::jit::Node* node) {
  if (node->inputs().size() != 3 || node->outputs().size() != 1) return false;
  return replace_node_by(node, "mfsdp::dropout", {node->input(0), node->input(1), node->input(2)});
}

}  // namespace

bool cpu_bernoulli_replicable() {
  static const bool replicable = !at::hasMKL() || !cpu_made_by_intel();
  return replicable;
}

bool draw_bernoulli_keep(double p, uint8_t* keep, int64_t n) {
  if (!cpu_bernoulli_replicable()) return false;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  // The lock ATen's kernel holds while it draws (Note [Acquire lock when using random generators]).
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::mt19937 engine = impl->engine();
  at::mt19937_data_pod pod = engine.data();
  // A state torch.set_rng_state could load but the engine never reaches on its own: left ATen's.
  if (pod.left_ < 1 || pod.left_ > 625 || int64_t(pod.next_) + pod.left_ - 1 > 624) return false;
  Mt19937State s;
  std::memcpy(s.state, pod.state_.data(), sizeof(s.state));
  s.left = pod.left_;
  s.next = pod.next_;
  mt19937_bernoulli(s, p, keep, n);
  std::memcpy(pod.state_.data(), s.state, sizeof(s.state));
  pod.left_ = s.left;
  pod.next_ = s.next;
  engine.set_data(pod);
  impl->set_engine(engine);
  return true;
}

float dropout_scale(at::ScalarType dtype, double p) {
  const float scale = 1.0f / float(1.0 - p);
  return dtype == at::kBFloat16 ? float(c10::BFloat16(scale)) : scale;
}

int use_fast_dropout(torch::jit::Module& root) {
  if (!cpu_bernoulli_replicable()) return 0;
  // nn.Dropout's forward calls torch.nn.functional.dropout, a function of its own in a scripted file.
  return rewrite_nodes(root, {c10::aten::dropout}, replace_dropout, /*into_functions=*/true);
}

at::Tensor dropout(const at::Tensor& x, double p, bool train) { return dropout_autograd(x, p, train); }

}  // namespace mfsdp

TORCH_LIBRARY_FRAGMENT(mfsdp, m) { m.def("dropout(Tensor x, float p, bool train) -> Tensor"); }

TORCH_LIBRARY_IMPL(mfsdp, Autograd, m) { m.impl("dropout", mfsdp::dropout_autograd); }

TORCH_LIBRARY_IMPL(mfsdp, CompositeExplicitAutograd, m) { m.impl("dropout", mfsdp::dropout_plain); }
