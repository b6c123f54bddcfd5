// Cross entropy of the output logits without [tokens, vocab] temporaries (DESIGN.md section 7, step 3).
//
// ATen's cross_entropy is log_softmax + nll_loss: it keeps a full log-softmax for backward and its
// backward allocates two more tensors of the logits' size (nll's gradient, then log_softmax's), so
// with a large vocabulary the loss briefly holds four logits-sized tensors, more than a layer's
// weights. Here the forward keeps only the logits (which exist anyway) and one log-sum-exp per
// token, reading the logits in row chunks; the backward writes softmax - onehot, chunk by chunk,
// into the one gradient tensor it returns.
#pragma once
#include <ATen/core/Tensor.h>

namespace mfsdp {

class Communicator;

// Per-token loss [N] (fp32) of logits [N, V] (any float dtype; computed in fp32) against targets
// [N] (int64). With `vocab_group`, the logits hold the vocabulary columns [vocab_start,
// vocab_start + V) of the full logits, split over that group: the row maxima and the sums of
// exponentials and target logits are all-reduced there (every rank returns the same loss) and a
// target outside this rank's columns contributes nothing here. Only the first `real_columns` of
// them (-1: all) are the vocabulary's: the rest pad an uneven split (TpSplit), take no part in the
// loss and get a zero gradient. Differentiable in logits; the gradient has the logits' dtype.
// fp32 and bf16 logits on the CPU take fused row kernels (one read of a row forward, one pass
// backward; bf16 computed in float and rounded once, as the chunked path does).
// `consume_logits`: the caller keeps no handle on the logits once the loss is computed, and
// backward runs once; the backward may then write the gradient over them when nothing else holds
// them (cross_entropy.cpp, may_overwrite).
at::Tensor cross_entropy_per_token(const at::Tensor& logits, const at::Tensor& targets,
                                   Communicator* vocab_group = nullptr, int64_t vocab_start = 0,
                                   int64_t real_columns = -1, bool consume_logits = false);
// Backward passes so far that wrote their gradient over the logits (for the tests).
int64_t cross_entropy_overwrites();

}  // namespace mfsdp
