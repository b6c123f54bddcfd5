// Tensor parallelism by plan (Megatron-LM / PyTorch parallelize_module semantics), applied to a
// loaded TorchScript model before the FSDP engine wraps it:
//   1. the plan (distributed.tp_plan, or the one the exporter stored in the model file) gives every
//      module path a style; parameters of styled modules are cut to this rank's slice
//      (ModelParam::tp records how, so that initialisation, checkpoints and export see the global
//      tensor);
//   2. every call site of a styled module in the model's graphs gets the conjugate collectives of
//      tp_ops.h (DESIGN.md section 4: call-site rewrite); rowwise calls become
//      tp_reduce(linear(x, W)) + b so that the bias is added once;
//   3. with sequence parallel, the first unit's hidden-state input is split along the sequence, and
//      the parameters that then see only part of the sequence get ModelParam::tp_grad_sum.
// FSDP then shards each rank's TP slices over dp_shard x cp, exactly as it would whole tensors.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"

namespace mfsdp {

class Model;
class ProcessGroups;

// How the plan cuts each parameter (indexed like Model::params) for a TP size and rank, without
// touching the model. Throws ConfigError naming the plan entry, the parameter and the reason.
struct TpAssignment {
  std::string plan_source;                  // "distributed.tp_plan (file:line)" or the model file
  std::vector<std::string> param_styles;    // style of the module that owns each parameter ("" none)
  std::vector<int> split_dim;               // -1 replicated
  std::vector<std::vector<int64_t>> parts;  // packed parts along split_dim
  std::vector<bool> grad_sum;               // summed across TP (sequence parallel)
  std::vector<std::pair<std::string, TpStyle>> module_styles;  // module path -> style
};
TpAssignment plan_tensor_parallel(const Model& model, const Config& cfg, int64_t tp_size);

// One line per parameter: global shape, TP split and this rank's TP shape (for `mfsdp validate`).
std::string describe_tp_assignment(const Model& model, const TpAssignment& a, int64_t tp_size);

class TensorParallel {
 public:
  virtual ~TensorParallel() = default;
  // Whether the model's logits come back sharded along the vocabulary (a colwise output head):
  // the loss is then vocab_parallel_cross_entropy with vocab_start().
  virtual bool logits_sharded() const = 0;
  virtual int64_t vocab_start(int64_t local_vocab) const = 0;
  // The model's vocabulary from this rank's logits width: local_vocab, or with sharded logits the
  // output head's rows (fewer than local_vocab x tp_size where tp_size does not divide them: the
  // last ranks' columns past it are padding, TpSplit).
  virtual int64_t vocab_size(int64_t local_vocab) const = 0;
  virtual bool sequence_parallel() const = 0;
  virtual std::string describe() const = 0;
};

// Splits the parameters, rewrites the graphs and points the TP ops at the mesh's TP group. With
// tp_size 1 the plan (if any) is only checked. Must run before the model's first call and before
// the FSDP engine is built.
std::unique_ptr<TensorParallel> apply_tensor_parallel(Model& model, const Config& cfg, ProcessGroups& pg);

}  // namespace mfsdp
