#include "data/gpt_dataset.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "util/error.h"

namespace mfsdp {

std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> p(n);
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  std::mt19937_64 rng(seed);
  for (int64_t i = n - 1; i > 0; --i) {
    int64_t j = static_cast<int64_t>(rng() % uint64_t(i + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

GptSamples::GptSamples(std::string name, std::vector<TokenRange> ranges, int64_t seq_length, uint64_t seed, bool shuffle)
    : name_(std::move(name)), ranges_(std::move(ranges)), seq_length_(seq_length), seed_(seed), shuffle_(shuffle) {
  for (const auto& r : ranges_) total_tokens_ += r.length;
  samples_per_epoch_ = (total_tokens_ - 1) / seq_length_;
  if (samples_per_epoch_ < 1)
    throw UserError(fmt::format("{}: {} tokens, fewer than training.seq_length + 1 = {}: not one training sample", name_,
                                total_tokens_, seq_length_ + 1));
}

const GptSamples::Epoch& GptSamples::epoch(int64_t e) {
  auto it = cache_.find(e);
  if (it != cache_.end()) return it->second;
  if (cache_.size() >= 2) cache_.erase(cache_.begin());  // samples are read in order: keep two epochs
  Epoch ep;
  const uint64_t s = seed_ * 1000003ULL + uint64_t(e) * 7919ULL;
  if (shuffle_) {
    ep.order = seeded_permutation(static_cast<int64_t>(ranges_.size()), s);
    ep.sample_perm = seeded_permutation(samples_per_epoch_, s ^ 0x9e3779b97f4a7c15ULL);
  } else {
    ep.order.resize(ranges_.size());
    for (size_t i = 0; i < ranges_.size(); ++i) ep.order[i] = int64_t(i);
    ep.sample_perm.resize(samples_per_epoch_);
    for (int64_t i = 0; i < samples_per_epoch_; ++i) ep.sample_perm[i] = i;
  }
  ep.cum.resize(ranges_.size() + 1);
  ep.cum[0] = 0;
  for (size_t i = 0; i < ranges_.size(); ++i) ep.cum[i + 1] = ep.cum[i] + ranges_[ep.order[i]].length;
  return cache_.emplace(e, std::move(ep)).first->second;
}

void GptSamples::get(int64_t index, int64_t* out) {
  const Epoch& ep = epoch(index / samples_per_epoch_);
  int64_t start = ep.sample_perm[index % samples_per_epoch_] * seq_length_;
  int64_t need = seq_length_ + 1;
  // The range holding `start`, then copy across range boundaries.
  size_t k = std::upper_bound(ep.cum.begin(), ep.cum.end(), start) - ep.cum.begin() - 1;
  while (need > 0) {
    const TokenRange& r = ranges_[ep.order[k]];
    int64_t within = start - ep.cum[k];
    int64_t n = std::min(need, r.length - within);
    if (n > 0) {
      r.src->read(r.offset + within, n, out);
      out += n;
      need -= n;
      start += n;
    }
    ++k;
  }
}

BlendedSamples::BlendedSamples(std::vector<std::unique_ptr<GptSamples>> parts, std::vector<double> weights)
    : parts_(std::move(parts)), weights_(std::move(weights)), counts_(parts_.size(), 0) {
  double total = 0;
  for (double w : weights_) total += w;
  for (double& w : weights_) w /= total;
}

void BlendedSamples::get(int64_t index, int64_t* out) {
  // Megatron's rule: sample i goes to the dataset furthest behind its share, w_d * (i + 1) - n_d
  // (the first such dataset on a tie). Assignment i depends on the counts after 0..i-1, so walk
  // forward from where the last call left off: the pipeline asks for increasing indices (a rank's
  // samples, step after step), and only the walk's position and the per-dataset counts are kept,
  // never an entry per sample. An index behind the walk (a new evaluation pass) restarts it.
  if (parts_.size() == 1) return parts_[0]->get(index, out);
  if (index < next_) {
    next_ = 0;
    std::fill(counts_.begin(), counts_.end(), 0);
  }
  for (;;) {
    const int64_t i = next_;
    int best = 0;
    double best_err = -1e300;
    for (size_t d = 0; d < parts_.size(); ++d) {
      double err = weights_[d] * double(i + 1) - double(counts_[d]);
      if (err > best_err) {
        best_err = err;
        best = static_cast<int>(d);
      }
    }
    const int64_t j = counts_[best]++;
    ++next_;
    if (i == index) return parts_[best]->get(j, out);
  }
}

namespace {

// Splits a source's token ranges into train and validation parts: whole documents when there are
// at least two, else the last `fraction` of the tokens.
void split_source(const TokenSource& src, double fraction, uint64_t seed, std::vector<TokenRange>& train,
                  std::vector<TokenRange>& valid) {
  const auto& bounds = src.doc_bounds();
  const int64_t docs = static_cast<int64_t>(bounds.size()) - 1;
  auto add_doc = [&](int64_t d, std::vector<TokenRange>& to) {
    for (int64_t s = bounds[d]; s < bounds[d + 1]; ++s)
      if (src.seq_length(s) > 0) to.push_back({&src, src.seq_offset(s), src.seq_length(s)});
  };
  if (fraction <= 0) {
    for (int64_t d = 0; d < docs; ++d) add_doc(d, train);
    return;
  }
  if (docs >= 2) {
    int64_t nvalid = std::max<int64_t>(1, int64_t(std::llround(fraction * docs)));
    auto perm = seeded_permutation(docs, seed ^ 0x5bd1e995ULL);
    std::vector<char> is_valid(docs, 0);
    for (int64_t i = 0; i < nvalid; ++i) is_valid[perm[i]] = 1;
    for (int64_t d = 0; d < docs; ++d) add_doc(d, is_valid[d] ? valid : train);
  } else {
    std::vector<TokenRange> all;
    for (int64_t d = 0; d < docs; ++d) add_doc(d, all);
    int64_t total = 0;
    for (auto& r : all) total += r.length;
    int64_t cut = int64_t(double(total) * (1.0 - fraction)), seen = 0;
    for (auto& r : all) {
      if (seen + r.length <= cut) train.push_back(r);
      else if (seen >= cut) valid.push_back(r);
      else {
        train.push_back({r.src, r.offset, cut - seen});
        valid.push_back({r.src, r.offset + (cut - seen), r.length - (cut - seen)});
      }
      seen += r.length;
    }
  }
}

}  // namespace

DataPipeline::DataPipeline(const Config& cfg, int64_t dp_rank, int64_t dp_size)
    : cfg_(cfg), dp_rank_(dp_rank), dp_size_(dp_size) {
  const auto& d = cfg.data;
  const int64_t T = cfg.training.seq_length;
  const uint64_t seed = uint64_t(cfg.training.seed);
  std::vector<std::unique_ptr<GptSamples>> train_parts, valid_parts;
  std::vector<double> train_w, valid_w;
  for (size_t i = 0; i < d.train.size(); ++i) {
    sources_.push_back(TokenSource::open(d.train[i].path, d.format));
    const TokenSource& src = *sources_.back();
    std::vector<TokenRange> tr, va;
    split_source(src, d.valid.empty() ? d.valid_fraction : 0.0, seed + i, tr, va);
    train_parts.push_back(std::make_unique<GptSamples>(src.name() + " (train)", tr, T, seed + 17 * i, d.shuffle));
    train_w.push_back(d.train[i].weight);
    description_ += fmt::format("{}train {} ({}, {} tokens, weight {})", description_.empty() ? "" : "; ", src.name(),
                                src.kind(), train_parts.back()->num_tokens(), d.train[i].weight);
    if (!va.empty()) {
      valid_parts.push_back(std::make_unique<GptSamples>(src.name() + " (valid split)", va, T, seed + 31 * i, false));
      valid_w.push_back(d.train[i].weight);
      description_ += fmt::format(", valid split {} tokens", valid_parts.back()->num_tokens());
    }
  }
  for (size_t i = 0; i < d.valid.size(); ++i) {
    sources_.push_back(TokenSource::open(d.valid[i].path, d.format));
    const TokenSource& src = *sources_.back();
    std::vector<TokenRange> all, none;
    split_source(src, 0.0, seed, all, none);
    valid_parts.push_back(std::make_unique<GptSamples>(src.name() + " (valid)", all, T, seed + 31 * i, false));
    valid_w.push_back(d.valid[i].weight);
    description_ += fmt::format("; valid {} ({} tokens)", src.name(), valid_parts.back()->num_tokens());
  }
  train_ = std::make_unique<BlendedSamples>(std::move(train_parts), train_w);
  if (!valid_parts.empty()) valid_ = std::make_unique<BlendedSamples>(std::move(valid_parts), valid_w);
}

Batch DataPipeline::make_batch(BlendedSamples& s, int64_t first, int64_t count) {
  const int64_t T = cfg_.training.seq_length;
  at::Tensor raw = at::empty({count, T + 1}, at::kLong);
  int64_t* p = raw.data_ptr<int64_t>();
  for (int64_t b = 0; b < count; ++b) s.get(first + b, p + b * (T + 1));
  if (raw.min().item<int64_t>() < 0) throw UserError("data: negative token id in the dataset");
  Batch batch;
  batch.tokens = raw.slice(1, 0, T).contiguous();
  batch.targets = raw.slice(1, 1, T + 1).contiguous();
  batch.loss_mask = at::ones({count, T}, at::kFloat);
  if (cfg_.data.eod_mask_loss) batch.loss_mask.masked_fill_(batch.targets.eq(*cfg_.data.eod_token), 0.0);
  batch.position_ids = at::arange(T, at::kLong).unsqueeze(0).expand({count, T}).contiguous();
  return batch;
}

Batch DataPipeline::train_batch(int64_t step, int64_t micro) {
  const auto& t = cfg_.training;
  const int64_t per_rank = t.global_batch_size / dp_size_;
  const int64_t first = step * t.global_batch_size + dp_rank_ * per_rank + micro * t.micro_batch_size;
  return make_batch(*train_, first, t.micro_batch_size);
}

Batch DataPipeline::valid_batch(int64_t iter, int64_t micro) {
  const auto& t = cfg_.training;
  const int64_t per_rank = t.global_batch_size / dp_size_;
  const int64_t first = iter * t.global_batch_size + dp_rank_ * per_rank + micro * t.micro_batch_size;
  return make_batch(*valid_, first, t.micro_batch_size);
}

}  // namespace mfsdp
