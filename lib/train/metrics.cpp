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
      "\"mem_weights\": {}, \"mem_main_weights\": {}, \"mem_grads\": {}, \"mem_optimizer\": {}, \"mem_fsdp_peak\": {}, "
      "\"mem_gathered_peak\": {}",
      m.step, num(m.loss), num(m.lr), num(m.grad_norm), num(m.tokens_per_s), num(m.step_time_s),
      num(m.tflops_per_rank), num(m.mfu), num(m.peak_mem_mib), m.consumed_samples, m.mem_weights, m.mem_main_weights,
      m.mem_grads, m.mem_optimizer, m.mem_fsdp_peak, m.mem_gathered_peak);
  if (m.val_loss) line += fmt::format(", \"val_loss\": {}", num(*m.val_loss));
  line += fmt::format(", \"unit_gathers\": {}, \"skipped_total\": {}, \"data_wait_s\": {}", m.unit_gathers,
                      m.skipped_total, num(m.data_wait_s));
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

// Round-number ticks for [lo, hi]: a step of 1, 2 or 5 x 10^k giving at most ~6 intervals, the
// range widened to whole steps. Labels carry as many decimals as the step needs.
struct Ticks {
  double lo, hi, step;
  std::string label(double v) const {
    if (std::abs(v) < step * 1e-6) v = 0;
    const double mag = std::max(std::abs(lo), std::abs(hi));
    if (mag >= 1e6 || (step < 1e-3 && mag < 1e-2)) return fmt::format("{:.3g}", v);
    const int decimals = std::max(0, int(-std::floor(std::log10(step) + 1e-9)));
    return fmt::format("{:.{}f}", v, decimals);
  }
};

Ticks nice_ticks(double lo, double hi) {
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1 : std::abs(lo) * 0.05;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / 6, p10 = std::pow(10.0, std::floor(std::log10(raw)));
  double step = p10;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p10 >= raw) {
      step = m * p10;
      break;
    }
  return {std::floor(lo / step) * step, std::ceil(hi / step) * step, step};
}

using Series = std::vector<std::pair<double, double>>;
}  // namespace

// Three panels over the same step axis: loss (train and validation), throughput (tokens/s), and
// the learning rate; gridlines and labels at round numbers.
int plot_metrics(const std::string& run_dir, const std::string& out_path) {
  const std::string path = run_dir + "/metrics.jsonl";
  std::ifstream in(path);
  if (!in) throw UserError(path + ": cannot open (is " + run_dir + " a run directory?)");
  Series train, valid, tps, lr;
  std::string line;
  while (std::getline(in, line)) {
    const double s = field(line, "step"), l = field(line, "loss"), v = field(line, "val_loss"),
                 t = field(line, "tokens_per_s"), r = field(line, "lr");
    if (!std::isfinite(s)) continue;
    if (std::isfinite(l)) train.emplace_back(s, l);
    if (std::isfinite(v)) valid.emplace_back(s, v);
    if (std::isfinite(t)) tps.emplace_back(s, t);
    if (std::isfinite(r)) lr.emplace_back(s, r);
  }
  if (train.empty()) throw UserError(path + ": no steps with a loss to plot");
  double x0 = train.front().first, x1 = train.back().first;
  for (const Series* series : {&train, &valid})
    for (auto& [x, y] : *series) {
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
    }
  const Ticks xt = nice_ticks(x0, x1);
  const double W = 800, L = 80, R = 20, top = 34, panel_h = 210, gap = 46;
  const double H = top + 3 * panel_h + 2 * gap + 44;
  auto sx = [&](double x) { return L + (x - xt.lo) / (xt.hi - xt.lo) * (W - L - R); };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{:.0f}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"20\" font-size=\"14\">{}</text>\n",
      W, H, L, run_dir);
  struct Line {
    const Series* s;
    const char* color;
    const char* label;
  };
  auto panel = [&](int index, const char* title, std::vector<Line> lines) {
    const double T = top + index * (panel_h + gap), B = T + panel_h;
    double y0 = 1e300, y1 = -1e300;
    for (const auto& l : lines)
      for (auto& [x, y] : *l.s) {
        y0 = std::min(y0, y);
        y1 = std::max(y1, y);
      }
    if (y0 > y1) {  // nothing recorded (older metrics files)
      svg += fmt::format("<text x=\"{}\" y=\"{:.0f}\">{}: no data</text>\n", L, T + 16, title);
      return;
    }
    const Ticks yt = nice_ticks(y0, y1);
    auto sy = [&](double y) { return T + (1 - (y - yt.lo) / (yt.hi - yt.lo)) * panel_h; };
    svg += fmt::format("<text x=\"{}\" y=\"{:.0f}\" font-weight=\"bold\">{}</text>\n", L, T - 8, title);
    for (double y = yt.lo; y <= yt.hi + yt.step * 1e-6; y += yt.step)
      svg += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>"
                         "<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n",
                         L, sy(y), W - R, sy(y), L - 6, sy(y) + 4, yt.label(y));
    for (double x = xt.lo; x <= xt.hi + xt.step * 1e-6; x += xt.step)
      svg += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.0f}\" x2=\"{:.1f}\" y2=\"{:.0f}\" stroke=\"#eee\"/>"
                         "<text x=\"{:.1f}\" y=\"{:.0f}\" text-anchor=\"middle\">{}</text>\n",
                         sx(x), T, sx(x), B, sx(x), B + 16, xt.label(x));
    int row = 1;
    for (const auto& l : lines) {
      if (l.s->empty()) continue;
      std::string pts;
      for (auto& [x, y] : *l.s) pts += fmt::format("{:.1f},{:.1f} ", sx(x), sy(y));
      svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n", l.color, pts);
      svg += fmt::format("<text x=\"{}\" y=\"{:.0f}\" fill=\"{}\">{}</text>\n", W - R - 130, T + 16 * row++, l.color,
                         l.label);
    }
  };
  panel(0, "loss", {{&train, "#1f77b4", "train loss"}, {&valid, "#d62728", "validation loss"}});
  panel(1, "throughput (tokens/s)", {{&tps, "#2ca02c", "tokens/s"}});
  panel(2, "learning rate", {{&lr, "#9467bd", "lr"}});
  svg += fmt::format("<text x=\"{}\" y=\"{:.0f}\" text-anchor=\"middle\">step</text>\n", (L + W - R) / 2, H - 8);
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
