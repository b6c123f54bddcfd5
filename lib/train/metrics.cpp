#include "train/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include "util/error.h"

namespace mfsdp {

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  f_ = std::fopen(path.c_str(), append ? "a" : "w");
  if (!f_) throw UserError(path + ": cannot open for writing: " + std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (f_) std::fclose(f_);
}

namespace {
std::string num(double x) {
  if (!std::isfinite(x)) return "null";  // JSON has no NaN
  return fmt::format("{:.9g}", x);
}
}  // namespace

void MetricsWriter::write(const StepMetrics& m) {
  std::string line = fmt::format(
      "{{\"step\": {}, \"loss\": {}, \"lr\": {}, \"grad_norm\": {}, \"tokens_per_s\": {}, \"step_time_s\": {}, "
      "\"tflops_per_rank\": {}, \"mfu\": {}, \"peak_mem_mib\": {}, \"consumed_samples\": {}, "
      "\"mem_weights\": {}, \"mem_main_weights\": {}, \"mem_grads\": {}, \"mem_optimizer\": {}, \"mem_fsdp_peak\": {}",
      m.step, num(m.loss), num(m.lr), num(m.grad_norm), num(m.tokens_per_s), num(m.step_time_s),
      num(m.tflops_per_rank), num(m.mfu), num(m.peak_mem_mib), m.consumed_samples, m.mem_weights, m.mem_main_weights,
      m.mem_grads, m.mem_optimizer, m.mem_fsdp_peak);
  if (m.val_loss) line += fmt::format(", \"val_loss\": {}", num(*m.val_loss));
  line += fmt::format(", \"unit_gathers\": {}, \"skipped_total\": {}", m.unit_gathers, m.skipped_total);
  if (m.on_device)
    line += fmt::format(", \"device_mem_allocated\": {}, \"device_mem_reserved\": {}, \"device_mem_peak\": {}",
                        m.device_allocated, m.device_reserved, m.device_peak);
  if (m.skipped) line += ", \"skipped\": true";
  line += "}\n";
  if (std::fputs(line.c_str(), f_) < 0 || std::fflush(f_) != 0)
    throw UserError(path_ + ": write failed: " + std::strerror(errno));
}

std::string format_console_line(const StepMetrics& m, int64_t max_steps) {
  return fmt::format("step {:>6}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.3f} | {:.0f} tok/s | {:.3f} TFLOP/s/rank | "
                     "MFU {:.1f}% | {:.0f} ms/step | peak mem {:.0f} MiB{}",
                     m.step, max_steps, m.loss, m.lr, m.grad_norm, m.tokens_per_s, m.tflops_per_rank, 100 * m.mfu,
                     1000 * m.step_time_s, m.peak_mem_mib,
                     m.val_loss ? fmt::format(" | val loss {:.4f}", *m.val_loss) : std::string());
}

namespace {
// The number after "key": in a flat JSON object line, or NaN.
double field(const std::string& line, const std::string& key) {
  auto pos = line.find("\"" + key + "\":");
  if (pos == std::string::npos) return NAN;
  const char* p = line.c_str() + pos + key.size() + 3;
  char* end = nullptr;
  double v = std::strtod(p, &end);
  return end == p ? NAN : v;
}
}  // namespace

int plot_metrics(const std::string& run_dir, const std::string& out_path) {
  const std::string path = run_dir + "/metrics.jsonl";
  std::ifstream in(path);
  if (!in) throw UserError(path + ": cannot open (is " + run_dir + " a run directory?)");
  std::vector<std::pair<double, double>> train, valid;
  std::string line;
  while (std::getline(in, line)) {
    double s = field(line, "step"), l = field(line, "loss"), v = field(line, "val_loss");
    if (std::isfinite(s) && std::isfinite(l)) train.emplace_back(s, l);
    if (std::isfinite(s) && std::isfinite(v)) valid.emplace_back(s, v);
  }
  if (train.empty()) throw UserError(path + ": no steps with a loss to plot");
  double x0 = train.front().first, x1 = train.back().first, y0 = 1e300, y1 = -1e300;
  for (auto* series : {&train, &valid})
    for (auto& [x, y] : *series) {
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
      y0 = std::min(y0, y);
      y1 = std::max(y1, y);
    }
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + 1;
  const double W = 800, H = 480, L = 70, R = 20, T = 30, B = 50;
  auto sx = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto sy = [&](double y) { return T + (1 - (y - y0) / (y1 - y0)) * (H - T - B); };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"18\" font-size=\"14\">{} : loss</text>\n",
      W, H, L, run_dir);
  for (int i = 0; i <= 5; ++i) {
    double y = y0 + (y1 - y0) * i / 5, x = x0 + (x1 - x0) * i / 5;
    svg += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>"
                       "<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3f}</text>\n",
                       L, sy(y), W - R, sy(y), L - 6, sy(y) + 4, y);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:.0f}</text>\n", sx(x), H - B + 18, x);
  }
  svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n", (L + W - R) / 2, H - 12);
  auto polyline = [&](const std::vector<std::pair<double, double>>& s, const char* color, const char* label, int row) {
    if (s.empty()) return;
    std::string pts;
    for (auto& [x, y] : s) pts += fmt::format("{:.1f},{:.1f} ", sx(x), sy(y));
    svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n", color, pts);
    svg += fmt::format("<text x=\"{}\" y=\"{}\" fill=\"{}\">{}</text>\n", W - R - 120, T + 16 * row, color, label);
  };
  polyline(train, "#1f77b4", "train loss", 1);
  polyline(valid, "#d62728", "validation loss", 2);
  svg += "</svg>\n";
  std::string tmp = out_path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) throw UserError(tmp + ": cannot create: " + std::strerror(errno));
  bool ok = std::fputs(svg.c_str(), f) >= 0;
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), out_path.c_str()) != 0)
    throw UserError(out_path + ": cannot write: " + std::strerror(errno));
  return int(train.size() + valid.size());
}

}  // namespace mfsdp
