#include "comm/progress_thread.h"

#include <chrono>
#include <stdexcept>
#include <string>

namespace mfsdp {

void QueuedWork::execute() {
  std::exception_ptr err;
  try {
    run_();
  } catch (...) {
    err = std::current_exception();
  }
  std::lock_guard<std::mutex> lock(mu_);
  error_ = err;
  done_ = true;
  cv_.notify_all();
}

void QueuedWork::wait() {
  std::unique_lock<std::mutex> lock(mu_);
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

void ProgressThread::loop() {
  while (true) {
    std::shared_ptr<QueuedWork> work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      work = queue_.front();
      queue_.pop_front();
    }
    work->execute();
  }
}

void wait_mpi_request(MPI_Request& req, const char* what) {
  int done = 0;
  int polls = 0;
  auto sleep_us = std::chrono::microseconds(1);
  while (true) {
    int rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      char msg[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(rc, msg, &len);
      throw std::runtime_error(std::string(what) + " failed: " + std::string(msg, len));
    }
    if (done) return;
    if (++polls < 64) continue;
    std::this_thread::sleep_for(sleep_us);
    if (sleep_us < std::chrono::microseconds(50)) sleep_us *= 2;
  }
}

}  // namespace mfsdp
