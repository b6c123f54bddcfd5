// mfsdp validate -c FILE [--world-size N] [key.path=value ...]
#include <cstdio>
#include <cstdlib>

#include "commands.h"
#include "comm/communicator.h"
#include "device/device.h"
#include "config/config.h"
#include "mesh/device_mesh.h"
#include "model/model.h"
#include "parallel/tensor_parallel.h"
#include "util/error.h"
#include "util/strings.h"

#include <filesystem>
#include <map>

namespace mfsdp::cli {

void ConfigArgs::add_to(CLI::App& cmd) {
  cmd.add_option("-c,--config", file, "Experiment YAML (default: the embedded default config)");
  cmd.add_option("overrides", overrides, "key.path=value overrides, e.g. training.max_steps=1000");
}

namespace {

// How every parameter is split for this mesh: the TP split from the plan, then the FSDP bucket it
// lands in and what one rank of dp_shard x cp holds of that bucket.
void print_parameter_layout(const Config& cfg, const MeshShape& shape) {
  if (!std::filesystem::exists(cfg.model.path)) {
    std::printf("parameters: %s does not exist here; the per-parameter split is shown when it does\n",
                cfg.model.path.c_str());
    return;
  }
  Model model = [&] {
    try {
      return Model::load(cfg.model.path, /*on_meta=*/true);  // shapes only: no weights read
    } catch (const UserError&) {
      return Model::load(cfg.model.path);  // buffers with values cannot be loaded on meta
    }
  }();
  const std::string units =
      model.find_units(cfg.distributed.megatron_fsdp_unit_modules, cfg.where("distributed.megatron_fsdp_unit_modules"));
  std::printf("FSDP %s\n", units.c_str());
  TpAssignment a = plan_tensor_parallel(model, cfg, shape.tp);
  std::printf("%s", describe_tp_assignment(model, a, shape.tp).c_str());
  if (shape.cp > 1) {
    const std::vector<std::string> cores = model.modules_matching(cfg.distributed.core_attention_modules);
    const int64_t c = cfg.training.seq_length / (2 * shape.cp);
    std::printf("context parallel: cp %lld: each sequence of %lld tokens is cut into %lld chunks of %lld; cp rank r holds "
                "chunks r and %lld-r; attention core (%s): %s\n",
                (long long)shape.cp, (long long)cfg.training.seq_length, (long long)(2 * shape.cp), (long long)c,
                (long long)(2 * shape.cp - 1), join(cfg.distributed.core_attention_modules, ", ").c_str(),
                cores.empty() ? "NO MODULE MATCHES: training would stop (model contract)"
                              : (std::to_string(cores.size()) + " modules, " + cores.front() + " ...").c_str());
    if (cores.empty())
      throw ConfigError(cfg.where("distributed.core_attention_modules") + ": distributed.core_attention_modules [" +
                        join(cfg.distributed.core_attention_modules, ", ") + "] matches no module of " + cfg.model.path +
                        "; context parallelism replaces the attention core (README \"Model contract\")");
  }
  const int strategy = int(cfg.distributed.zero_dp_strategy);
  const int64_t S = strategy == 0 ? 1 : shape.dp_shard * shape.cp;
  std::map<int, int64_t> bucket;  // unit (-1: outside units) -> elements per TP rank
  for (size_t i = 0; i < model.params().size(); ++i) {
    int64_t n = model.params()[i].tensor.numel();
    if (a.split_dim[i] >= 0 && shape.tp > 1) n /= shape.tp;
    bucket[cfg.distributed.disable_bucketing ? int(1000000 + i) : model.params()[i].unit] += n;
  }
  std::printf("fsdp (%s, %s): each bucket padded to a multiple of %lld and sharded over dp_shard x cp = %lld ranks; %s\n",
              to_string(cfg.distributed.zero_dp_strategy), cfg.distributed.disable_bucketing ? "one bucket per parameter" : "one bucket per unit",
              (long long)S, (long long)S,
              strategy == 0 ? "no_shard keeps everything whole"
              : strategy == 1 ? "main weights and optimizer state sharded"
              : strategy == 2 ? "main weights, optimizer state and gradients sharded"
                              : "weights, gradients and optimizer state sharded; weights gathered per unit");
  for (const auto& [u, n] : bucket) {
    std::string name = u >= 1000000 ? model.params()[size_t(u - 1000000)].name
                       : u >= 0     ? model.units()[size_t(u)].path
                                    : "(outside units)";
    std::printf("  bucket %s: %lld elements per TP rank -> %lld per rank over %lld ranks\n", name.c_str(), (long long)n,
                (long long)((n + S - 1) / S), (long long)S);
  }
}

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
  auto check_cuda = std::make_shared<bool>(false);
  cmd.add_flag("--check-cuda", *check_cuda,
               "Load the CUDA plugin (libmfsdp_cuda.so) even without a GPU and report it; an error if it cannot be loaded");
  return [args, world, quiet, check_cuda]() {
    Config cfg = args->file.empty() ? load_config_string(embedded_default_config(), "<embedded default>", args->overrides)
                                    : load_config_file(args->file, args->overrides);
    const int n = *world > 0 ? *world : launcher_world_size();
    MeshShape shape = resolve_mesh_shape(cfg, n);
    check_against_world(cfg, n);
    const int64_t accum = grad_accum_steps(cfg, shape.dp());
    if (!*quiet) {
      std::printf("# resolved config (%s)\n%s\n", cfg.source.c_str(), to_yaml(cfg).c_str());
      std::printf("%s", describe_mesh(shape).c_str());
      std::printf("batch: global %lld = micro %lld x dp %lld x grad-accumulation %lld; %lld tokens per step\n",
                  (long long)cfg.training.global_batch_size, (long long)cfg.training.micro_batch_size,
                  (long long)shape.dp(), (long long)accum,
                  (long long)(cfg.training.global_batch_size * cfg.training.seq_length));
      std::printf("backend: %s\n", nccl_available() ? "NCCL on GPUs when present, MPI on CPU" : "MPI (CPU); NCCL not built");
      std::printf("cuda plugin: %s\n", cuda_plugin_status(*check_cuda).c_str());
      print_parameter_layout(cfg, shape);
    } else if (std::filesystem::exists(cfg.model.path)) {
      Model model = Model::load(cfg.model.path, true);
      model.find_units(cfg.distributed.megatron_fsdp_unit_modules, cfg.where("distributed.megatron_fsdp_unit_modules"));
      plan_tensor_parallel(model, cfg, shape.tp);  // the plan's errors, without the table
    }
    if (*check_cuda) {
      const std::string st = cuda_plugin_status(true);
      if (st.rfind("loaded from ", 0) != 0) throw UserError("--check-cuda: the CUDA plugin is " + st);
      if (*quiet) std::printf("cuda plugin: %s\n", st.c_str());
    }
    std::printf("config OK: %s at world size %d (dp_replicate %lld x dp_shard %lld x cp %lld x tp %lld), "
                "zero_dp_strategy %s\n",
                cfg.source.c_str(), n, (long long)shape.dp_replicate, (long long)shape.dp_shard, (long long)shape.cp,
                (long long)shape.tp, to_string(cfg.distributed.zero_dp_strategy));
    for (const auto& w : cfg.warnings) std::printf("warning: %s\n", w.c_str());
    return 0;
  };
}

}  // namespace mfsdp::cli
