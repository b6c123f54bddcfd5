// The MPI communication thread. Open MPI's nonblocking collectives advance only while some thread
// is inside an MPI call, so "start it and compute" overlaps nothing on its own. One thread per
// process takes collectives in the order they were issued, starts each as a nonblocking MPI call
// and polls it to completion while the main thread computes. Polling backs off to short sleeps so
// that, on machines with as many ranks as cores, the poller does not steal the compute thread's core.
#pragma once
#include <mpi.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "comm/communicator.h"

namespace mfsdp {

// A collective handed to the progress thread.
class QueuedWork : public Work {
 public:
  explicit QueuedWork(std::function<void()> run) : run_(std::move(run)) {}
  void wait() override;
  bool is_completed() override;

 private:
  friend class ProgressThread;
  void execute();  // on the progress thread
  std::function<void()> run_;
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
  WorkHandle submit(std::function<void()> run);
  ~ProgressThread();

 private:
  ProgressThread();
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<QueuedWork>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

// Polls `req` until it completes, spinning briefly and then sleeping in growing steps (<= 50 us).
// Throws with `what` on an MPI error.
void wait_mpi_request(MPI_Request& req, const char* what);

}  // namespace mfsdp
