// mpirun -np N mfsdp train [-c FILE] [key.path=value ...]
// mfsdp prepare-data --input FILE... --output PREFIX [--tokenizer T] [--json-keys K...] [--workers N] ...
// mfsdp plot RUN_DIR [-o FILE]
#include <algorithm>
#include <array>
#include <cctype>
#include <csignal>
#include <cstdio>
#include <map>

#include <mpi.h>

#include "commands.h"
#include "comm/mpi_env.h"
#include "config/config.h"
#include "checkpoint/checkpoint.h"
#include "comm/flight_recorder.h"
#include "data/prepare.h"
#include "train/metrics.h"
#include "util/error.h"
#include "train/system.h"
#include "train/trainer.h"

namespace mfsdp::cli {

// The state of a run for a cluster script: {"status": "running" | "completed" | "stopped", "step": N,
// "checkpoint": PATH, "signal": "SIGUSR1" | "SIGTERM" | ""}; "running" once every rank is up (and handles stop signals), the outcome at the
// end; written by rank 0 under a temporary name and renamed.
// scripts/slurm/train.sbatch requeues the job when the status is "stopped" (SIGUSR1/SIGTERM
// before the time limit, the checkpoint saved).
void write_status_file(const std::string& path, const char* status, long long step, const std::string& checkpoint,
                       int signal = 0) {
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) throw UserError(path + ": cannot write the --status-file");
  std::string ckpt;
  for (char c : checkpoint) {
    if (c == '"' || c == '\\') ckpt.push_back('\\');
    ckpt.push_back(c);
  }
  const char* sig = signal == SIGUSR1 ? "SIGUSR1" : signal == SIGTERM ? "SIGTERM" : "";
  std::fprintf(f, "{\"status\": \"%s\", \"step\": %lld, \"checkpoint\": \"%s\", \"signal\": \"%s\"}\n", status, step,
               ckpt.c_str(), sig);
  bool ok = std::fclose(f) == 0;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) throw UserError(path + ": cannot write the --status-file");
}

Runner add_train(CLI::App& cmd) {
  auto args = std::make_shared<ConfigArgs>();
  auto status_file = std::make_shared<std::string>();
  args->add_to(cmd);
  cmd.add_option("--status-file", *status_file,
                 "Rank 0 writes the run's outcome here as JSON when it ends: status completed or stopped (by "
                 "SIGUSR1/SIGTERM, after saving), step, checkpoint (cluster scripts requeue on stopped)");
  return [args, status_file]() {
    check_cpu_knobs();  // before anything is written
    env_threads();              // a bad OMP_NUM_THREADS / MKL_NUM_THREADS too
    Config cfg = args->file.empty() ? load_config_string(embedded_default_config(), "<embedded default>", args->overrides)
                                    : load_config_file(args->file, args->overrides);
    if (!status_file->empty()) {
      // Every rank installs its stop-signal handlers in main before MPI_Init, so once all ranks have
      // passed this barrier a SIGUSR1/SIGTERM stops training cleanly instead of killing a rank that
      // is still loading. train.sbatch holds back a signal that arrives before "running" appears
      // (SLURM's time-limit warning can come while srun is still starting the ranks).
      MPI_Barrier(MPI_COMM_WORLD);
      if (MpiEnv::world_rank() == 0) write_status_file(*status_file, "running", 0, "");
    }
    TrainResult r = train(cfg);
    if (MpiEnv::world_rank() == 0 && !status_file->empty()) write_status_file(*status_file, r.preempted ? "stopped" : "completed", (long long)r.steps, r.last_checkpoint,
                        r.stop_signal);
    if (MpiEnv::world_rank() == 0) {
      std::printf("%s: %lld steps%s, final loss %.4f%s; run directory %s (metrics.jsonl, config.yaml)%s\n",
                  r.preempted ? "stopped by signal" : "done", (long long)r.steps,
                  r.resumed_from ? (" (resumed at step " + std::to_string(r.resumed_from) + ")").c_str() : "", r.last_loss,
                  r.last_val_loss ? (", validation loss " + std::to_string(*r.last_val_loss)).c_str() : "",
                  cfg.run_dir.c_str(), r.last_checkpoint.empty() ? "" : ("; checkpoint " + r.last_checkpoint).c_str());
    }
    return 0;
  };
}

Runner add_prepare_data(CLI::App& cmd) {
  auto o = std::make_shared<PrepareOptions>();
  auto flags = std::make_shared<std::array<bool, 5>>();  // append-eod, no-eod, progress, no-progress, quiet
  cmd.add_option("-i,--input", o->inputs,
                 "Input files: text (one document each, or one per line with --split-lines), JSONL (*.jsonl or "
                 "--json-keys), gzip or zstd compressed; - is stdin")
      ->required();
  cmd.add_option("-o,--output,--output-prefix", o->output_prefix,
                 "Output prefix: PREFIX.bin/.idx for text, PREFIX_<key>_document.bin/.idx for JSONL (as Megatron)")
      ->required();
  cmd.add_flag("--split-lines", o->split_lines, "Text inputs: one document per non-empty line");
  cmd.add_option("--json-keys", o->json_keys, "JSONL: the keys whose strings are documents (default: text)");
  cmd.add_option("-t,--tokenizer,--tokenizer-model", o->tokenizer,
                 "byte (built-in, default), a tokenizer.json, a directory with tokenizer.json, vocab.json + merges.txt "
                 "or tokenizer.model, a .tiktoken rank file, a Tekken .json, or a SentencePiece .model");
  cmd.add_option("--tiktoken-encoding", o->tokenizer_options.tiktoken_encoding,
                 "Pattern of a .tiktoken file whose name does not say: gpt2, r50k_base, p50k_base, cl100k_base, "
                 "o200k_base, whisper");
  cmd.add_option("--eod-token", o->tokenizer_options.eod_token, "End-of-document token by its text (tokenizer.json, GPT-2)");
  cmd.add_flag("--append-eod", (*flags)[0], "Append the end-of-document token to every document (byte-level: default)");
  cmd.add_flag("--no-eod", (*flags)[1], "Do not append it");
  cmd.add_option("-j,--workers", o->workers, "Tokenizer threads (output identical for any number)")->check(CLI::Range(1, 256));
  cmd.add_flag("--skip-bad", o->skip_bad, "Skip and count bad records (invalid JSON or UTF-8, a missing key) instead of stopping");
  cmd.add_flag("--progress", (*flags)[2], "Show progress even when stderr is not a terminal");
  cmd.add_flag("--no-progress", (*flags)[3], "Never show progress");
  return [o, flags]() {
    if ((*flags)[0] && (*flags)[1]) throw UserError("prepare-data: --append-eod and --no-eod contradict each other");
    o->append_eod = (*flags)[0] ? 1 : (*flags)[1] ? 0 : -1;
    o->progress = (*flags)[2] ? 1 : (*flags)[3] ? 0 : -1;
    PrepareResult r = prepare_data(*o);
    for (const auto& out : r.outputs)
      std::printf("wrote %s.bin and %s.idx%s: %lld documents, %lld tokens (%s)\n", out.prefix.c_str(), out.prefix.c_str(),
                  out.key.empty() ? "" : (" (key \"" + out.key + "\")").c_str(), (long long)out.documents,
                  (long long)out.tokens, r.dtype);
    std::printf("tokenizer %s; %lld documents%s, %.1f MB in %.2f s (%.0f documents/s, %.2f MB/s, %d worker%s)\n",
                r.tokenizer.describe.c_str(), (long long)r.documents,
                r.skipped ? (", " + std::to_string(r.skipped) + " skipped as bad").c_str() : "", r.bytes / 1e6, r.seconds,
                r.documents / std::max(r.seconds, 1e-9), r.bytes / 1e6 / std::max(r.seconds, 1e-9), o->workers,
                o->workers == 1 ? "" : "s");
    return 0;
  };
}

Runner add_plot(CLI::App& cmd) {
  auto run_dir = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  cmd.add_option("run_dir", *run_dir, "Run directory holding metrics.jsonl")->required();
  cmd.add_option("-o,--output", *out, "SVG file to write (default: RUN_DIR/loss.svg)");
  return [run_dir, out]() {
    std::string path = out->empty() ? *run_dir + "/loss.svg" : *out;
    int n = plot_metrics(*run_dir, path);
    std::printf("wrote %s (%d points)\n", path.c_str(), n);
    return 0;
  };
}

}  // namespace mfsdp::cli

namespace mfsdp::cli {

// "5GB", "200MB", "64KB", "1000" (bytes): decimal units, as transformers' max_shard_size.
int64_t parse_byte_size(const std::string& text, const std::string& what) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  std::string unit = text.substr(i);
  for (auto& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  static const std::map<std::string, double> units = {{"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9},
                                                      {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}};
  auto u = units.find(unit);
  char* end = nullptr;
  const std::string num = text.substr(0, i);
  const double v = num.empty() ? 0 : std::strtod(num.c_str(), &end);
  if (num.empty() || u == units.end() || v <= 0)
    throw UserError(what + ": expected a size such as 5GB, 200MB or 1000000, got '" + text + "'");
  return int64_t(v * u->second);
}

Runner add_export(CLI::App& cmd) {
  auto dir = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto format = std::make_shared<std::string>("safetensors");
  auto model = std::make_shared<std::string>();
  cmd.add_option("--checkpoint", *dir, "A checkpoint step directory (for example ckpt/step_00001000)")->required();
  cmd.add_option("-o,--out", *out, "Output file")->required();
  cmd.add_option("--format", *format,
                 "safetensors (consolidated weights), torchscript (the model with them) or hf (a Hugging Face model "
                 "directory: config.json + model.safetensors, for a model from scripts/export_hf.py; a LoRA model's adapters "
                 "merged in)")
      ->check(CLI::IsMember({"safetensors", "torchscript", "hf"}))
      ->capture_default_str();
  auto dtype = std::make_shared<std::string>();
  cmd.add_option("--dtype", *dtype, "--format hf: float32, bfloat16 or float16 (default: the config's torch_dtype)");
  auto shard = std::make_shared<std::string>("5GB");
  cmd.add_option("--max-shard-size", *shard,
                 "--format hf: the largest safetensors file (bytes, or with KB/MB/GB as transformers' save_pretrained); "
                 "more weights are written as shards with model.safetensors.index.json")
      ->capture_default_str();
  cmd.add_option("--model", *model, "TorchScript model for --format torchscript (default: the one the run trained)");
  auto state = std::make_shared<std::string>("main");
  cmd.add_option("--state", *state,
                 "What to write: main (the weights) or an optimizer state (exp_avg, exp_avg_sq, momentum_buffer), "
                 "under the parameters' names")
      ->capture_default_str();
  auto only_trainable = std::make_shared<bool>(false);
  cmd.add_flag("--only-trainable", *only_trainable,
               "Only the parameters the run trained (not model.frozen): with --format hf for a LoRA model from "
               "scripts/export_hf.py, PEFT's adapter directory (adapter_model.safetensors + adapter_config.json)");
  return [dir, out, format, model, state, dtype, shard, only_trainable]() {
    if (*format == "hf") {
      if (*state != "main") throw UserError("export --format hf writes the weights (--state main), not " + *state);
      export_checkpoint_hf(*dir, *out, *model, *dtype, parse_byte_size(*shard, "export --max-shard-size"),
                           *only_trainable);
    } else {
      if (!dtype->empty()) throw UserError("export --dtype: only with --format hf");
      export_checkpoint(*dir, *out, *format, *model, *state, *only_trainable);
    }
    std::printf("wrote %s (%s) from %s\n", out->c_str(), format->c_str(), dir->c_str());
    return 0;
  };
}

Runner add_diagnose(CLI::App& cmd) {
  auto dir = std::make_shared<std::string>();
  cmd.add_option("run_dir", *dir, "Run directory whose flight/ records the watchdog wrote")->required();
  return [dir]() {
    std::printf("%s", diagnose_flight_records(*dir).c_str());
    return 0;
  };
}

Runner add_inspect(CLI::App& cmd) {
  auto dir = std::make_shared<std::string>();
  auto verbose = std::make_shared<bool>(false);
  cmd.add_option("checkpoint", *dir, "A checkpoint step directory")->required();
  cmd.add_flag("-v,--verbose", *verbose, "List every parameter");
  return [dir, verbose]() { return inspect_checkpoint(*dir, *verbose) == 0 ? 0 : 1; };
}

}  // namespace mfsdp::cli
