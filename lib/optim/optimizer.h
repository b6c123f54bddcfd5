// Optimizers that step on (possibly sharded) fp32 main weights: AdamW, Adam (L2) and SGD with
// momentum, with PyTorch's update formulas, so that a run matches torch.optim step for step.
// State (moments) exists only for the slots a rank owns: with sharding, only its shard.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "config/config.h"

namespace mfsdp {

struct OptimSlot {
  std::string name;   // for messages and checkpoints
  at::Tensor weight;  // main weights (updated in place); fp32, or the compute dtype without fp32 copies
  at::Tensor grad;    // main gradients, same shape
  bool decay = true;  // weight decay applies
  bool frozen = false;  // model.frozen: no gradient (grad undefined), no state; the optimizer skips it
};

// How a slot is updated (DESIGN.md section 7, step 6). kAuto picks per slot: mfsdp's own fused pass for
// contiguous fp32 CPU slots; ATen's fused multi-tensor kernels (torch.optim's fused=True:
// _fused_adamw_, _fused_adam_, _fused_sgd_; one launch per group of slots) for contiguous fp32
// slots on a GPU; op by op otherwise (bf16 gradients, strided views). The other values force one
// path where it applies (tests compare them on the CPU).
enum class UpdatePath { kAuto, kCpuFused, kAtenFused, kOpByOp };

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update with learning rate `lr`. Slots must be the same (names, shapes) at every call.
  // `grad_scale` (optional 0-dim tensor, the clip coefficient): the update uses grad x grad_scale,
  // as if the gradients had been multiplied first (clip_grad_norm_ then step). The CPU pass folds
  // it into its loop (no pass of its own); the other paths multiply the gradients in place first.
  virtual void step(std::vector<OptimSlot>& slots, double lr, const at::Tensor& grad_scale = {}) = 0;
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t n) { step_ = n; }
  // Named state tensors (for memory accounting): "exp_avg.<slot>", ...
  virtual std::vector<std::pair<std::string, at::Tensor>> state() = 0;
  // Checkpoints: the kinds of per-slot state ("exp_avg", "exp_avg_sq" / "momentum_buffer") and
  // each slot's tensor of a kind, allocated (zeros) on first use so that a loaded run can fill it;
  // undefined for a frozen slot.
  virtual std::vector<std::string> state_kinds() const = 0;
  virtual at::Tensor slot_state(const std::string& kind, size_t slot, const std::vector<OptimSlot>& slots) = 0;

 protected:
  int64_t step_ = 0;
};

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, UpdatePath path = UpdatePath::kAuto);

// Learning rate at optimizer step `step` (1-based), Megatron's OptimizerParamScheduler semantics.
double learning_rate(const LrSchedulerConfig& s, double max_lr, int64_t max_steps, int64_t step);

}  // namespace mfsdp
