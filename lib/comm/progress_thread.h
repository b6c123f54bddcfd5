// The MPI communication thread. Open MPI's nonblocking collectives advance only while some thread
// is inside an MPI call, so "start it and compute" overlaps nothing on its own. One thread per
// process takes collectives in the order they were issued and starts each as a nonblocking MPI
// call at once, then polls every started one until it completes, while the main thread computes.
// So collectives progress concurrently -- the next unit's all-gather beside the previous unit's
// reduce-scatter, a TP all-reduce beside a data-parallel reduction -- instead of one queue behind
// the oldest. MPI's rule is kept: on each communicator, every rank starts its collectives in the
// same order (the order of issue); they may complete in any order. Polling backs off to short
// sleeps so that, on machines with as many ranks as cores, the poller does not steal the compute
// thread's core.
#pragma once
#include <mpi.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/communicator.h"

namespace mfsdp {

// A collective handed to the progress thread: either nonblocking MPI calls (`start` appends the
// requests it started; `finish(true)` runs once all completed, e.g. the division of an average,
// `finish(false)` after a failure, where it must not throw), or a function run to its end at its
// turn (`run`: the staged backend's wait for a device copy). A collective of several rounds (the
// MPI backend's ring reduce-scatter) gives `next`: called each time all requests of a round have
// completed, it reduces what arrived and starts the next round's requests, returning false once
// there is none (then `finish` runs).
class QueuedWork : public Work {
 public:
  using Start = std::function<void(std::vector<MPI_Request>&)>;
  using Next = std::function<bool(std::vector<MPI_Request>&)>;
  using Finish = std::function<void(bool ok)>;
  QueuedWork(const char* what, Start start, Finish finish, Next next = {})
      : what_(what), start_(std::move(start)), next_(std::move(next)), finish_(std::move(finish)) {}
  explicit QueuedWork(std::function<void()> run) : run_(std::move(run)) {}
  void wait() override;
  bool is_completed() override;

 private:
  friend class ProgressThread;
  void complete(std::exception_ptr err);  // on the progress thread
  const char* what_ = "";
  Start start_;
  Next next_;
  Finish finish_;
  std::function<void()> run_;
  std::vector<MPI_Request> requests_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// A Work that is complete when created (one-rank groups, empty tensors).
class CompletedWork : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

class ProgressThread {
 public:
  static ProgressThread& instance();
  // Joins the thread after finishing queued work; called before MPI_Finalize.
  static void shutdown();
  // Nonblocking MPI calls, started in submission order; `finish` runs after their completion.
  WorkHandle submit_mpi(const char* what, QueuedWork::Start start, QueuedWork::Finish finish = {},
                        QueuedWork::Next next = {});
  // A function run to its end at its turn (the works submitted before it are started, not waited for).
  WorkHandle submit(std::function<void()> run);
  ~ProgressThread();

 private:
  ProgressThread();
  void loop();
  // Tests every request of every started work once; completes the finished ones. True if any did.
  bool poll(std::vector<std::shared_ptr<QueuedWork>>& started);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<QueuedWork>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace mfsdp
