// The training batches read by a thread of their own, ahead of the step that needs them
// (DESIGN.md section 7, step 1): while the main thread runs a step's forward, backward and optimizer, this
// thread cuts the next steps' windows out of the mapped token files, builds their targets, loss
// masks and position ids, and counts their tokens. The main thread only takes finished batches
// (and, on a GPU, queues their copies); a data error is rethrown by take() at the step it
// belongs to, as if the main thread had read the batch itself.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "data/gpt_dataset.h"

namespace mfsdp {

// One micro-batch as read on the host, with what the step needs to know of it before the forward.
struct HostBatch {
  Batch batch;
  double tokens = 0;      // tokens that count in the loss (loss_mask's sum)
  int64_t max_token = 0;  // the largest id among tokens and targets (checked against the vocabulary)
};

// A host batch with its token count and largest id.
HostBatch host_batch(Batch b);

// Reads micro-batch `micro` of step `step`. The thread calls it in the order the main thread
// would have (steps ascending, micro-batches ascending), so a sampler with walk state
// (BlendedSamples) sees the same requests. For DataPipeline::train_batch: the main thread must not
// call train_batch while a prefetcher reads (valid_batch reads other samplers and stays on the
// main thread).
using BatchReader = std::function<Batch(int64_t step, int64_t micro)>;

class BatchPrefetcher {
 public:
  // Steps [first, end) with `micro_batches` micro-batches each, at most `depth` steps ahead of
  // the consumer. The thread starts at once.
  BatchPrefetcher(BatchReader read, int64_t micro_batches, int64_t first, int64_t end, int depth = 2);
  ~BatchPrefetcher();
  BatchPrefetcher(const BatchPrefetcher&) = delete;
  BatchPrefetcher& operator=(const BatchPrefetcher&) = delete;

  // The micro-batches of `step`, which must be the next step in [first, end): blocks until the
  // thread has read them and rethrows the error it met reading them.
  std::vector<HostBatch> take(int64_t step);

 private:
  void loop();

  BatchReader read_;
  const int64_t micro_, end_;
  const size_t depth_;
  int64_t next_take_;  // the step take() hands out next
  int64_t next_read_;  // the step the thread reads next
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::vector<HostBatch>> ready_;  // steps [next_take_, next_take_ + ready_.size())
  std::exception_ptr error_;                  // the error of step next_take_ + ready_.size()
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace mfsdp
