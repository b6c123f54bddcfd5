// PyTorch's own profiler (Kineto, the engine behind torch.profiler) over a window of training
// steps, from C++: the `profiling` section of the YAML (DESIGN.md section 7, "Where a step goes").
//
// Why: a step's time is spread over the model's operators, mfsdp's phases and, on a GPU, kernels
// that run after the host moved on; the console's step time says nothing about where. torchtitan
// (`profiling.enable_profiling`) and Megatron (`--profile --use-pytorch-profiler`) record a few
// steps with torch.profiler; so does this, with the same library and the same trace format, so
// that the traces open where theirs do (https://ui.perfetto.dev, chrome://tracing).
//
// Each recording rank writes, under run_dir/profile, once its window ends:
//   rank<R>_steps<A>-<B>.txt   the summary: mfsdp's phases per step, operators by self host time,
//                              and on a GPU kernels by device time and how busy the device was;
//   rank<R>_steps<A>-<B>.json  the trace (profiling.trace), written whole or not at all.
// Torch's profiler headers stay in profiler.cpp; the trainer sees this class and Phase.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "config/config.h"  // ProfilingConfig
#include "util/phase.h"    // Phase: the ranges the summary's phase table counts

namespace mfsdp {

class StepProfiler {
 public:
  // Null when profiling is off or this rank does not record. `cuda`: also record the device's
  // kernels and copies (CUPTI through Kineto); `synchronize` waits for the device's queued work.
  static std::unique_ptr<StepProfiler> create(const ProfilingConfig& cfg, int rank, const std::string& run_dir,
                                              bool cuda, std::function<void()> synchronize);
  ~StepProfiler();

  // Around each training step (1-based). Recording starts before step start_step and stops after
  // end_step (the device synchronised first); end_step returns what to log then (the files
  // written), else "".
  void begin_step(int64_t step);
  std::string end_step(int64_t step);
  // At the end of training: a window that began but did not end (preemption) is written as it is,
  // a window that never began is reported. Returns the line to log, or "".
  std::string finish(int64_t last_step);

 private:
  StepProfiler(const ProfilingConfig& cfg, int rank, std::string dir, bool cuda, std::function<void()> synchronize)
      : cfg_(cfg), rank_(rank), dir_(std::move(dir)), cuda_(cuda), synchronize_(std::move(synchronize)) {}
  std::string stop_and_write(int64_t first, int64_t last);

  const ProfilingConfig cfg_;
  const int rank_;
  const std::string dir_;  // run_dir/profile
  const bool cuda_;
  const std::function<void()> synchronize_;
  bool recording_ = false, done_ = false;
  int64_t first_recorded_ = 0;
};

}  // namespace mfsdp
