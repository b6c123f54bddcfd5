// profiler.h: a window of steps under PyTorch's Kineto profiler, summarised in a table and saved
// as a trace.
#include "train/profiler.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <kineto/ActivityType.h>  // libkineto's activity kinds: host op, user range, kernel, copy...

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <unordered_map>
#include <vector>

#include "config/config.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {

namespace prof = torch::profiler::impl;
using torch::autograd::profiler::KinetoEvent;
using Kind = libkineto::ActivityType;

namespace {

prof::ProfilerConfig kineto_config(const ProfilingConfig& c) {
  return prof::ProfilerConfig(prof::ProfilerState::KINETO, /*report_input_shapes=*/c.record_shapes);
}

std::set<prof::ActivityType> activities(bool cuda) {
  std::set<prof::ActivityType> a{prof::ActivityType::CPU};
  if (cuda) a.insert(prof::ActivityType::CUDA);
  return a;
}

bool on_device(Kind k) {
  return k == Kind::CONCURRENT_KERNEL || k == Kind::GPU_MEMCPY || k == Kind::GPU_MEMSET;
}
// Host ranges that nest: operators and mfsdp's phases. CUDA runtime and driver calls come from
// CUPTI with the OS thread id, not RecordFunction's, so they cannot be placed inside the operator
// that made them: they are summed apart (the device section).
bool on_host(Kind k) { return k == Kind::CPU_OP || k == Kind::USER_ANNOTATION; }
bool cuda_call(Kind k) { return k == Kind::CUDA_RUNTIME || k == Kind::CUDA_DRIVER; }
// mfsdp's phases are user ranges (Phase); its operators (mfsdp::linear...) are host ops like ATen's.
bool is_phase(const KinetoEvent& e) { return Kind(e.activityType()) == Kind::USER_ANNOTATION; }

struct Row {
  int64_t calls = 0;
  uint64_t total_ns = 0, self_ns = 0;
};
struct HostRows {
  std::map<std::string, Row> phases, ops;
  uint64_t outside_ns = 0;  // self time of host ranges that began outside every step
};

// The steps' own ranges (mfsdp::step), by start: what the tables count. Work between steps of a
// window of several (evaluation, checkpoints, logging) is one line of its own.
std::vector<std::pair<uint64_t, uint64_t>> step_ranges(const std::vector<KinetoEvent>& events) {
  std::vector<std::pair<uint64_t, uint64_t>> r;
  for (const auto& e : events)
    if (is_phase(e) && e.name() == "mfsdp::step") r.emplace_back(e.startNs(), e.endNs());
  std::sort(r.begin(), r.end());
  return r;
}
bool in_steps(const std::vector<std::pair<uint64_t, uint64_t>>& steps, uint64_t t) {
  auto it = std::upper_bound(steps.begin(), steps.end(), std::make_pair(t, UINT64_MAX));
  return it != steps.begin() && t <= std::prev(it)->second;
}

std::string ms(uint64_t ns) { return fmt::format("{:.3f}", double(ns) / 1e6); }
std::string pct(uint64_t part, uint64_t whole) {
  return whole ? fmt::format("{:.1f}%", 100.0 * double(part) / double(whole)) : std::string("-");
}
std::string cell(std::string s) {  // a table cell: one line, no pipes, kernel names cut
  for (char& c : s)
    if (c == '|' || c == '\n') c = ' ';
  return s.size() > 110 ? s.substr(0, 107) + "..." : s;
}

// Self time of host events: on each thread, a range's time minus that of the ranges directly
// inside it (ranges nest: RecordFunction opens and closes them as a stack per thread).
struct HostEvent {
  const KinetoEvent* e;
  uint64_t start, end, children = 0;
};
HostRows host_rows(const std::vector<KinetoEvent>& events, const std::vector<std::pair<uint64_t, uint64_t>>& steps) {
  std::unordered_map<uint64_t, std::vector<HostEvent>> by_thread;
  for (const auto& e : events)
    if (on_host(Kind(e.activityType())) && e.endNs() >= e.startNs())
      by_thread[e.startThreadId()].push_back({&e, e.startNs(), e.endNs()});
  HostRows rows;
  for (auto& [tid, list] : by_thread) {
    std::sort(list.begin(), list.end(), [](const HostEvent& a, const HostEvent& b) {
      return a.start != b.start ? a.start < b.start : a.end > b.end;  // a parent before its first child
    });
    std::vector<HostEvent*> open;
    for (auto& h : list) {
      while (!open.empty() && open.back()->end <= h.start) open.pop_back();
      if (!open.empty()) open.back()->children += h.end - h.start;
      open.push_back(&h);
    }
    for (const auto& h : list) {
      const uint64_t self = (h.end - h.start) - std::min(h.children, h.end - h.start);
      if (!in_steps(steps, h.start)) {
        rows.outside_ns += self;
        continue;
      }
      Row& r = (is_phase(*h.e) ? rows.phases : rows.ops)[h.e->name()];
      ++r.calls;
      r.total_ns += h.end - h.start;
      r.self_ns += self;
    }
  }
  return rows;
}

// Time covered by at least one of the intervals (kernels of several streams overlap).
uint64_t covered(std::vector<std::pair<uint64_t, uint64_t>> iv) {
  std::sort(iv.begin(), iv.end());
  uint64_t total = 0, lo = 0, hi = 0;
  bool any = false;
  for (auto [a, b] : iv) {
    if (!any || a > hi) {
      if (any) total += hi - lo;
      lo = a, hi = b, any = true;
    } else {
      hi = std::max(hi, b);
    }
  }
  return any ? total + (hi - lo) : 0;
}

std::string summary(const std::vector<KinetoEvent>& events, int rank, int64_t first, int64_t last, bool cuda,
                    int64_t top) {
  const int64_t steps = last - first + 1;
  const std::vector<std::pair<uint64_t, uint64_t>> steps_at = step_ranges(events);
  const HostRows host = host_rows(events, steps_at);
  // The window: from the first step's start to the last step's end.
  uint64_t w0 = 0, w1 = 0, step_ns = 0;
  for (const auto& [a, b] : steps_at) step_ns += b - a;
  if (!steps_at.empty()) w0 = steps_at.front().first, w1 = steps_at.back().second;

  std::string out = fmt::format("# mfsdp profile: rank {}, steps {}-{} ({} step{})\n\n", rank, first, last, steps,
                                steps == 1 ? "" : "s");
  out += fmt::format("Steps took {} ms in all, {} ms per step (host clock, mfsdp::step ranges). Self time: a range's "
                     "time minus that of the ranges inside it, on its thread. The tables count what began inside "
                     "the steps; between them (evaluation, checkpoints, logging): {} ms.\n\n",
                     ms(step_ns), ms(step_ns / uint64_t(steps)), ms(host.outside_ns));

  out += "## mfsdp's phases\n\n| phase | calls | ms per step | % of the steps | self ms per step |\n|---|---:|---:|---:|---:|\n";
  std::vector<std::pair<std::string, Row>> phases(host.phases.begin(), host.phases.end()),
      ops(host.ops.begin(), host.ops.end());
  std::sort(phases.begin(), phases.end(), [](auto& a, auto& b) { return a.second.total_ns > b.second.total_ns; });
  for (const auto& [name, r] : phases)
    out += fmt::format("| {} | {} | {} | {} | {} |\n", name, r.calls, ms(r.total_ns / uint64_t(steps)),
                       pct(r.total_ns, step_ns), ms(r.self_ns / uint64_t(steps)));

  uint64_t op_self = 0;
  for (const auto& [name, r] : ops) op_self += r.self_ns;
  std::sort(ops.begin(), ops.end(), [](auto& a, auto& b) { return a.second.self_ns > b.second.self_ns; });
  out += fmt::format("\n## Operators by self host time (top {} of {}; all of them: {} ms per step, {} of the steps)\n\n",
                     std::min<int64_t>(top, int64_t(ops.size())), ops.size(), ms(op_self / uint64_t(steps)),
                     pct(op_self, step_ns));
  out += "| operator | calls | self ms per step | self % of the steps | total ms per step |\n|---|---:|---:|---:|---:|\n";
  for (size_t i = 0; i < ops.size() && int64_t(i) < top; ++i) {
    const auto& [name, r] = ops[i];
    out += fmt::format("| {} | {} | {} | {} | {} |\n", cell(name), r.calls, ms(r.self_ns / uint64_t(steps)),
                       pct(r.self_ns, step_ns), ms(r.total_ns / uint64_t(steps)));
  }

  if (cuda) {
    std::map<std::string, Row> dev, calls;
    std::vector<std::pair<uint64_t, uint64_t>> busy;
    uint64_t dev_end = w1;
    for (const auto& e : events) {
      if (cuda_call(Kind(e.activityType()))) {
        Row& r = calls[e.name()];
        ++r.calls;
        r.total_ns += e.durationNs();
      }
      if (!on_device(Kind(e.activityType()))) continue;
      Row& r = dev[e.name()];
      ++r.calls;
      r.total_ns += e.durationNs();
      busy.emplace_back(e.startNs(), e.endNs());
      dev_end = std::max(dev_end, e.endNs());
    }
    // The device may finish the last step's kernels after the host's range closed: the window runs
    // to whichever ends later.
    const uint64_t window = dev_end > w0 ? dev_end - w0 : 0, busy_ns = covered(busy);
    uint64_t kernels_ns = 0;
    for (const auto& [name, r] : dev) kernels_ns += r.total_ns;
    out += fmt::format("\n## Device\n\nBusy {} ms of {} ms ({}): the time at least one kernel or copy ran, from the first "
                       "step's start to the end of the last step's work. Idle time is time the host did not keep "
                       "the device fed (launches, synchronisation, host-side work between kernels).\n\n",
                       ms(busy_ns), ms(window), pct(busy_ns, window));
    std::vector<std::pair<std::string, Row>> c(calls.begin(), calls.end());
    std::sort(c.begin(), c.end(), [](auto& a, auto& b) { return a.second.total_ns > b.second.total_ns; });
    out += "CUDA runtime and driver calls on the host (inside the operators above, which launched them):";
    for (size_t i = 0; i < c.size() && i < 5; ++i)
      out += fmt::format(" {} {} x, {} ms per step;", c[i].first, c[i].second.calls / steps, ms(c[i].second.total_ns / uint64_t(steps)));
    out += c.empty() ? " none recorded.\n\n" : "\n\n";
    if (dev.empty())
      out += "No kernel or copy was recorded: Kineto had no CUPTI activity from this GPU (is libcupti, of the "
             "CUDA the torch wheel was built with, on the library path?).\n";
    std::vector<std::pair<std::string, Row>> k(dev.begin(), dev.end());
    std::sort(k.begin(), k.end(), [](auto& a, auto& b) { return a.second.total_ns > b.second.total_ns; });
    out += fmt::format("### Kernels and copies by device time (top {} of {}; {} ms per step in all)\n\n",
                       std::min<int64_t>(top, int64_t(k.size())), k.size(), ms(kernels_ns / uint64_t(steps)));
    out += "| kernel | calls | ms per step | % of the device time |\n|---|---:|---:|---:|\n";
    for (size_t i = 0; i < k.size() && int64_t(i) < top; ++i)
      out += fmt::format("| {} | {} | {} | {} |\n", cell(k[i].first), k[i].second.calls,
                         ms(k[i].second.total_ns / uint64_t(steps)), pct(k[i].second.total_ns, kernels_ns));
  }
  return out;
}

}  // namespace

std::unique_ptr<StepProfiler> StepProfiler::create(const ProfilingConfig& cfg, int rank, const std::string& run_dir,
                                                   bool cuda, std::function<void()> synchronize) {
  if (!cfg.enabled) return nullptr;
  if (!cfg.ranks.empty() && std::find(cfg.ranks.begin(), cfg.ranks.end(), int64_t(rank)) == cfg.ranks.end())
    return nullptr;
  return std::unique_ptr<StepProfiler>(new StepProfiler(cfg, rank, run_dir + "/profile", cuda, std::move(synchronize)));
}

StepProfiler::~StepProfiler() {
  if (recording_) {  // an error unwound the trainer mid-window: stop recording, write nothing
    try {
      torch::autograd::profiler::disableProfiler();
    } catch (...) {
    }
  }
}

void StepProfiler::begin_step(int64_t step) {
  if (recording_ || done_ || step < cfg_.start_step || step > cfg_.end_step) return;
  // A CUDA build of LibTorch makes Kineto ask for GPUs even when only the CPU is recorded; on a
  // node without a driver that prints "ERROR: gpuGetDeviceCount failed", which is not one. On CPU
  // runs Kineto's own messages stay quiet unless the user set KINETO_LOG_LEVEL.
  if (!cuda_) setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  // Kineto's set-up (CUPTI's on a GPU) happens in prepare, outside the recorded steps' ranges.
  torch::autograd::profiler::prepareProfiler(kineto_config(cfg_), activities(cuda_));
  torch::autograd::profiler::enableProfiler(kineto_config(cfg_), activities(cuda_));
  recording_ = true;
  first_recorded_ = step;
}

std::string StepProfiler::end_step(int64_t step) {
  if (!recording_ || step < cfg_.end_step) return "";
  return stop_and_write(first_recorded_, step);
}

std::string StepProfiler::finish(int64_t last_step) {
  if (recording_) return stop_and_write(first_recorded_, last_step) + " (the run ended inside the window)";
  if (done_) return "";
  return fmt::format("profiling: rank {} recorded nothing: steps {}-{} were not run (this run: up to step {})", rank_,
                     cfg_.start_step, cfg_.end_step, last_step);
}

std::string StepProfiler::stop_and_write(int64_t first, int64_t last) {
  if (synchronize_) synchronize_();  // the window's kernels end before CUPTI's buffers are read
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result = torch::autograd::profiler::disableProfiler();
  recording_ = false;
  done_ = true;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw UserError(dir_ + ": cannot create the profile directory: " + ec.message());
  const std::string base = fmt::format("{}/rank{}_steps{}-{}", dir_, rank_, first, last);
  write_file_atomically(base + ".txt", summary(result->events(), rank_, first, last, cuda_, cfg_.top));
  std::string line = fmt::format("profile of steps {}-{} (rank {}): {}.txt", first, last, rank_, base);
  if (cfg_.trace) {
    const std::string tmp = base + ".json.tmp";
    result->save(tmp);  // Kineto's Chrome trace JSON
    if (std::rename(tmp.c_str(), (base + ".json").c_str()) != 0) {
      std::remove(tmp.c_str());
      throw UserError(base + ".json: cannot write the trace: " + std::strerror(errno));
    }
    line += fmt::format(", trace {}.json (https://ui.perfetto.dev or chrome://tracing)", base);
  }
  return line;
}

}  // namespace mfsdp
