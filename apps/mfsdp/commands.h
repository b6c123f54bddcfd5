// The subcommands of the `mfsdp` executable. Each registers its options on the CLI11 app and
// returns the function that runs it (after parsing) and gives the exit status.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>

namespace mfsdp::cli {

using Runner = std::function<int()>;

Runner add_validate(CLI::App& app);
Runner add_bench_comm(CLI::App& app);
Runner add_train(CLI::App& app);
Runner add_prepare_data(CLI::App& app);
Runner add_plot(CLI::App& app);
Runner add_export(CLI::App& app);
Runner add_inspect(CLI::App& app);
Runner add_diagnose(CLI::App& app);

// Loads the config named by -c (or the embedded default) with the overrides.
struct ConfigArgs {
  std::string file;
  std::vector<std::string> overrides;
  void add_to(CLI::App& cmd);
};

}  // namespace mfsdp::cli
