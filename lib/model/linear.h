// mfsdp::linear(x, w, b): aten::linear whose weight and bias gradients are written by the backward's
// products straight into the parallel engine's gradient buffers (DESIGN.md section 7, step
// 3, "Gradients into the buckets"), as Megatron's gradient-accumulation fusion writes into main_grad. Autograd
// then carries no gradient tensor for those parameters: no per-parameter copy into the bucket and
// no gradient-sized temporary, and a second micro-batch accumulates in the product (beta = 1).
#pragma once
#include <ATen/core/Tensor.h>

namespace torch::jit {
struct Module;
}

namespace mfsdp {

// Where a parameter's gradient goes instead of autograd: the engine (fsdp/fsdp_engine.cpp).
class GradSink {
 public:
  virtual ~GradSink() = default;
  // The index of the parameter that `t` is (the same tensor, by identity) when this sink takes its
  // gradient on t's device, in t's dtype or (bf16 t on the CPU) into fp32 main gradients, else -1:
  // its gradient goes through autograd as usual.
  virtual int sink_param(const at::Tensor& t) const = 0;
  // Parameter pi's gradient buffer for the backward running now, shaped as the parameter, and
  // whether it already holds part of this step's gradient (add into it) or is to be overwritten.
  // The accumulator's hook of the parameter still runs after every use of it, with no gradient
  // from this op (the engine counts it ready there, and adds what other ops gave).
  virtual at::Tensor sink_buffer(int pi, bool& accumulate) = 0;
};

// The sink that mfsdp::linear's backward writes into (nullptr: none; every gradient to autograd).
void set_grad_sink(GradSink* sink);

// Replaces every aten::linear(x, w, b) in the module's graphs by mfsdp::linear(x, w, b), every
// aten::addmm(b, x, w, 1, 1) (Hugging Face's Conv1D: y = x w + b, w stored [in, out]) by
// mfsdp::linear_t(b, x, w), and every aten::embedding by mfsdp::embedding (its backward adds the
// token rows into the table's bucket gradient), once per TorchScript type. After tensor parallelism has rewritten its
// call sites (it finds Linear and Conv1D modules by their aten::linear and aten::addmm). Returns the
// calls replaced, linear (and Conv1D) and embedding.
struct SinkCalls {
  int linear = 0, embedding = 0;
};
SinkCalls use_sink_linear(torch::jit::Module& root);

}  // namespace mfsdp
