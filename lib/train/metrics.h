// Per-step figures: metrics.jsonl (one JSON object per line), console lines or a progress bar,
// and `mfsdp plot` (loss curves as SVG).
#pragma once
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace mfsdp {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  double step_time_s = 0, tokens_per_s = 0, tflops_per_rank = 0, mfu = 0, peak_mem_mib = 0;
  int64_t consumed_samples = 0;
  // This rank's bytes (rank 0's in the file): weights, separate main weights, main gradients,
  // optimizer state, and the peak the FSDP engine held during the step.
  int64_t mem_weights = 0, mem_main_weights = 0, mem_grads = 0, mem_optimizer = 0, mem_fsdp_peak = 0;
  int64_t mem_gathered_peak = 0;  // strategy 3: the most gathered unit-weight bytes held in the step
  std::optional<double> val_loss;
  bool skipped = false;      // NaN/Inf gradients and the step was not applied
  int64_t skipped_total = 0;  // steps skipped so far in this run
  int64_t unit_gathers = 0;   // strategy 3: all-gathers of unit weights issued during the step
  double data_wait_s = 0;     // time the step waited for its batches (read by the prefetch thread)
  // GPU runs: the CUDA caching allocator's bytes now allocated / reserved, and the peak allocated
  // during the step (written only when on_device).
  bool on_device = false;
  int64_t device_allocated = 0, device_reserved = 0, device_peak = 0;
};

class MetricsWriter {
 public:
  // append: a resumed run continues the file; a fresh run starts it anew.
  MetricsWriter(const std::string& path, bool append);
  ~MetricsWriter();
  void write(const StepMetrics& m);

 private:
  FILE* f_ = nullptr;
  std::string path_;
};

std::string format_console_line(const StepMetrics& m, int64_t max_steps);

// Reads <run_dir>/metrics.jsonl and writes an SVG with the training and validation loss curves.
// Returns the number of points drawn.
int plot_metrics(const std::string& run_dir, const std::string& out_path);

}  // namespace mfsdp
