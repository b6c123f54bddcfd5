#include "comm/progress_thread.h"

#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>

#include "util/phase.h"

namespace mfsdp {

void QueuedWork::complete(std::exception_ptr err) {
  if (finish_) {
    try {
      finish_(!err);
    } catch (...) {
      err = std::current_exception();
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  error_ = err;
  done_ = true;
  cv_.notify_all();
}

void QueuedWork::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  std::optional<Phase> waiting;  // the profile's exposed communication: only waits that block
  if (!done_) waiting.emplace("mfsdp::wait_collective");
  cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool QueuedWork::is_completed() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

namespace {
std::mutex g_instance_mu;
std::unique_ptr<ProgressThread> g_instance;
}  // namespace

ProgressThread& ProgressThread::instance() {
  std::lock_guard<std::mutex> lock(g_instance_mu);
  if (!g_instance) g_instance.reset(new ProgressThread());
  return *g_instance;
}

void ProgressThread::shutdown() {
  std::lock_guard<std::mutex> lock(g_instance_mu);
  g_instance.reset();
}

ProgressThread::ProgressThread() : thread_([this] { loop(); }) {}

ProgressThread::~ProgressThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

WorkHandle ProgressThread::submit_mpi(const char* what, QueuedWork::Start start, QueuedWork::Finish finish,
                                      QueuedWork::Next next) {
  auto work = std::make_shared<QueuedWork>(what, std::move(start), std::move(finish), std::move(next));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw std::runtime_error("communication thread is shut down");
    queue_.push_back(work);
  }
  cv_.notify_one();
  return work;
}

WorkHandle ProgressThread::submit(std::function<void()> run) {
  auto work = std::make_shared<QueuedWork>(std::move(run));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw std::runtime_error("communication thread is shut down");
    queue_.push_back(work);
  }
  cv_.notify_one();
  return work;
}

bool ProgressThread::poll(std::vector<std::shared_ptr<QueuedWork>>& started) {
  bool any = false;
  for (auto it = started.begin(); it != started.end();) {
    QueuedWork& w = **it;
    bool all = true;
    std::exception_ptr err;
    for (auto& req : w.requests_) {  // a completed request is MPI_REQUEST_NULL: done at once
      int done = 0;
      const int rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(rc, msg, &len);
        err = std::make_exception_ptr(std::runtime_error(std::string(w.what_) + " failed: " + std::string(msg, len)));
        break;
      }
      if (!done) {
        all = false;
        break;
      }
    }
    if (!err && !all) {
      ++it;
      continue;
    }
    if (!err && w.next_) {  // a round finished: start the next one, if any
      w.requests_.clear();
      bool more = false;
      try {
        more = w.next_(w.requests_);
      } catch (...) {
        err = std::current_exception();
      }
      any = true;
      if (!err && more) {
        ++it;
        continue;
      }
    }
    w.complete(err);
    it = started.erase(it);
    any = true;
  }
  return any;
}

void ProgressThread::loop() {
  std::vector<std::shared_ptr<QueuedWork>> started;  // MPI calls in flight, oldest first
  std::deque<std::shared_ptr<QueuedWork>> batch;
  int idle_polls = 0;
  auto sleep_us = std::chrono::microseconds(1);
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (started.empty()) cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty() && started.empty()) return;  // stop_ and drained
      batch.swap(queue_);
    }
    for (auto& w : batch) {
      if (w->run_) {
        std::exception_ptr err;
        try {
          w->run_();
        } catch (...) {
          err = std::current_exception();
        }
        w->complete(err);
        continue;
      }
      try {
        w->start_(w->requests_);
        started.push_back(w);
      } catch (...) {
        // Requests it started before failing are left to MPI: the error ends the job (the
        // watchdog and the error path abort it).
        w->complete(std::current_exception());
      }
    }
    const bool fresh = !batch.empty();
    batch.clear();
    if (poll(started) || fresh) {
      idle_polls = 0;
      sleep_us = std::chrono::microseconds(1);
      continue;
    }
    if (started.empty() || ++idle_polls < 64) continue;
    std::this_thread::sleep_for(sleep_us);
    if (sleep_us < std::chrono::microseconds(50)) sleep_us *= 2;
  }
}

}  // namespace mfsdp
