// GPT-style training samples (Megatron's GPTDataset semantics, simplified): per epoch the
// sequences are shuffled and concatenated, windows of seq_length+1 tokens are cut with stride
// seq_length, and the windows are shuffled; weighted blends choose a dataset per sample with
// Megatron's deterministic greedy rule. A sample is a pure function of (seed, index), so the
// sampler's whole state is the number of samples consumed.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "data/token_source.h"

namespace mfsdp {

struct TokenRange {
  const TokenSource* src;
  int64_t offset, length;  // in tokens
};

class GptSamples {
 public:
  GptSamples(std::string name, std::vector<TokenRange> ranges, int64_t seq_length, uint64_t seed, bool shuffle);
  int64_t samples_per_epoch() const { return samples_per_epoch_; }
  int64_t num_tokens() const { return total_tokens_; }
  // Writes seq_length + 1 tokens of sample `index` (any index >= 0: later epochs reshuffle).
  void get(int64_t index, int64_t* out);

 private:
  struct Epoch {
    std::vector<int64_t> order;       // range order
    std::vector<int64_t> cum;         // token offset of each range in the epoch's stream
    std::vector<int64_t> sample_perm;  // window order
  };
  const Epoch& epoch(int64_t e);
  std::string name_;
  std::vector<TokenRange> ranges_;
  int64_t seq_length_, total_tokens_ = 0, samples_per_epoch_ = 0;
  uint64_t seed_;
  bool shuffle_;
  std::map<int64_t, Epoch> cache_;
};

class BlendedSamples {
 public:
  BlendedSamples(std::vector<std::unique_ptr<GptSamples>> parts, std::vector<double> weights);
  void get(int64_t index, int64_t* out);
  size_t num_parts() const { return parts_.size(); }
  // Bytes of assignment state held (constant in the number of samples drawn).
  size_t state_bytes() const { return sizeof next_ + counts_.size() * sizeof(int64_t); }

 private:
  std::vector<std::unique_ptr<GptSamples>> parts_;
  std::vector<double> weights_;
  int64_t next_ = 0;             // the next sample index the assignment walk will place
  std::vector<int64_t> counts_;  // samples given to each dataset before next_
};

struct Batch {
  at::Tensor tokens, targets, loss_mask, position_ids;  // [micro_batch, seq_length]; int64, int64, float, int64
};

// Train and validation samples for one data-parallel rank.
class DataPipeline {
 public:
  DataPipeline(const Config& cfg, int64_t dp_rank, int64_t dp_size);
  // Micro-batch `micro` (0-based) of optimizer step `step` (0-based) for this rank.
  Batch train_batch(int64_t step, int64_t micro);
  // Micro-batch `micro` of evaluation iteration `iter` (the same samples at every evaluation).
  Batch valid_batch(int64_t iter, int64_t micro);
  bool has_valid() const { return valid_ != nullptr; }
  std::string describe() const { return description_; }

 private:
  Batch make_batch(BlendedSamples& s, int64_t first_index, int64_t count);
  const Config& cfg_;
  int64_t dp_rank_, dp_size_;
  std::vector<std::unique_ptr<TokenSource>> sources_;
  std::unique_ptr<BlendedSamples> train_, valid_;
  std::string description_;
};

// Deterministic Fisher-Yates with a 64-bit Mersenne twister: the same on every platform.
std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed);

}  // namespace mfsdp
