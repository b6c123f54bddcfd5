// Tensor-parallel operators (Megatron's f / g conjugate pairs), registered as TorchScript custom
// ops so that the call-site rewrite (tensor_parallel.cpp) can put them into a model's graphs:
//
//   mfsdp::tp_copy(x)        before a colwise module: fwd identity, bwd all-reduce over TP;
//                            with sequence parallel: fwd all-gather along the sequence (dim 1),
//                            bwd reduce-scatter along it
//   mfsdp::tp_reduce(x)      after a rowwise matmul: fwd all-reduce, bwd identity; with sequence
//                            parallel: fwd reduce-scatter along the sequence, bwd all-gather
//   mfsdp::tp_gather_last(x) colwise_rep output: fwd all-gather along the last dim, bwd own slice
//   mfsdp::tp_split_last(x)  rowwise_rep input (replicated): fwd own slice of the last dim, bwd
//                            all-gather along it
//   mfsdp::sp_scatter(first, x)  at the entry of the first unit (sequence parallel only): fwd this
//                            rank's chunk of the sequence, bwd all-gather (no-op when first == 0)
//   mfsdp::tp_vocab_ids(ids, start, end)        ids shifted into the local shard, clamped
//   mfsdp::tp_vocab_reduce(y, ids, start, end)  rows of ids outside [start, end) zeroed, all-reduced
//
// All ops use CONSERVATIVE alias analysis: the JIT neither drops nor reorders collectives.
#pragma once
#include <ATen/core/Tensor.h>

namespace mfsdp {

class Communicator;

// The TP group and mode the ops use (one per process); nullptr: every op is the identity.
void set_tp_context(Communicator* tp, bool sequence_parallel);

// The sequence length of the batch the model runs (its tokens' dim 1; Model::forward sets it):
// sp_scatter refuses a first block input whose dim 1 is something else (Gemma 3n's layers take
// [altup inputs, B, T, H]: cut along dim 1, the model would train on another thing, silently).
void set_sequence_length(int64_t tokens_dim1);

// Cross entropy over logits sharded along the vocabulary: logits [N, V/tp] hold the columns
// [vocab_start, vocab_start + V/tp) of the full logits. Returns the per-token loss [N] (identical
// on every TP rank), with max and sum-exp reduced across the group; the full [N, V] logits never
// exist on one rank. With `vocab` < vocab_start + V/tp, the columns past it are padding (an
// uneven split, TpSplit), outside the loss. Differentiable in logits. `consume_logits`: as
// cross_entropy_per_token's.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                                        int64_t vocab, bool consume_logits = false);

// Along dimension `dim`: every rank's tensor concatenated in rank order / this rank's chunk of the
// sum. Shared with the context-parallel code.
at::Tensor all_gather_dim(Communicator& c, const at::Tensor& x, int64_t dim);
at::Tensor reduce_scatter_dim(Communicator& c, const at::Tensor& x, int64_t dim);

}  // namespace mfsdp
