// `mfsdp bench-comm`: all_gather, reduce_scatter and all_reduce over a size sweep on each mesh
// group, reported as nccl-tests does (time, algbw, busbw) with a check of every result element.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mfsdp {

class ProcessGroups;
enum class MeshGroup;

struct BenchCommOptions {
  int64_t min_bytes = 1024;
  int64_t max_bytes = 16 << 20;
  int64_t step_factor = 4;
  int warmup_iters = 3;
  int iters = 10;
  std::string dtype = "float32";  // float32 | bfloat16 | float16 | float64 | int32 | int64
  std::vector<std::string> ops = {"all_gather", "reduce_scatter", "all_reduce"};
  std::vector<MeshGroup> groups;
  bool cuda = false;  // tensors on this rank's GPU (NCCL backend) instead of the CPU (MPI)  // empty: every mesh dimension with more than one rank, and world
};

struct BenchCommRow {
  std::string op, group, dtype;
  int64_t bytes = 0;       // S: the full buffer (count per rank x ranks for all_gather / reduce_scatter)
  int64_t count = 0;       // elements per rank in the small buffer (ag/rs), or of the buffer (ar)
  int group_size = 0;
  double time_us = 0;      // mean over iterations, averaged over the group's ranks
  double algbw_gbs = 0;    // S / t
  double busbw_gbs = 0;    // algbw x (n-1)/n (ag, rs) or 2(n-1)/n (ar)
  int64_t wrong = 0;       // result elements that differ from the expected values, over the group
};

// nccl-tests' bus bandwidth factor for an op on n ranks.
double busbw_factor(const std::string& op, int n);

// Collective over the world. Rows are this rank's groups; `print` writes the table (rank 0 only).
std::vector<BenchCommRow> run_bench_comm(const ProcessGroups& pg, const BenchCommOptions& opts, bool print);

}  // namespace mfsdp
