// mpirun -np N mfsdp bench-comm [-c FILE] [overrides] [--min-bytes ..] [--max-bytes ..] ...
#include <ATen/Context.h>

#include <cstdio>

#include "commands.h"
#include "device/device.h"
#include "comm/bench_comm.h"
#include "comm/mpi_env.h"
#include "config/config.h"
#include "mesh/device_mesh.h"
#include "mesh/process_groups.h"
#include "util/error.h"

namespace mfsdp::cli {

Runner add_bench_comm(CLI::App& cmd) {
  auto args = std::make_shared<ConfigArgs>();
  auto o = std::make_shared<BenchCommOptions>();
  auto groups = std::make_shared<std::vector<std::string>>();
  auto backend = std::make_shared<std::string>("auto");
  args->add_to(cmd);
  cmd.add_option("-b,--min-bytes", o->min_bytes, "Smallest total buffer size in bytes")->capture_default_str();
  cmd.add_option("-e,--max-bytes", o->max_bytes, "Largest total buffer size in bytes")->capture_default_str();
  cmd.add_option("-f,--step-factor", o->step_factor, "Multiply the size by this between rows")->capture_default_str();
  cmd.add_option("-w,--warmup", o->warmup_iters, "Warm-up iterations per size")->capture_default_str();
  cmd.add_option("-i,--iters", o->iters, "Timed iterations per size")->capture_default_str();
  cmd.add_option("-d,--dtype", o->dtype, "float32, bfloat16, float16, float64, int32, int64")->capture_default_str();
  cmd.add_option("--op", o->ops, "Collectives to run (all_gather, reduce_scatter, all_reduce)")->capture_default_str();
  cmd.add_option("-g,--group", *groups,
                 "Mesh groups to measure: tp, cp, dp_shard, dp_replicate, dp, dp_shard_cp, dp_cp, world "
                 "(default: every dimension with more than one rank, and world)");
  cmd.add_option("--backend", *backend, "auto (NCCL on GPUs when built with it and a GPU is present, else MPI), mpi, nccl")
      ->check(CLI::IsMember({"auto", "mpi", "nccl"}))
      ->capture_default_str();
  return [args, o, groups, backend]() {
    Config cfg = args->file.empty() ? load_config_string(embedded_default_config(), "<embedded default>", args->overrides)
                                    : load_config_file(args->file, args->overrides);
    MeshShape shape = resolve_mesh_shape(cfg, MpiEnv::world_size());
    DeviceMesh mesh(shape, MpiEnv::world_rank());
    const bool gpu = nccl_available() && cuda_usable();  // loads the CUDA plugin where the driver sees a GPU
    if (*backend == "nccl" && !gpu)
      throw UserError(nccl_available() ? "bench-comm --backend nccl: no GPU is visible on this node"
                                       : "bench-comm --backend nccl: this build has no NCCL backend (CPU-only LibTorch)");
    const Backend be = (*backend == "nccl" || (*backend == "auto" && gpu)) ? Backend::kNccl : Backend::kMpi;
    o->cuda = be == Backend::kNccl;
    if (o->cuda) select_device("cuda", MpiEnv::local_rank(), "bench-comm");  // one GPU per local rank
    ProcessGroups pg(mesh, be, o->cuda);
    o->groups.clear();
    for (const auto& name : *groups) {
      bool found = false;
      for (int g = 0; g < kNumMeshGroups; ++g)
        if (name == to_string(static_cast<MeshGroup>(g))) {
          o->groups.push_back(static_cast<MeshGroup>(g));
          found = true;
        }
      if (!found)
        throw UserError("bench-comm --group: unknown group '" + name +
                        "'; expected tp, cp, dp_shard, dp_replicate, dp, dp_shard_cp, dp_cp or world");
    }
    const bool rank0 = MpiEnv::world_rank() == 0;
    if (rank0) std::printf("%sbackend: %s\n", describe_mesh(shape).c_str(), to_string(be));
    auto rows = run_bench_comm(pg, *o, rank0);
    int64_t wrong = 0;
    for (const auto& r : rows) wrong += r.wrong;
    return wrong == 0 ? 0 : 1;
  };
}

}  // namespace mfsdp::cli
