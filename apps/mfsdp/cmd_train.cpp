// mpirun -np N mfsdp train [-c FILE] [key.path=value ...]
// mfsdp prepare-data --input FILE... --output PREFIX [--split-lines] [--tokenizer-model M]
// mfsdp plot RUN_DIR [-o FILE]
#include <cstdio>

#include "commands.h"
#include "comm/mpi_env.h"
#include "config/config.h"
#include "checkpoint/checkpoint.h"
#include "comm/flight_recorder.h"
#include "data/prepare.h"
#include "train/metrics.h"
#include "train/trainer.h"

namespace mfsdp::cli {

Runner add_train(CLI::App& cmd) {
  auto args = std::make_shared<ConfigArgs>();
  args->add_to(cmd);
  return [args]() {
    Config cfg = args->file.empty() ? load_config_string(embedded_default_config(), "<embedded default>", args->overrides)
                                    : load_config_file(args->file, args->overrides);
    TrainResult r = train(cfg);
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
  auto no_eod = std::make_shared<bool>(false);
  cmd.add_option("-i,--input", o->inputs, "Text files (one document each, or one per line with --split-lines); - is stdin")
      ->required();
  cmd.add_option("-o,--output", o->output_prefix, "Output prefix: writes PREFIX.bin and PREFIX.idx")->required();
  cmd.add_flag("--split-lines", o->split_lines, "One document per non-empty line");
  cmd.add_option("--tokenizer-model", o->tokenizer_model, "SentencePiece .model (default: built-in byte-level tokenizer)");
  cmd.add_flag("--no-eod", *no_eod, "Do not append the end-of-document token");
  return [o, no_eod]() {
    o->append_eod = !*no_eod;
    PrepareResult r = prepare_data(*o);
    std::printf("wrote %s.bin and %s.idx: %lld documents, %lld tokens, tokenizer %s, vocabulary %lld\n",
                o->output_prefix.c_str(), o->output_prefix.c_str(), (long long)r.documents, (long long)r.tokens,
                r.tokenizer.c_str(), (long long)r.vocab_size);
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

Runner add_export(CLI::App& cmd) {
  auto dir = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto format = std::make_shared<std::string>("safetensors");
  auto model = std::make_shared<std::string>();
  cmd.add_option("--checkpoint", *dir, "A checkpoint step directory (for example ckpt/step_00001000)")->required();
  cmd.add_option("-o,--out", *out, "Output file")->required();
  cmd.add_option("--format", *format, "safetensors (consolidated weights) or torchscript (the model with them)")
      ->check(CLI::IsMember({"safetensors", "torchscript"}))
      ->capture_default_str();
  cmd.add_option("--model", *model, "TorchScript model for --format torchscript (default: the one the run trained)");
  auto state = std::make_shared<std::string>("main");
  cmd.add_option("--state", *state,
                 "What to write: main (the weights) or an optimizer state (exp_avg, exp_avg_sq, momentum_buffer), "
                 "under the parameters' names")
      ->capture_default_str();
  return [dir, out, format, model, state]() {
    export_checkpoint(*dir, *out, *format, *model, *state);
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
