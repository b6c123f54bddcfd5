// mfsdp: train TorchScript models with Megatron-FSDP-style sharding, launched by mpirun or srun.
// Errors: one line per failing rank, exit status 2 for user errors, 1 for internal ones; with more
// than one rank the failing rank aborts the whole job so that no peer is left waiting.
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <cstdio>
#include <map>
#include <memory>

#include "commands.h"
#include "comm/mpi_env.h"
#include "train/trainer.h"
#include "train/system.h"
#include "util/error.h"

namespace {

// Ctrl-C: one line per rank and status 130, not a stack of launcher noise. Only async-signal-safe
// calls in the handler; the line is prepared once the rank is known.
char g_sigint_line[96] = "mfsdp: interrupted (SIGINT)\n";
extern "C" void on_sigint(int) {
  ssize_t n = write(2, g_sigint_line, strlen(g_sigint_line));
  (void)n;
  _exit(130);
}

int report_and_exit(const char* kind, const char* what, int code) {
  const int rank = mfsdp::MpiEnv::world_rank();
  const int world = mfsdp::MpiEnv::world_size();
  if (world > 1) std::fprintf(stderr, "mfsdp: rank %d: %s%s\n", rank, kind, what);
  else std::fprintf(stderr, "mfsdp: %s%s\n", kind, what);
  std::fflush(stderr);
  if (world > 1) mfsdp::MpiEnv::abort_job(code);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  // A file-size limit (a full quota) must fail the write with an error we report, not kill us.
  std::signal(SIGXFSZ, SIG_IGN);
  std::signal(SIGINT, on_sigint);
  CLI::App app{"mfsdp: Megatron-FSDP-style sharded training of TorchScript models, launched by mpirun or srun"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "mfsdp 0.1.0");
  // Every subcommand: name, help, how it registers its options, whether it needs MPI.
  struct Subcommand {
    const char* name;
    const char* help;
    mfsdp::cli::Runner (*add)(CLI::App&);
    bool needs_mpi;
  };
  const Subcommand subcommands[] = {
      {"validate", "Check a config and show the mesh for a world size (no launch)", mfsdp::cli::add_validate, false},
      {"bench-comm", "Measure all_gather / reduce_scatter / all_reduce bus bandwidth per mesh group",
       mfsdp::cli::add_bench_comm, true},
      {"train", "Train a TorchScript model (launch with mpirun -np N or srun)", mfsdp::cli::add_train, true},
      {"prepare-data", "Turn text files into a Megatron indexed dataset (.bin + .idx)", mfsdp::cli::add_prepare_data,
       false},
      {"plot", "Draw a run's loss curves (metrics.jsonl) as SVG", mfsdp::cli::add_plot, false},
      {"export", "Consolidate a checkpoint into safetensors (or a TorchScript model)", mfsdp::cli::add_export, false},
      {"inspect", "Show a checkpoint's metadata and verify its checksums", mfsdp::cli::add_inspect, false},
      {"diagnose", "Explain a hang from the watchdog's flight records of every rank", mfsdp::cli::add_diagnose, false},
  };
  std::map<CLI::App*, std::pair<mfsdp::cli::Runner, bool>> runners;  // runner, needs MPI
  for (const auto& sc : subcommands) {
    CLI::App* cmd = app.add_subcommand(sc.name, sc.help);
    runners[cmd] = {sc.add(*cmd), sc.needs_mpi};
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  std::unique_ptr<mfsdp::MpiEnv> mpi;
  try {
    for (auto& [cmd, runner] : runners) {
      if (!cmd->parsed()) continue;
      // Before MPI and LibTorch start (seconds): a SLURM warning signal during start-up must not kill
      // the rank; train checks the flag after its first step.
      if (cmd->get_name() == "train") mfsdp::install_stop_signal_handlers();
      if (runner.second) {
        mpi = std::make_unique<mfsdp::MpiEnv>(&argc, &argv);
        std::snprintf(g_sigint_line, sizeof g_sigint_line, "mfsdp: rank %d: interrupted (SIGINT)\n",
                      mfsdp::MpiEnv::world_rank());
      }
      int rc = runner.first();
      mpi.reset();
      return rc;
    }
  } catch (const mfsdp::UserError& e) {
    return report_and_exit("error: ", e.what(), 2);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    // Running out of memory is the user's sizing, not our bug: say what to change.
    auto oom = what.find("can't allocate memory");
    if (oom != std::string::npos) {
      auto tried = what.find("you tried to allocate");
      std::string detail = tried == std::string::npos ? "" : " (" + what.substr(tried, what.find('.', tried) - tried) + ")";
      const std::string msg = "out of memory" + detail + ": lower training.micro_batch_size or "
                              "training.seq_length, or spread the work: distributed.cp_size (activations), "
                              "distributed.activation_checkpointing, zero_dp_strategy 3, distributed.tp_size";
      return report_and_exit("error: ", msg.c_str(), 2);
    }
    auto tag = what.find(mfsdp::kUserErrorTag);
    if (tag != std::string::npos) {  // a user error from inside an op, through the interpreter
      std::string msg = what.substr(tag + std::strlen(mfsdp::kUserErrorTag));
      msg = msg.substr(0, msg.find('\n'));
      return report_and_exit("error: ", msg.c_str(), 2);
    }
    return report_and_exit("internal error: ", what.c_str(), 1);
  }
  return 0;
}
