// The parallel engine: what the training loop asks of the data-parallel machinery, whatever the
// zero_dp_strategy. It owns main weights and main gradients, reduces gradients across the
// data-parallel group as they become ready in backward, and hands the optimizer its slots.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "model/tp_split.h"
#include "optim/optimizer.h"

#include <ATen/core/Tensor.h>

namespace mfsdp {

class Model;
class ProcessGroups;

class ParallelEngine {
 public:
  virtual ~ParallelEngine() = default;
  // Zeroes the main gradients before the first micro-batch of a step.
  virtual void start_step() = 0;
  // Before each micro-batch's backward: whether it is the last of the step (gradients are reduced
  // across data-parallel ranks only then, as Megatron does when accumulating).
  virtual void start_micro_batch(bool last) = 0;
  // Before each forward of the whole model (training or evaluation): weights outside units must be
  // present (gathered, or their post-step gather finished).
  virtual void pre_model_forward() = 0;
  // After each micro-batch's backward returned.
  virtual void end_micro_batch() = 0;
  // After the last backward: waits for every reduction, then multiplies the gradients by `scale`.
  virtual void finish_grad_sync(double scale) = 0;
  // Global L2 norm of the main gradients, every element counted once across the job: a 0-dim
  // fp64 tensor on the engine's device (reading it is the caller's host synchronisation).
  virtual at::Tensor grad_norm() = 0;
  // Names of parameters whose gradient holds a NaN or Inf (this rank's part).
  virtual std::vector<std::string> nonfinite_grads() = 0;
  virtual std::vector<OptimSlot>& slots() = 0;
  // Copies the main weights into the model's compute weights: after an optimizer step only those
  // of trainable parameters (trainable_only; frozen ones did not change), after a load all of them.
  virtual void install_weights(bool trainable_only = false) = 0;
  // Lines about buckets and this rank's memory, for the start-up log.
  virtual std::string describe() const = 0;
  // Bytes this rank holds persistently: compute weights, separate main weights, main gradients.
  struct Memory {
    int64_t weights = 0, main_weights = 0, grads = 0;
  };
  virtual Memory memory() const = 0;
  // Parameters replaced on the module after wrapping (for example by loading weights into it, the
  // reference API's snapshot/restore case): by parameter name, takes each replacement's values
  // into the sharded buffers and puts the engine's own parameter back on the module. Returns how
  // many parameters were replaced.
  virtual int rebind_parameters() = 0;
  // Sets parameters by name from full (unsharded) tensors; each rank keeps its part.
  virtual void load_full_weights(const std::vector<std::pair<std::string, at::Tensor>>& weights) = 0;
  // Checkpoints. For each optimizer slot: the parameter's global shape and the flat element range
  // [begin, end) of this rank's tensor-parallel slice that the slot holds (the whole parameter
  // when it is not split), with the split that maps the slice into the global tensor.
  struct SlotRange {
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;
    TpSplit tp;
    bool tp_replica = false;  // replicated across TP ranks: only TP rank 0 writes it
  };
  virtual const std::vector<SlotRange>& slot_ranges() const = 0;
  // Whether this rank writes its slots: replicas of the same shard (no_shard's data-parallel peers,
  // HSDP's replicas) leave it to the first of them.
  virtual bool checkpoint_writer() const = 0;
  // Highest bytes held by the engine (persistent + gathered weights + gradients in flight) since
  // the last call; each call starts a new window.
  virtual int64_t take_peak_bytes() = 0;
  // Of that window (the one the last take_peak_bytes() closed): the highest bytes of gathered unit
  // weights alone (strategy 3; 0 otherwise), independent of when reductions finish.
  virtual int64_t gathered_peak_bytes() const = 0;
  // Strategy 3: all-gathers of unit weights issued since the engine was built (0 otherwise).
  virtual int64_t gathers_issued() const = 0;
};

// Chooses the engine for the config and mesh; the model's units must already be found.
std::unique_ptr<ParallelEngine> make_engine(Model& model, const Config& cfg, ProcessGroups& pg);

}  // namespace mfsdp
