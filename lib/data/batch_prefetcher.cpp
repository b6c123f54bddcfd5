// BatchPrefetcher: one producer thread, a bounded queue of whole steps, errors handed to the
// consumer at the step they belong to. (DESIGN.md section 7, step 1.)
#include "data/batch_prefetcher.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>

namespace mfsdp {

HostBatch host_batch(Batch b) {
  HostBatch h;
  h.batch = std::move(b);
  // Plain loops over the contiguous host tensors: the largest id and the tokens in the loss.
  const int64_t n = h.batch.tokens.numel();
  const at::Tensor tc = h.batch.tokens.contiguous(), gc = h.batch.targets.contiguous();
  const at::Tensor mc = h.batch.loss_mask.to(at::kFloat).contiguous();
  const int64_t* tok = tc.data_ptr<int64_t>();
  const int64_t* tgt = gc.data_ptr<int64_t>();
  const float* mask = mc.data_ptr<float>();
  int64_t mx = 0;
  double counted = 0;
  for (int64_t i = 0; i < n; ++i) {
    mx = std::max(mx, std::max(tok[i], tgt[i]));
    counted += double(mask[i]);
  }
  h.max_token = mx;
  h.tokens = counted;
  return h;
}

BatchPrefetcher::BatchPrefetcher(BatchReader read, int64_t micro_batches, int64_t first, int64_t end, int depth)
    : read_(std::move(read)),
      micro_(micro_batches),
      end_(end),
      depth_(size_t(std::max(1, depth))),
      next_take_(first),
      next_read_(first) {
  thread_ = std::thread([this] { loop(); });
}

BatchPrefetcher::~BatchPrefetcher() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  // The thread finishes the batch it is reading (a few milliseconds of memcpy) and exits.
  if (thread_.joinable()) thread_.join();
}

void BatchPrefetcher::loop() {
  // The ops here (a min, a max, a sum, a masked fill over one micro-batch of ids) are mostly
  // below ATen's grain size (32768 elements) and run on this thread alone; larger micro-batches
  // may use an intra-op team for a few microseconds. Not at::set_num_threads(1) to prevent it:
  // under OpenMP and MKL that setting is not this thread's alone.
  for (;;) {
    int64_t step;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || ready_.size() < depth_; });
      if (stop_ || next_read_ >= end_) return;
      step = next_read_;
    }
    std::vector<HostBatch> batches;
    std::exception_ptr error;
    try {
      for (int64_t k = 0; k < micro_; ++k) batches.push_back(host_batch(read_(step, k)));
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (error) {
        error_ = error;  // the steps after it are not read: take() of this step throws
        next_read_ = end_;
      } else {
        ready_.push_back(std::move(batches));
        ++next_read_;
      }
    }
    cv_.notify_all();
    if (error) return;
  }
}

std::vector<HostBatch> BatchPrefetcher::take(int64_t step) {
  if (step != next_take_ || step >= end_)
    throw std::logic_error("BatchPrefetcher::take: step " + std::to_string(step) + " requested, the next is " +
                           std::to_string(next_take_) + " of [.., " + std::to_string(end_) + ")");
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return !ready_.empty() || error_ != nullptr; });
  if (ready_.empty()) std::rethrow_exception(error_);
  std::vector<HostBatch> out = std::move(ready_.front());
  ready_.pop_front();
  ++next_take_;
  lk.unlock();
  cv_.notify_all();
  return out;
}

}  // namespace mfsdp
