// Custom TorchScript operators placed at the entry and the return of every FSDP unit's forward
// graph (DESIGN.md section 4). Their forward and backward kernels call the engine:
//   pre_forward  forward : the unit is about to run       -> gather its weights, prefetch the next
//   post_forward forward : the unit has run               -> free its gathered weights (but the
//                          last unit of a forward that backward follows: its backward comes next)
//   post_forward backward: the unit's backward is next    -> gather its weights again, prefetch
//   pre_forward  backward: the unit's backward has run    -> free its gathered weights
// Activation checkpointing runs a unit's forward a second time inside backward (the recompute);
// the engine is told (recompute(unit, true/false) around it) so that the recompute gathers the
// unit once, prefetches in backward order and keeps the weights for the backward that follows.
// The ops are registered with CONSERVATIVE alias analysis so that the JIT neither drops nor
// reorders them.
#pragma once

namespace mfsdp {

class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void pre_forward(int unit) = 0;
  // backward_follows: autograd records this forward (grad mode on, an output requires grad).
  virtual void post_forward(int unit, bool backward_follows) = 0;
  virtual void pre_backward(int unit) = 0;
  virtual void post_backward(int unit) = 0;
  // Brackets the recomputed forward of a checkpointed unit (in backward).
  virtual void recompute(int unit, bool begin) = 0;
};

// The engine that receives the calls (one per process); nullptr: the ops only pass tensors through.
void set_unit_hooks(UnitHooks* hooks);

}  // namespace mfsdp
