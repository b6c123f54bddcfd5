// mfsdp validate -c FILE [--world-size N] [key.path=value ...]
#include <cstdio>
#include <cstdlib>

#include "commands.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "mesh/device_mesh.h"
#include "util/error.h"

namespace mfsdp::cli {

void ConfigArgs::add_to(CLI::App& cmd) {
  cmd.add_option("-c,--config", file, "Experiment YAML (default: the embedded default config)");
  cmd.add_option("overrides", overrides, "key.path=value overrides, e.g. training.max_steps=1000");
}

namespace {

// The world size the launcher gave us, without initialising MPI (Open MPI, PMI, SLURM).
int launcher_world_size() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"})
    if (const char* v = std::getenv(var)) return std::atoi(v);
  return 1;
}

}  // namespace

Runner add_validate(CLI::App& cmd) {
  auto args = std::make_shared<ConfigArgs>();
  auto world = std::make_shared<int>(0);
  auto quiet = std::make_shared<bool>(false);
  args->add_to(cmd);
  cmd.add_option("-n,--world-size", *world, "World size to lay the mesh out for (default: the launcher's, else 1)")
      ->check(CLI::PositiveNumber);
  cmd.add_flag("-q,--quiet", *quiet, "Print only the verdict line");
  return [args, world, quiet]() {
    Config cfg = args->file.empty() ? load_config_string(embedded_default_config(), "<embedded default>", args->overrides)
                                    : load_config_file(args->file, args->overrides);
    const int n = *world > 0 ? *world : launcher_world_size();
    MeshShape shape = resolve_mesh_shape(cfg, n);
    const int64_t accum = grad_accum_steps(cfg, shape.dp());
    if (!*quiet) {
      std::printf("# resolved config (%s)\n%s\n", cfg.source.c_str(), to_yaml(cfg).c_str());
      std::printf("%s", describe_mesh(shape).c_str());
      std::printf("batch: global %lld = micro %lld x dp %lld x grad-accumulation %lld; %lld tokens per step\n",
                  (long long)cfg.training.global_batch_size, (long long)cfg.training.micro_batch_size,
                  (long long)shape.dp(), (long long)accum,
                  (long long)(cfg.training.global_batch_size * cfg.training.seq_length));
      std::printf("backend: %s\n", nccl_available() ? "NCCL on GPUs when present, MPI on CPU" : "MPI (CPU); NCCL not built");
    }
    std::printf("config OK: %s at world size %d (dp_replicate %lld x dp_shard %lld x cp %lld x tp %lld), "
                "zero_dp_strategy %s\n",
                cfg.source.c_str(), n, (long long)shape.dp_replicate, (long long)shape.dp_shard, (long long)shape.cp,
                (long long)shape.tp, to_string(cfg.distributed.zero_dp_strategy));
    return 0;
  };
}

}  // namespace mfsdp::cli
