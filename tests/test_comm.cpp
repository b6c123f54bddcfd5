// Every collective, dtype and reduce op, synchronous and asynchronous, on the world and on mesh
// groups. Run by CTest under mpirun at 1, 2 and 4 ranks. Expected values are small integers (or
// exact binary fractions) so that every dtype, bf16 included, must reproduce them exactly.
#include <ATen/ATen.h>

#include "mpi_test_main.h"
#include "comm/communicator.h"
#include "comm/mpi_env.h"
#include "mesh/process_groups.h"

using namespace mfsdp;

namespace {

const std::vector<at::ScalarType> kTypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong};

// Rank r's element i: (r + 1) * 2 + i % 5 -- distinct per rank, exact in every dtype.
at::Tensor values(int64_t n, int r, at::ScalarType t, int64_t offset = 0) {
  return (at::arange(offset, offset + n, at::kLong).remainder(5) + 2 * (r + 1)).to(t);
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.to(at::kDouble).equal(b.to(at::kDouble));
}

}  // namespace

TEST_CASE("all_gather, every dtype") {
  auto c = test::world("world");
  const int n = c->size(), r = c->rank();
  for (auto t : kTypes) {
    INFO(c10::toString(t));
    auto in = values(7, r, t);
    auto out = at::zeros({7 * n}, t);
    c->all_gather(out, in);
    for (int q = 0; q < n; ++q) CHECK(same(out.slice(0, 7 * q, 7 * (q + 1)), values(7, q, t)));
    // In place: the input is this rank's slice of the output.
    auto buf = at::zeros({7 * n}, t);
    buf.slice(0, 7 * r, 7 * (r + 1)).copy_(values(7, r, t));
    c->all_gather(buf, buf.slice(0, 7 * r, 7 * (r + 1)));
    CHECK(same(buf, out));
  }
}

TEST_CASE("reduce_scatter sum/avg/max, every dtype") {
  auto c = test::world("world");
  const int n = c->size(), r = c->rank();
  for (auto t : kTypes) {
    INFO(c10::toString(t));
    auto in = values(6 * n, r, t);
    auto block = at::arange(6 * r, 6 * (r + 1), at::kLong).remainder(5);
    const int64_t tri = int64_t(n) * (n + 1);  // sum over q of 2 (q + 1)
    auto out = at::zeros({6}, t);
    c->reduce_scatter(out, in, ReduceOp::kSum);
    CHECK(same(out, (block * n + tri).to(t)));
    c->reduce_scatter(out, in, ReduceOp::kMax);
    CHECK(same(out, (block + 2 * n).to(t)));
    c->reduce_scatter(out, in, ReduceOp::kAvg);
    if (at::isFloatingType(t)) CHECK(same(out, ((block * n + tri).to(at::kDouble) / n).to(t)));
    else CHECK(same(out, (block * n + tri).div(n, "trunc").to(t)));
  }
}

// The MPI backend's reduce-scatter is a ring of point-to-point rounds (mpi_communicator.cpp):
// in place (the output is this rank's block of the input), several in flight on one communicator
// at once (their rounds must not match each other's messages) and large blocks, against
// all_reduce; the input is left as it was.
TEST_CASE("reduce_scatter in place, overlapping and large, against all_reduce") {
  auto c = test::world("world");
  const int n = c->size(), r = c->rank();
  auto in = values(9 * n, r, at::kFloat);
  auto ref = in.clone();
  c->all_reduce(ref, ReduceOp::kSum);
  auto mine = ref.slice(0, 9 * r, 9 * (r + 1));
  auto buf = in.clone();
  c->reduce_scatter(buf.slice(0, 9 * r, 9 * (r + 1)), buf, ReduceOp::kSum);
  CHECK(same(buf.slice(0, 9 * r, 9 * (r + 1)), mine));
  // Four reduce-scatters of different sizes in flight together, waited for newest first.
  std::vector<at::Tensor> ins, outs, refs;
  std::vector<WorkHandle> works;
  for (int k = 0; k < 4; ++k) {
    const int64_t m = (k + 1) * 1000 + k;
    ins.push_back(values(m * n, r, at::kFloat, k));
    outs.push_back(at::zeros({m}, at::kFloat));
    auto full = ins.back().clone();
    c->all_reduce(full, ReduceOp::kSum);
    refs.push_back(full.slice(0, m * r, m * (r + 1)));
  }
  for (int k = 0; k < 4; ++k) works.push_back(c->reduce_scatter_async(outs[k], ins[k], ReduceOp::kSum));
  for (int k = 3; k >= 0; --k) works[k]->wait();
  for (int k = 0; k < 4; ++k) {
    INFO("in flight together: " << k);
    CHECK(same(outs[k], refs[k]));
    CHECK(same(ins[k], values(ins[k].numel(), r, at::kFloat, k)));
  }
  // Blocks of 4 MiB (fp32) and of a bf16 gradient.
  for (auto t : {at::kFloat, at::kBFloat16}) {
    const int64_t m = int64_t(1) << 20;
    auto big = values(m * n, r, t, 3);
    auto full = big.clone();
    c->all_reduce(full, ReduceOp::kSum);
    auto out = at::empty({m}, t);
    c->reduce_scatter(out, big, ReduceOp::kSum);
    CHECK(same(out, full.slice(0, m * r, m * (r + 1))));
  }
}

TEST_CASE("all_reduce sum/avg/max, every dtype") {
  auto c = test::world("world");
  const int n = c->size(), r = c->rank();
  for (auto t : kTypes) {
    INFO(c10::toString(t));
    auto idx = at::arange(0, 11, at::kLong).remainder(5);
    const int64_t tri = int64_t(n) * (n + 1);
    auto x = values(11, r, t);
    c->all_reduce(x, ReduceOp::kSum);
    CHECK(same(x, (idx * n + tri).to(t)));
    x = values(11, r, t);
    c->all_reduce(x, ReduceOp::kMax);
    CHECK(same(x, (idx + 2 * n).to(t)));
    x = values(11, r, t);
    c->all_reduce(x, ReduceOp::kAvg);
    if (at::isFloatingType(t)) CHECK(same(x, (idx * n + tri).to(at::kDouble).div(n).to(t)));
    else CHECK(same(x, (idx * n + tri).div(n, "trunc").to(t)));
  }
}

// From 1 MiB the MPI backend's all_reduce is a ring in place (mpi_communicator.cpp): p blocks, the
// first n % p one element longer; reduce-scatter rounds, then all-gather rounds. Every dtype and
// op over a length no rank count divides evenly, several in flight on one communicator (each
// ring's messages must match its own), and fp32 values that round: the ring adds block b's
// partials in reduce_scatter's order, so each rank's block is reduce_scatter's bit for bit.
TEST_CASE("all_reduce of large tensors (the ring): uneven blocks, every dtype and op, in flight together") {
  auto c = test::world("world");
  const int n = c->size(), r = c->rank();
  const int64_t len = (int64_t(1) << 19) + 7;  // 1 MiB in 16-bit types, 2 MiB in fp32; 7 left over
  for (auto t : kTypes) {
    INFO(c10::toString(t) << ", " << len << " elements");
    auto idx = at::arange(0, len, at::kLong).remainder(5);
    const int64_t tri = int64_t(n) * (n + 1);
    auto x = values(len, r, t);
    c->all_reduce(x, ReduceOp::kSum);
    CHECK(same(x, (idx * n + tri).to(t)));
    x = values(len, r, t);
    c->all_reduce(x, ReduceOp::kMax);
    CHECK(same(x, (idx + 2 * n).to(t)));
    x = values(len, r, t);
    c->all_reduce(x, ReduceOp::kAvg);
    if (at::isFloatingType(t)) CHECK(same(x, (idx * n + tri).to(at::kDouble).div(n).to(t)));
    else CHECK(same(x, (idx * n + tri).div(n, "trunc").to(t)));
  }
  // Three in flight together, of three lengths, waited for newest first.
  std::vector<at::Tensor> bufs;
  std::vector<WorkHandle> works;
  for (int k = 0; k < 3; ++k) bufs.push_back(values(len + 11 * k, r, at::kFloat, k));
  for (auto& b : bufs) works.push_back(c->all_reduce_async(b, ReduceOp::kSum));
  for (int k = 2; k >= 0; --k) works[k]->wait();
  for (int k = 0; k < 3; ++k) {
    INFO("in flight together: " << k);
    auto idx = at::arange(k, k + len + 11 * k, at::kLong).remainder(5);
    CHECK(same(bufs[k], (idx * n + int64_t(n) * (n + 1)).to(at::kFloat)));
  }
  // Values that round: this rank's block equals reduce_scatter's exactly.
  at::manual_seed(100 + r);
  const int64_t m = (int64_t(1) << 18) + 3;
  auto g = at::randn({m * n}) * 3;
  auto whole = g.clone();
  c->all_reduce(whole, ReduceOp::kSum);
  auto shard = at::empty({m});
  c->reduce_scatter(shard, g, ReduceOp::kSum);
  CHECK(at::equal(whole.slice(0, m * r, m * (r + 1)), shard));
}

TEST_CASE("bf16 and fp16 sums are floating-point sums, not integer sums of the bit patterns") {
  auto c = test::world("world");
  const int n = c->size();
  for (auto t : {at::kBFloat16, at::kHalf}) {
    INFO(c10::toString(t));
    // 0.5 + 0.25 per rank: bit patterns summed as uint16 would give garbage (0x3F00 + 0x3F00 ...).
    auto x = at::full({5}, 0.75, t);
    c->all_reduce(x, ReduceOp::kSum);
    CHECK(same(x, at::full({5}, 0.75 * n, at::kDouble).to(t)));
    auto y = at::full({3}, -1.5, t);
    c->all_reduce(y, ReduceOp::kSum);
    CHECK(same(y, at::full({3}, -1.5 * n, at::kDouble).to(t)));
  }
}

TEST_CASE("broadcast from every root, every dtype") {
  auto c = test::world("world");
  for (auto t : kTypes) {
    for (int root = 0; root < c->size(); ++root) {
      auto x = values(9, c->rank(), t);
      c->broadcast(x, root);
      CHECK(same(x, values(9, root, t)));
    }
  }
}

TEST_CASE("async collectives: several in flight, completed by wait in any order") {
  auto c = test::world("world");
  const int n = c->size(), r = c->rank();
  std::vector<at::Tensor> bufs;
  std::vector<WorkHandle> works;
  for (int k = 0; k < 6; ++k) {
    bufs.push_back(at::full({1000}, float(k + r), at::kFloat));
    works.push_back(c->all_reduce_async(bufs.back(), ReduceOp::kSum));
  }
  auto gathered = at::zeros({4 * n}, at::kFloat);
  auto mine = at::full({4}, float(r), at::kFloat);
  auto ag = c->all_gather_async(gathered, mine);
  auto bar = c->barrier_async();
  for (int k = 5; k >= 0; --k) {
    works[k]->wait();
    CHECK(works[k]->is_completed());
    CHECK(bufs[k][0].item<float>() == float(k * n + n * (n - 1) / 2));
  }
  ag->wait();
  for (int q = 0; q < n; ++q) CHECK(gathered[4 * q].item<float>() == float(q));
  bar->wait();
  CHECK(bar->is_completed());
}

TEST_CASE("collectives of different groups progress concurrently: issue order may differ across groups") {
  // MPI orders collectives per communicator only. Rank 0 issues A's all-reduce first, every other
  // rank B's first: a progress thread that finished one collective before starting the next would
  // wait for A on rank 0 while rank 1 waits for B, forever (CTest's time limit ends that).
  auto a = test::world("a");
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  auto b = make_communicator(Backend::kMpi, dup, "b");
  const int n = a->size(), r = a->rank();
  auto ta = at::full({1 << 16}, float(r + 1), at::kFloat), tb = at::full({1 << 16}, float(2 * (r + 1)), at::kFloat);
  WorkHandle wa, wb;
  if (r == 0) {
    wa = a->all_reduce_async(ta, ReduceOp::kSum);
    wb = b->all_reduce_async(tb, ReduceOp::kSum);
  } else {
    wb = b->all_reduce_async(tb, ReduceOp::kSum);
    wa = a->all_reduce_async(ta, ReduceOp::kSum);
  }
  wb->wait();
  wa->wait();
  CHECK(ta[0].item<float>() == float(n * (n + 1) / 2));
  CHECK(tb[(1 << 16) - 1].item<float>() == float(n * (n + 1)));
}

TEST_CASE("bad arguments are rejected with the communicator's name") {
  auto c = test::world("world");
  auto big = at::zeros({3 * c->size() + 1}, at::kFloat);
  auto small = at::zeros({3}, at::kFloat);
  CHECK_THROWS_WITH(c->all_gather(big, small), Catch::Contains("world.all_gather"));
  CHECK_THROWS_WITH(c->all_gather(at::zeros({3 * c->size()}, at::kDouble), small), Catch::Contains("dtype"));
  CHECK_THROWS_WITH(c->all_reduce(at::zeros({4, 4}).t(), ReduceOp::kSum), Catch::Contains("contiguous"));
  CHECK_THROWS_WITH(c->broadcast(small, c->size()), Catch::Contains("root"));
}

TEST_CASE("process groups: one communicator per mesh group, reductions stay inside the group") {
  const int world_size = MpiEnv::world_size();
  MeshShape s;
  if (world_size == 4) s = MeshShape{1, 2, 1, 2};  // dp_shard 2 x tp 2
  else if (world_size == 2) s = MeshShape{1, 1, 1, 2};
  else s = MeshShape{1, int64_t(world_size), 1, 1};
  DeviceMesh mesh(s, MpiEnv::world_rank());
  ProcessGroups pg(mesh, Backend::kMpi);
  for (int g = 0; g < kNumMeshGroups; ++g) {
    auto group = static_cast<MeshGroup>(g);
    Communicator& c = pg.get(group);
    INFO(to_string(group));
    CHECK(c.size() == mesh.group_size(group));
    CHECK(c.rank() == mesh.group_rank(group));
    CHECK(c.world_ranks() == mesh.group_ranks(group));
    // Sum of world ranks over the group equals the sum of its members.
    auto x = at::full({2}, int64_t(mesh.rank()), at::kLong);
    c.all_reduce(x, ReduceOp::kSum);
    int64_t expected = 0;
    for (int m : mesh.group_ranks(group)) expected += m;
    CHECK(x[0].item<int64_t>() == expected);
  }
}

TEST_CASE("send_recv: a ring shift, every dtype, synchronous and overlapped") {
  auto c = test::world("world");
  const int n = c->size(), r = c->rank();
  for (auto t : kTypes) {
    INFO(c10::toString(t));
    at::Tensor mine = values(9, r, t), got = at::empty({9}, mine.options());
    c->send_recv(mine, (r + 1) % n, got, (r - 1 + n) % n);
    CHECK(same(got, values(9, (r - 1 + n) % n, t)));
  }
  // Two exchanges in flight while the caller computes: both land.
  at::Tensor a = values(1000, r, at::kFloat), b = values(10, r, at::kFloat, 3);
  at::Tensor ra = at::empty_like(a), rb = at::empty_like(b);
  auto w1 = c->send_recv_async(a, (r + 1) % n, ra, (r - 1 + n) % n);
  auto w2 = c->send_recv_async(b, (r - 1 + n) % n, rb, (r + 1) % n);
  at::Tensor busy = at::mm(at::ones({64, 64}), at::ones({64, 64}));
  w1->wait();
  w2->wait();
  CHECK(same(ra, values(1000, (r - 1 + n) % n, at::kFloat)));
  CHECK(same(rb, values(10, (r + 1) % n, at::kFloat, 3)));
  CHECK(busy[0][0].item<float>() == 64.0f);
  CHECK_THROWS_WITH(c->send_recv(a, n, ra, 0), Catch::Contains("not in a group of"));
}

TEST_CASE("MPI start-up requires MPI_THREAD_MULTIPLE (the progress thread and watchdog call MPI concurrently)") {
  REQUIRE_NOTHROW(mfsdp::MpiEnv::require_thread_multiple(MPI_THREAD_MULTIPLE));
  REQUIRE_THROWS_WITH(mfsdp::MpiEnv::require_thread_multiple(MPI_THREAD_SERIALIZED),
                      Catch::Contains("provides only MPI_THREAD_SERIALIZED") && Catch::Contains("MPI_THREAD_MULTIPLE"));
  REQUIRE_THROWS(mfsdp::MpiEnv::require_thread_multiple(MPI_THREAD_FUNNELED));
}

// GPU runs route each call by its tensors' device (communicator.h): CPU tensors to the host (MPI)
// communicator, others to the device communicator. Here both are MPI communicators under their
// own names, and a meta tensor stands in for a device tensor: the device communicator is the one
// that receives it (and, being MPI, rejects it under its own name), while CPU tensors, the barrier
// and the control-value helpers go through the host communicator.
TEST_CASE("routing communicator: CPU tensors to the host communicator, device tensors to the device one") {
  auto routed = make_routing_communicator(test::world("ctl"), test::world("dev"));
  Communicator& c = *routed;
  CHECK(c.name() == "ctl");
  CHECK(c.backend() == Backend::kMpi);
  at::Tensor t = at::full({3}, double(c.rank() + 1), at::kDouble);
  c.all_reduce(t, ReduceOp::kSum);
  CHECK(t[0].item<double>() == double(c.size() * (c.size() + 1) / 2));
  c.barrier();
  auto names = all_gather_strings(c, "rank" + std::to_string(c.rank()));
  CHECK(names.size() == size_t(c.size()));
  at::Tensor dev = at::empty({3}, at::TensorOptions().dtype(at::kFloat).device(at::kMeta));
  try {
    c.all_reduce(dev, ReduceOp::kSum);
    FAIL("a meta tensor reached a CPU communicator");
  } catch (const std::invalid_argument& e) {
    CHECK_THAT(e.what(), Catch::Matchers::Contains("dev.all_reduce") && Catch::Matchers::Contains("meta"));
  }
  CHECK_THROWS_WITH(c.register_buffer(at::zeros({4})), Catch::Matchers::Contains("ctl: distributed.nccl_ub registers"));
}
