#include "comm/bench_comm.h"

#include "device/device.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>

#include "comm/mpi_env.h"
#include "mesh/process_groups.h"
#include "util/error.h"

namespace mfsdp {

double busbw_factor(const std::string& op, int n) {
  if (n <= 1) return 0.0;
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter") return double(n - 1) / n;
  return 1.0;  // broadcast, reduce
}

namespace {

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "float32" || s == "fp32" || s == "float") return at::kFloat;
  if (s == "bfloat16" || s == "bf16") return at::kBFloat16;
  if (s == "float16" || s == "fp16" || s == "half") return at::kHalf;
  if (s == "float64" || s == "fp64" || s == "double") return at::kDouble;
  if (s == "int32") return at::kInt;
  if (s == "int64") return at::kLong;
  throw UserError("bench-comm --dtype: expected float32, bfloat16, float16, float64, int32 or int64, got '" + s + "'");
}

// Input of group rank r: r + 1 + (global element index mod 7). Small integers: every sum below is
// exact in every dtype we carry (bf16 holds integers up to 256 exactly), so checks are exact.
at::Tensor pattern(int64_t count, int64_t offset, int r, at::ScalarType dt) {
  auto idx = at::arange(offset, offset + count, at::kLong);
  return (idx.remainder(7) + (r + 1)).to(dt);
}

int64_t count_wrong(const at::Tensor& got, const at::Tensor& expected) {
  return got.cpu().to(at::kDouble).ne(expected.to(at::kDouble)).sum().item<int64_t>();
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

BenchCommRow bench_one(Communicator& comm, const std::string& op, int64_t bytes, at::ScalarType dt,
                       const BenchCommOptions& o) {
  const int n = comm.size(), r = comm.rank();
  const int64_t elem = at::elementSize(dt);
  BenchCommRow row;
  row.op = op;
  row.group = comm.name();
  row.dtype = c10::toString(dt);
  row.group_size = n;
  const bool split = op != "all_reduce";
  row.count = split ? std::max<int64_t>(1, bytes / (elem * n)) : std::max<int64_t>(1, bytes / elem);
  row.bytes = (split ? row.count * n : row.count) * elem;
  const int64_t c = row.count;

  const auto dev = o.cuda ? at::Device(at::kCUDA, MpiEnv::local_rank() % std::max<int>(1, cuda_device_count()))
                          : at::Device(at::kCPU);
  const auto opts = at::TensorOptions().dtype(dt).device(dev);
  at::Tensor small = at::empty({c}, opts), big = at::empty({c * n}, opts), buf = at::empty({c}, opts);
  std::function<WorkHandle()> launch;
  at::Tensor expected;
  at::Tensor* result = nullptr;
  const double tri = double(n) * (n + 1) / 2;  // sum of r + 1 over ranks
  if (op == "all_gather") {
    small.copy_(pattern(c, 0, r, dt));
    std::vector<at::Tensor> parts;
    for (int q = 0; q < n; ++q) parts.push_back(pattern(c, 0, q, dt));
    expected = at::cat(parts);
    launch = [&] { return comm.all_gather_async(big, small); };
    result = &big;
  } else if (op == "reduce_scatter") {
    // Block q of rank r's input holds pattern(offset q*c); rank r receives block r summed.
    auto idx = at::arange(r * c, (r + 1) * c, at::kLong);
    expected = (idx.remainder(7) * n + tri).to(dt);
    launch = [&] { return comm.reduce_scatter_async(small, big, ReduceOp::kSum); };
    big.copy_(pattern(c * n, 0, r, dt));
    result = &small;
  } else if (op == "all_reduce") {
    expected = (at::arange(0, c, at::kLong).remainder(7) * n + tri).to(dt);
    launch = [&] { return comm.all_reduce_async(buf, ReduceOp::kSum); };
    buf.copy_(pattern(c, 0, r, dt));
    result = &buf;
  } else {
    throw UserError("bench-comm --op: expected all_gather, reduce_scatter or all_reduce, got '" + op + "'");
  }
  // One checked run on fresh inputs, then warm-up and timed runs (all_reduce is in place, so the
  // values of later runs are not meaningful; only the first is checked, as nccl-tests -c 1 does).
  launch()->wait();
  // The verdict and the timings are reduced over the same communicator, so they live on its
  // device too (an NCCL communicator takes CUDA tensors only).
  at::Tensor wrong = at::full({1}, count_wrong(*result, expected), at::TensorOptions().dtype(at::kLong).device(dev));
  comm.all_reduce(wrong, ReduceOp::kSum);
  row.wrong = wrong.item<int64_t>();
  for (int i = 0; i < o.warmup_iters; ++i) launch()->wait();
  synchronize(dev);  // the warm-up has finished on the device before the clock starts
  comm.barrier();
  double t0 = now_us();
  for (int i = 0; i < o.iters; ++i) launch()->wait();
  synchronize(dev);  // NCCL wait() only orders streams: the host waits for the device here
  double t = (now_us() - t0) / std::max(1, o.iters);
  at::Tensor tt = at::full({1}, t, at::TensorOptions().dtype(at::kDouble).device(dev));
  comm.all_reduce(tt, ReduceOp::kAvg);
  row.time_us = tt.item<double>();
  row.algbw_gbs = row.bytes / (row.time_us * 1e-6) / 1e9;
  row.busbw_gbs = row.algbw_gbs * busbw_factor(op, n);
  return row;
}

}  // namespace

std::vector<BenchCommRow> run_bench_comm(const ProcessGroups& pg, const BenchCommOptions& o, bool print) {
  if (o.min_bytes < 1 || o.max_bytes < o.min_bytes || o.step_factor < 2 || o.iters < 1 || o.warmup_iters < 0)
    throw UserError("bench-comm: need 1 <= min-bytes <= max-bytes, step-factor >= 2, iters >= 1, warmup >= 0");
  const at::ScalarType dt = parse_dtype(o.dtype);
  std::vector<MeshGroup> groups = o.groups;
  if (groups.empty()) {
    for (auto g : {MeshGroup::kTp, MeshGroup::kCp, MeshGroup::kDpShard, MeshGroup::kDpReplicate, MeshGroup::kDpShardCp,
                   MeshGroup::kWorld}) {
      if (pg.mesh().group_size(g) <= 1) continue;
      if (g == MeshGroup::kDpShardCp && (pg.mesh().shape().cp == 1 || pg.mesh().shape().dp_shard == 1)) continue;
      if (g == MeshGroup::kWorld && !groups.empty() && pg.mesh().group_size(groups.back()) == pg.mesh().shape().world())
        continue;  // world equals the only non-trivial dimension: measured already
      groups.push_back(g);
    }
  }
  std::vector<BenchCommRow> rows;
  if (print)
    std::printf("# mfsdp bench-comm: %d ranks, dtype %s, %d warm-up + %d timed iterations, time averaged over ranks\n"
                "# %-14s %-13s %5s %12s %12s %10s %10s %10s %7s\n",
                int(pg.mesh().shape().world()), o.dtype.c_str(), o.warmup_iters, o.iters, "op", "group", "ranks",
                "size(B)", "count", "time(us)", "algbw", "busbw", "#wrong");
  for (MeshGroup g : groups) {
    Communicator& comm = pg.get(g);
    if (comm.size() == 1) {
      if (print) std::printf("# group %s has one rank: nothing to measure\n", comm.name().c_str());
      continue;
    }
    for (const auto& op : o.ops) {
      for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.step_factor) {
        BenchCommRow row = bench_one(comm, op, bytes, dt, o);
        rows.push_back(row);
        if (print)
          std::printf("  %-14s %-13s %5d %12lld %12lld %10.1f %10.3f %10.3f %7lld\n", row.op.c_str(), row.group.c_str(),
                      row.group_size, (long long)row.bytes, (long long)row.count, row.time_us, row.algbw_gbs,
                      row.busbw_gbs, (long long)row.wrong);
        if (bytes > o.max_bytes / o.step_factor) break;
      }
    }
  }
  if (print) {
    int64_t wrong = 0;
    for (auto& r : rows) wrong += r.wrong;
    std::printf("# out of bounds values: %lld %s\n", (long long)wrong, wrong ? "FAILED" : "OK");
    std::fflush(stdout);
  }
  return rows;
}

}  // namespace mfsdp
