// The flight recorder: every collective this rank issues on a group of more than one rank, with a
// sequence number per group, and a watchdog thread that notices a collective which has not finished
// within distributed.timeout_s. It then writes <run_dir>/flight/rank_K.json (the last collectives:
// op, group and members, elements, dtype, start and end, step, what it was for) and ends the job,
// so that a dead peer or a mismatched collective never hangs a job for hours. `mfsdp diagnose`
// reads the records of all ranks and says which rank diverged and where.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mfsdp {

class FlightRecorder;

// Tags the collectives begun while it lives (what the job was doing, if it hangs there).
class FlightTag {
 public:
  explicit FlightTag(const std::string& tag);
  ~FlightTag();
  FlightTag(const FlightTag&) = delete;
  FlightTag& operator=(const FlightTag&) = delete;
};

class FlightRecorder {
 public:
  static FlightRecorder& instance();
  // Returns a handle for end(). `tag` says what the collective is for (a unit, a bucket).
  uint64_t begin(const std::string& op, const std::string& group, const std::vector<int>& members, uint64_t seq,
                 int64_t numel, const std::string& dtype);
  void end(uint64_t handle);
  // For collectives that finish on a device (NCCL): the watchdog thread polls `done` and ends the
  // record when it returns true; if the collective hangs past the timeout it calls `abort` (for
  // example ncclCommAbort, so that the device work fails instead of spinning) before ending the job.
  // Both run on the watchdog thread and must be thread-safe.
  void watch(uint64_t handle, std::function<bool()> done, std::function<void()> abort);
  void set_step(int64_t step);
  // Every rank's host name, so that a hung collective's message says where its peers are.
  void set_hosts(std::vector<std::string> hosts);
  void set_tag(const std::string& tag);  // applies to collectives begun afterwards on this process
  // Starts the watchdog (once). rank, run_dir: where records go.
  void start_watchdog(double timeout_s, const std::string& run_dir, int rank, int world);
  void stop_watchdog();
  // Writes the record file now; returns its path.
  std::string dump(const std::string& reason);

 private:
  FlightRecorder() = default;
  struct Impl;
  Impl* impl();
};

// `mfsdp diagnose RUN_DIR`: reads every rank's flight record and explains the divergence. Returns
// the report (empty records directory: an error).
std::string diagnose_flight_records(const std::string& run_dir);

}  // namespace mfsdp
