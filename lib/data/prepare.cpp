// prepare-data: inputs -> records -> worker threads (parse, validate, tokenize) -> ordered writer.
//
// The reader (this thread) cuts the inputs into chunks of records (a file, a line, a JSON line)
// and numbers them; workers tokenize whole chunks; the writer appends chunk k only after chunk
// k-1, so the datasets are byte-identical for any --workers. At most 2 chunks per worker are in
// flight, which bounds memory whatever the input size. A bad record (invalid JSON or UTF-8, a
// missing key) stops the run with its file and line, or is skipped and counted (--skip-bad);
// outputs are written under temporary names and renamed only when everything succeeded.
#include "data/prepare.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "data/text_input.h"
#include "data/token_source.h"
#include "tokenizer/text.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {

namespace {

using Clock = std::chrono::steady_clock;

bool jsonl_name(std::string p) {
  for (const char* c : {".gz", ".zst", ".zstd"})
    if (ends_with(p, c)) p.resize(p.size() - std::char_traits<char>::length(c));
  return ends_with(p, ".jsonl") || ends_with(p, ".json") || ends_with(p, ".ndjson");
}

enum class Mode { File, Lines, Jsonl };

struct Chunk {
  int input = 0;
  std::vector<std::string> records;
  std::vector<int64_t> lines;  // line number of each record (file mode: 1)
  uint64_t bytes = 0;
};

struct KeyOut {
  std::vector<int32_t> tokens;
  std::vector<uint32_t> lengths;
};

struct Result {
  std::vector<KeyOut> keys;
  int64_t skipped = 0;
  std::string error;                  // the first bad record when not skipping
  std::vector<std::string> warnings;  // the first few skipped records
  uint64_t bytes = 0;
  int64_t records = 0;
};

// Line and column (1-based, in bytes) of offset `off` in `s`, counted from line `first_line`.
std::pair<int64_t, int64_t> line_col(const std::string& s, size_t off, int64_t first_line) {
  int64_t line = first_line;
  size_t last_nl = std::string::npos;
  for (size_t i = 0; i < off; ++i)
    if (s[i] == '\n') {
      ++line;
      last_nl = i;
    }
  return {line, int64_t(off - (last_nl == std::string::npos ? 0 : last_nl + 1)) + 1};
}

class Job {
 public:
  Job(const PrepareOptions& o, Mode mode, const Tokenizer& tok, std::vector<std::string> keys, bool eod)
      : o_(o), mode_(mode), tok_(tok), keys_(std::move(keys)), eod_(eod ? tok.info().eod : -1) {}

  // Tokenizes one chunk; called on worker threads, one session each.
  Result run(const Chunk& c, TokenizerSession& sess) const {
    Result r;
    r.keys.resize(keys_.size());
    std::vector<int32_t> ids;
    const std::string& file = o_.inputs[c.input];
    for (size_t i = 0; i < c.records.size(); ++i) {
      const std::string& rec = c.records[i];
      r.bytes += rec.size();
      ++r.records;
      std::string bad;
      try {
        if (mode_ == Mode::Jsonl) {
          nlohmann::json j;
          try {
            j = nlohmann::json::parse(rec);
          } catch (const nlohmann::json::exception& e) {  // syntax, or a number out of range ("1e99999")
            // nlohmann says "at line 1, column N"; the line is the file's.
            std::string msg = e.what();
            size_t p = msg.find("] ");
            bad = "invalid JSON: " + (p == std::string::npos ? msg : msg.substr(p + 2));
          }
          if (bad.empty() && !j.is_object()) bad = "expected a JSON object, got " + std::string(j.type_name());
          for (size_t k = 0; bad.empty() && k < keys_.size(); ++k) {
            auto it = j.find(keys_[k]);
            if (it == j.end()) bad = "no key \"" + keys_[k] + "\"";
            else if (!it->is_string()) bad = "key \"" + keys_[k] + "\" is a " + it->type_name() + ", expected a string";
          }
          if (bad.empty()) {
            for (size_t k = 0; k < keys_.size(); ++k) add(j[keys_[k]].get_ref<const std::string&>(), sess, ids, r.keys[k]);
          }
        } else {
          if (tok_.needs_utf8()) {
            size_t at = text::invalid_utf8_at(rec);
            if (at != std::string::npos) {
              auto [line, col] = line_col(rec, at, c.lines[i]);
              bad = fmt::format("invalid UTF-8 (byte 0x{:02X} at column {})", static_cast<unsigned char>(rec[at]), col);
              if (mode_ == Mode::File) {
                record_bad(r, fmt::format("{}:{}: {}", file, line, bad));
                if (!r.error.empty()) return r;
                continue;
              }
            }
          }
          if (bad.empty()) add(rec, sess, ids, r.keys[0]);
        }
      } catch (const UserError& e) {
        bad = e.what();
      }
      if (!bad.empty()) {
        record_bad(r, fmt::format("{}:{}: {}", file, c.lines[i], bad));
        if (!r.error.empty()) return r;
      }
    }
    return r;
  }

 private:
  const PrepareOptions& o_;
  Mode mode_;
  const Tokenizer& tok_;
  std::vector<std::string> keys_;
  int64_t eod_;

  void record_bad(Result& r, const std::string& msg) const {
    if (!o_.skip_bad) {
      if (r.error.empty()) r.error = msg;
      return;
    }
    ++r.skipped;
    if (r.warnings.size() < 5) r.warnings.push_back(msg);
  }

  void add(const std::string& text, TokenizerSession& sess, std::vector<int32_t>& ids, KeyOut& out) const {
    ids.clear();
    sess.encode(text, ids);
    if (ids.empty()) return;  // an empty document is not written (as Megatron's preprocess_data.py)
    if (eod_ >= 0) ids.push_back(static_cast<int32_t>(eod_));
    out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
    out.lengths.push_back(static_cast<uint32_t>(ids.size()));
  }
};

// Worker threads over numbered chunks; results are taken in number order.
class Pool {
 public:
  Pool(const Job& job, const Tokenizer& tok, int n) : job_(job) {
    // Sessions are made here, so that a tokenizer error surfaces on this thread.
    for (int i = 0; i < n; ++i) sessions_.push_back(tok.session());
    for (int i = 0; i < n; ++i) threads_.emplace_back([this, i] { loop(*sessions_[i]); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void submit(Chunk c) {
    std::lock_guard<std::mutex> g(mu_);
    todo_.emplace_back(next_in_++, std::move(c));
    cv_.notify_one();
  }
  size_t in_flight() const { return next_in_ - next_out_; }
  Result take() {
    std::unique_lock<std::mutex> g(mu_);
    done_cv_.wait(g, [&] { return done_.count(next_out_) > 0; });
    Result r = std::move(done_[next_out_]);
    done_.erase(next_out_++);
    return r;
  }

 private:
  const Job& job_;
  std::vector<std::unique_ptr<TokenizerSession>> sessions_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::pair<size_t, Chunk>> todo_;
  std::map<size_t, Result> done_;
  size_t next_in_ = 0, next_out_ = 0;
  bool stop_ = false;

  void loop(TokenizerSession& sess) {
    while (true) {
      std::pair<size_t, Chunk> item;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return stop_ || !todo_.empty(); });
        if (stop_) return;
        item = std::move(todo_.front());
        todo_.pop_front();
      }
      Result r;
      try {
        r = job_.run(item.second, sess);
      } catch (const std::exception& e) {
        r.error = e.what();
      }
      {
        std::lock_guard<std::mutex> g(mu_);
        done_.emplace(item.first, std::move(r));
      }
      done_cv_.notify_all();
    }
  }
};

class Progress {
 public:
  Progress(int mode, uint64_t total) : total_(total), start_(Clock::now()), last_(start_) {
    tty_ = ::isatty(2) != 0;
    on_ = mode == 1 || (mode == -1 && tty_);
  }
  void update(int64_t docs, uint64_t bytes, uint64_t raw, bool final = false) {
    if (!on_) return;
    auto now = Clock::now();
    double since = std::chrono::duration<double>(now - last_).count();
    if (!final && since < (tty_ ? 0.25 : 10.0)) return;
    last_ = now;
    double t = std::max(1e-9, std::chrono::duration<double>(now - start_).count());
    std::string bar;
    if (total_ > 0) {
      double f = std::min(1.0, double(raw) / double(total_));
      int w = 24, k = int(f * w + 0.5);
      bar = fmt::format(" [{}{}] {:3.0f}%", std::string(k, '='), std::string(w - k, ' '), 100 * f);
    }
    std::fprintf(stderr, "%sprepare-data: %lld documents (%.0f/s), %.1f MB (%.2f MB/s)%s%s", tty_ ? "\r" : "",
                 (long long)docs, docs / t, bytes / 1e6, bytes / 1e6 / t, bar.c_str(), tty_ && !final ? "" : "\n");
    std::fflush(stderr);
  }

 private:
  uint64_t total_;
  Clock::time_point start_, last_;
  bool tty_ = false, on_ = false;
};

}  // namespace

PrepareResult prepare_data(const PrepareOptions& o) {
  if (o.inputs.empty()) throw UserError("prepare-data: give at least one --input file");
  if (o.output_prefix.empty()) throw UserError("prepare-data: give --output PREFIX");
  if (o.workers < 1 || o.workers > 256) throw UserError("prepare-data --workers " + std::to_string(o.workers) + ": expected 1..256");
  const auto t0 = Clock::now();

  // Text or JSONL: --json-keys, or every input named *.jsonl / *.json (compressed or not).
  int jsonl_named = 0;
  for (const auto& in : o.inputs) jsonl_named += jsonl_name(in);
  Mode mode = o.split_lines ? Mode::Lines : Mode::File;
  std::vector<std::string> keys{""};
  if (!o.json_keys.empty() || (jsonl_named == int(o.inputs.size()))) {
    if (o.split_lines) throw UserError("prepare-data: --split-lines is for text inputs; JSONL has one document per line already");
    mode = Mode::Jsonl;
    keys = o.json_keys.empty() ? std::vector<std::string>{"text"} : o.json_keys;
  } else if (jsonl_named > 0) {
    throw UserError("prepare-data: some inputs are JSONL by name and some are not; give --json-keys to read all as JSONL, "
                    "or prepare them separately");
  }

  std::unique_ptr<Tokenizer> tok = load_tokenizer(o.tokenizer, o.tokenizer_options);
  const TokenizerInfo& info = tok->info();
  const bool eod = o.append_eod == -1 ? info.kind == "byte" : o.append_eod == 1;
  if (eod && info.eod < 0)
    throw UserError("prepare-data --append-eod: " + info.describe + " names no end-of-document token; give --eod-token");

  // Megatron's rule: uint16 tokens when the vocabulary fits, else int32.
  const int dtype = info.vocab_size < 65500 ? 8 : 4;
  std::vector<std::unique_ptr<IndexedDatasetWriter>> writers;
  PrepareResult res;
  res.tokenizer = info;
  res.dtype = dtype == 8 ? "uint16" : "int32";
  for (const auto& k : keys) {
    PrepareOutput out;
    out.key = k;
    out.prefix = mode == Mode::Jsonl ? o.output_prefix + "_" + k + "_document" : o.output_prefix;
    writers.push_back(std::make_unique<IndexedDatasetWriter>(out.prefix, dtype));
    res.outputs.push_back(out);
  }

  uint64_t total_raw = 0;
  for (const auto& in : o.inputs) {
    if (in == "-") continue;
    std::ifstream f(in, std::ios::binary | std::ios::ate);
    if (f) total_raw += static_cast<uint64_t>(f.tellg());
  }
  Progress progress(o.progress, total_raw);
  Job job(o, mode, *tok, keys, eod);
  Pool pool(job, *tok, o.workers);
  const size_t max_in_flight = 2 * size_t(o.workers) + 1;
  uint64_t raw_done = 0;
  std::vector<std::string> warnings;

  auto write_one = [&] {
    Result r = pool.take();
    if (!r.error.empty()) throw UserError(r.error);
    for (size_t k = 0; k < keys.size(); ++k) {
      const int32_t* p = r.keys[k].tokens.data();
      for (uint32_t n : r.keys[k].lengths) {
        writers[k]->add_document(p, n);
        p += n;
      }
      res.outputs[k].documents += int64_t(r.keys[k].lengths.size());
      res.outputs[k].tokens += int64_t(r.keys[k].tokens.size());
    }
    res.documents += r.records - r.skipped;
    res.skipped += r.skipped;
    res.bytes += r.bytes;
    for (auto& w : r.warnings)
      if (warnings.size() < 5) std::fprintf(stderr, "prepare-data: skipped %s\n", w.c_str());
    progress.update(res.documents, res.bytes, raw_done);
  };
  auto submit = [&](Chunk&& c) {
    while (pool.in_flight() >= max_in_flight) write_one();
    pool.submit(std::move(c));
  };

  constexpr size_t kChunkBytes = 1 << 20, kChunkRecords = 4096;
  for (int i = 0; i < int(o.inputs.size()); ++i) {
    InputStream in(o.inputs[i]);
    Chunk c;
    c.input = i;
    if (mode == Mode::File) {
      std::string all, buf(1 << 20, '\0');
      for (size_t k; (k = in.read(&buf[0], buf.size())) > 0;) all.append(buf, 0, k);
      if (!all.empty()) {
        c.bytes = all.size();
        c.records.push_back(std::move(all));
        c.lines.push_back(1);
        submit(std::move(c));
      }
      raw_done += in.raw_bytes_read();
      continue;
    }
    LineReader lines(in);
    std::string line;
    const uint64_t raw_before = raw_done;
    while (lines.next(line)) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines are no documents
      if (mode == Mode::Lines) line.push_back('\n');
      c.bytes += line.size();
      c.records.push_back(std::move(line));
      c.lines.push_back(lines.line_number());
      if (c.bytes >= kChunkBytes || c.records.size() >= kChunkRecords) {
        raw_done = raw_before + in.raw_bytes_read();
        submit(std::move(c));
        c = Chunk{};
        c.input = i;
      }
    }
    if (!c.records.empty()) submit(std::move(c));
    raw_done = raw_before + in.raw_bytes_read();
  }
  while (pool.in_flight() > 0) write_one();
  progress.update(res.documents, res.bytes, raw_done, true);

  int64_t written = 0;
  for (const auto& out : res.outputs) written += out.documents;
  if (written == 0)
    throw UserError(std::string("prepare-data: the inputs hold no documents") + (res.skipped ? " (all were skipped as bad)" : ""));
  for (size_t k = 0; k < writers.size(); ++k) {
    writers[k]->finish();
    res.tokens += res.outputs[k].tokens;
  }
  // What the dataset was made with, for the exporter (--vocab-from) and for people.
  for (const auto& out : res.outputs) {
    nlohmann::json meta = {{"tokenizer", info.kind}, {"tokenizer_path", info.path}, {"vocab_size", info.vocab_size},
                           {"eod", info.eod}, {"bos", info.bos}, {"append_eod", eod}, {"dtype", res.dtype},
                           {"documents", out.documents}, {"tokens", out.tokens}, {"key", out.key}};
    std::string tmp = out.prefix + ".meta.json.tmp";
    {
      std::ofstream f(tmp);
      f << meta.dump(2) << "\n";
      if (!f) throw UserError(tmp + ": cannot write");
    }
    if (std::rename(tmp.c_str(), (out.prefix + ".meta.json").c_str()) != 0)
      throw UserError(out.prefix + ".meta.json: cannot rename into place");
  }
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return res;
}

}  // namespace mfsdp
