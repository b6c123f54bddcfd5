// Context parallelism: every sequence is split across the CP group, load-balanced for causal
// attention, and the model's attention core is replaced by one that sees the whole sequence.
//
// Layout: the sequence of T tokens is cut into 2 x cp chunks of c = T / (2 cp); CP rank r holds
// chunks r and 2cp-1-r (in that order), so that every rank does the same causal work (2cp + 1
// blocks of c x c scores). The trainer slices each batch so (tokens, targets, loss mask, global
// position ids); everything outside attention is per token and needs nothing else.
//
// Attention (mfsdp::cp_attention(q, k, v) on [B, H, T/cp, D], replacing each call of a core-
// attention module, DESIGN.md section 4): each local query chunk runs over the key chunks at or
// before it, block by block, merging partial results by log-sum-exp (no [T, T] score matrix
// exists; at most c x c per block), with the causal mask on global positions in the diagonal
// block. Backward recomputes the blocks from the saved log-sum-exp (flash-attention style).
// Keys and values reach the other ranks in one of two ways (distributed.cp_comm_type):
//   all_gather  the whole sequence's keys/values at once (one collective; O(T) per rank while the
//               layer runs); backward gathers them again and reduce-scatters their gradients.
//   p2p         a ring: cp steps, each computing on the keys/values of one rank while the next
//               rank's travel (send to r+1, receive from r-1, overlapped); O(T/cp) per rank.
//               Backward passes the keys/values around with their gradient accumulators (after
//               each step's blocks), which arrive home after the last step.
#pragma once
#include <memory>
#include <string>

#include "config/config.h"

namespace at {
class Tensor;
}

namespace mfsdp {

class Model;
class ProcessGroups;
struct Batch;

class ContextParallel {
 public:
  virtual ~ContextParallel() = default;
  // This rank's part of a batch: its two chunks of every sequence, in the layout above.
  virtual Batch slice(const Batch& b) const = 0;
  virtual std::string describe() const = 0;
};

// Replaces the core-attention calls (distributed.core_attention_modules: class names or
// module-path globs) with mfsdp::cp_attention when cp_size > 1. Must run before the model's first
// call. With cp_size 1 nothing changes (the model's own core runs).
std::unique_ptr<ContextParallel> apply_context_parallel(Model& model, const Config& cfg, ProcessGroups& pg);

// The attention itself (for tests too): q, k, v are this rank's chunks [B, H, T/cp, D] of the
// group set by set_cp_context (nullptr: plain causal attention on the local tensors).
class Communicator;
void set_cp_context(Communicator* cp, bool ring = false);
// scale <= 0: 1/sqrt(head_dim); softcap > 0: scores soft-capped, cap * tanh(scores / cap), before
// the causal mask (Gemma 2; the blocks then run as fp32 matmuls, never flash kernels).
at::Tensor cp_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale = 0.0,
                        double softcap = 0.0);

}  // namespace mfsdp
