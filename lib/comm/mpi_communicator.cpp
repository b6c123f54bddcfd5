// The MPI backend (CPU tensors). Collectives run on the progress thread as nonblocking MPI calls.
// bf16 and fp16 have no MPI type: they travel as 16-bit words and are reduced by user-defined MPI
// ops that widen to float, combine and round back (MPI_SUM on uint16 would be an integer sum).
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "comm/progress_thread.h"
#include "util/error.h"

namespace mfsdp {
namespace {

template <class T, bool kMax>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
    b[i] = static_cast<T>(kMax ? std::max(x, y) : x + y);
  }
}

struct Ops16 {
  MPI_Op bf16_sum, bf16_max, fp16_sum, fp16_max;
  Ops16() {
    MPI_Op_create(&reduce16<c10::BFloat16, false>, 1, &bf16_sum);
    MPI_Op_create(&reduce16<c10::BFloat16, true>, 1, &bf16_max);
    MPI_Op_create(&reduce16<c10::Half, false>, 1, &fp16_sum);
    MPI_Op_create(&reduce16<c10::Half, true>, 1, &fp16_max);
  }
};

const Ops16& ops16() {
  static Ops16 ops;  // created after MPI_Init, on first use; freed by MPI_Finalize
  return ops;
}

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kBFloat16:
    case at::kHalf: return MPI_UINT16_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kChar: return MPI_INT8_T;
    case at::kBool: return MPI_C_BOOL;
    default:
      throw std::invalid_argument(std::string("the MPI backend does not carry dtype ") + c10::toString(t));
  }
}

MPI_Op mpi_op(ReduceOp op, at::ScalarType t) {
  const bool max = op == ReduceOp::kMax;
  if (t == at::kBFloat16) return max ? ops16().bf16_max : ops16().bf16_sum;
  if (t == at::kHalf) return max ? ops16().fp16_max : ops16().fp16_sum;
  if (t == at::kBool || t == at::kByte || t == at::kChar)
    if (!max) throw std::invalid_argument(std::string("sum/avg reductions of ") + c10::toString(t) + " are not supported");
  return max ? MPI_MAX : MPI_SUM;
}

// AVG = SUM then divide. Integers divide with truncation, as NCCL's ncclAvg does.
void finish_avg(const at::Tensor& t, int n) {
  if (at::isFloatingType(t.scalar_type())) t.div_(n);
  else t.div_(n, "trunc");
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, int rank, int size, std::vector<int> world_ranks)
      : Communicator(std::move(name), rank, size, std::move(world_ranks)), comm_(comm) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    ops16();
  }
  ~MpiCommunicator() override {
    if (comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_NULL) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Comm_free(&comm_);
    }
  }
  Backend backend() const override { return Backend::kMpi; }

  WorkHandle all_gather_async(const at::Tensor& out, const at::Tensor& in) override {
    check_gather_pair(out, in, "all_gather");
    check_cpu(out, "all_gather");
    if (size() == 1 || in.numel() == 0) {
      if (out.data_ptr() != in.data_ptr()) out.copy_(in);
      return done();
    }
    auto dt = mpi_type(in.scalar_type());
    int n = static_cast<int>(in.numel());
    // Gathering in place (the input is this rank's slice of the output) is MPI_IN_PLACE.
    bool in_place = in.data_ptr() == static_cast<char*>(out.data_ptr()) + size_t(rank()) * in.nbytes();
    return submit("all_gather", out.numel(), in.scalar_type(), [=](std::vector<MPI_Request>& reqs) {
      check(MPI_Iallgather(in_place ? MPI_IN_PLACE : in.data_ptr(), n, dt, out.data_ptr(), n, dt, comm_,
                           &reqs.emplace_back()),
            "MPI_Iallgather");
    });
  }

  // A ring of point-to-point rounds, not MPI_Ireduce_scatter_block: Open MPI's nonblocking
  // reduce-scatter (libnbc) reduces the whole input to rank 0 along a binomial tree and then
  // scatters it, with a temporary of twice the input on every rank that receives (for a
  // strategy-3 unit at 4 ranks, 8 times the shard: 250 MiB for a 32000 x 1024 fp32 head) and rank
  // 0 doing log2(p) full-size reductions and all the sending. The ring sends and reduces one block
  // per round over p - 1 rounds, so every rank moves (p - 1)/p of the input once and the only
  // temporary is one block. Round s: rank r sends the partial sum of block (r - s - 1) mod p to
  // rank r + 1 (in round 0 its own block of the input), receives the partial sum of block
  // (r - s - 2) mod p from rank r - 1 and adds its own block to it; after round p - 2 it holds the
  // full sum of block r. The received partials alternate between `out` and the temporary so that
  // the last one lands in `out`. Each reduce-scatter has a tag of its own (its sequence number on
  // this communicator, the same on every rank), so that rounds of two reduce-scatters in flight
  // together never match each other's messages. Summation order for block b: ranks b+1, b+2, ...,
  // b; fixed for a layout, so runs are reproducible.
  WorkHandle reduce_scatter_async(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    check_gather_pair(in, out, "reduce_scatter");
    check_cpu(in, "reduce_scatter");
    if (size() == 1 || out.numel() == 0) {
      if (out.data_ptr() != in.data_ptr()) out.copy_(in);
      return done();
    }
    if (!in.is_contiguous() || !out.is_contiguous())
      throw std::invalid_argument(name() + ".reduce_scatter: the MPI backend takes contiguous tensors");
    auto dt = mpi_type(in.scalar_type());
    auto mop = mpi_op(op, in.scalar_type());
    const int n = static_cast<int>(out.numel());
    const int p = size(), r = rank();
    const int right = (r + 1) % p, left = (r + p - 1) % p;
    const size_t block_bytes = size_t(n) * in.element_size();
    auto block = [in, block_bytes](int b) { return static_cast<char*>(in.data_ptr()) + size_t(b) * block_bytes; };
    // `out` inside `in` (in place): the partials must not overwrite this rank's own block, so both
    // alternating buffers are temporaries and the last one is added into `out` at the end.
    const char* ob = static_cast<const char*>(out.data_ptr());
    const bool aliased = ob < block(p) && ob + block_bytes > block(0);
    at::Tensor t0 = at::empty_like(out), t1 = aliased ? at::empty_like(out) : out;
    const int tag = kRingTagBase + static_cast<int>((seq_ + 1) % kRingTags);
    auto round = std::make_shared<int>(0);
    // Buffer the partial of round s is received into: the last round's is t1 (`out` unless aliased).
    auto recv_buf = [=](int s) { return ((p - 2 - s) % 2 == 0 ? t1 : t0).data_ptr(); };
    auto post = [=](std::vector<MPI_Request>& reqs, int s) {
      const void* send = s == 0 ? block(((r - 1) % p + p) % p) : recv_buf(s - 1);
      check(MPI_Irecv(recv_buf(s), n, dt, left, tag, comm_, &reqs.emplace_back()), "MPI_Irecv");
      check(MPI_Isend(send, n, dt, right, tag, comm_, &reqs.emplace_back()), "MPI_Isend");
    };
    auto next = [=](std::vector<MPI_Request>& reqs) {
      const int s = (*round)++;
      const int b = ((r - s - 2) % p + p) % p;  // the block whose partial just arrived
      if (aliased && s == p - 2) {
        check(MPI_Reduce_local(recv_buf(s), out.data_ptr(), n, dt, mop), "MPI_Reduce_local");
      } else {
        check(MPI_Reduce_local(block(b), recv_buf(s), n, dt, mop), "MPI_Reduce_local");
      }
      if (s == p - 2) return false;
      post(reqs, s + 1);
      return true;
    };
    const int world = p;
    return submit("reduce_scatter", in.numel(), in.scalar_type(),
                  [=](std::vector<MPI_Request>& reqs) { post(reqs, 0); },
                  [=] { if (op == ReduceOp::kAvg) finish_avg(out, world); }, next);
  }

  // Small tensors (the loss sums, norms, flags: under kRingAllReduceBytes) go to MPI_Iallreduce, one
  // call. Larger ones (gradient buckets without sharding, HSDP's replicas, tensor parallelism's
  // activations) take a ring in place: p - 1 rounds of reduce-scatter, then p - 1 rounds of
  // all-gather, over p blocks of t (the first n % p one element longer). Why: Open MPI's
  // nonblocking all-reduce (libnbc) took 5-9x the time of the ring reduce-scatter of the same bytes
  // on 2 ranks (bench-comm, 4-16 MiB: 1.7 / 22.5 ms against 0.78 / 2.4 ms). In a 2-process step on
  // 2 cores the wait at the end of backward halved (13 to 7 ms) but the step time did not move: the
  // reduction's work shares the cores with the compute (bench/results_train_step.md). The reduce-scatter rounds
  // are reduce_scatter_async's (above), in place: in round s rank r sends its partial of block
  // (r - s - 1) mod p, receives the partial of block (r - s - 2) mod p into one temporary block and
  // adds it into that block of t; after round p - 2 it holds block r's full sum, in the same
  // summation order as reduce_scatter_async's (a bucket reduced whole equals its reduce-scattered
  // shards bit for bit). All-gather round s: rank r sends block (r - s) mod p, receives block
  // (r - s - 1) mod p straight into t. Each all-reduce has a tag of its own, as the reduce-scatters.
  WorkHandle all_reduce_async(const at::Tensor& t, ReduceOp op) override {
    check_tensor(t, "the", "all_reduce");
    check_cpu(t, "all_reduce");
    if (size() == 1 || t.numel() == 0) return done();
    auto dt = mpi_type(t.scalar_type());
    auto mop = mpi_op(op, t.scalar_type());
    int n = static_cast<int>(t.numel());
    int world = size();
    auto finish = [=] { if (op == ReduceOp::kAvg) finish_avg(t, world); };
    if (t.nbytes() < kRingAllReduceBytes || n < world) {
      return submit("all_reduce", t.numel(), t.scalar_type(), [=](std::vector<MPI_Request>& reqs) {
        check(MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), n, dt, mop, comm_, &reqs.emplace_back()), "MPI_Iallreduce");
      }, finish);
    }
    const int p = world, r = rank();
    const int right = (r + 1) % p, left = (r + p - 1) % p;
    const size_t elem = t.element_size();
    auto len = [=](int b) { return n / p + (b < n % p ? 1 : 0); };
    auto off = [=](int b) { return size_t(b) * size_t(n / p) + size_t(std::min(b, n % p)); };
    auto block = [=](int b) { return static_cast<char*>(t.data_ptr()) + off(b) * elem; };
    auto mod = [p](int x) { return ((x % p) + p) % p; };
    at::Tensor tmp = at::empty({len(0)}, t.options());  // block 0 is a longest one
    const int tag = kRingTagBase + static_cast<int>((seq_ + 1) % kRingTags);
    auto round = std::make_shared<int>(0);
    // Round s < p - 1: reduce-scatter; p - 1 <= s < 2 (p - 1): all-gather round s - (p - 1).
    auto post = [=](std::vector<MPI_Request>& reqs, int s) {
      int send_b, recv_b;
      void* into;
      if (s < p - 1) {
        send_b = mod(r - s - 1), recv_b = mod(r - s - 2), into = tmp.data_ptr();
      } else {
        const int a = s - (p - 1);
        send_b = mod(r - a), recv_b = mod(r - a - 1), into = block(recv_b);
      }
      check(MPI_Irecv(into, len(recv_b), dt, left, tag, comm_, &reqs.emplace_back()), "MPI_Irecv");
      check(MPI_Isend(block(send_b), len(send_b), dt, right, tag, comm_, &reqs.emplace_back()), "MPI_Isend");
    };
    auto next = [=](std::vector<MPI_Request>& reqs) {
      const int s = (*round)++;
      if (s < p - 1) {  // the partial of block (r - s - 2) arrived: add it into that block
        const int b = mod(r - s - 2);
        check(MPI_Reduce_local(tmp.data_ptr(), block(b), len(b), dt, mop), "MPI_Reduce_local");
      }
      if (s == 2 * (p - 1) - 1) return false;
      post(reqs, s + 1);
      return true;
    };
    return submit("all_reduce", t.numel(), t.scalar_type(), [=](std::vector<MPI_Request>& reqs) { post(reqs, 0); },
                  finish, next);
  }

  WorkHandle broadcast_async(const at::Tensor& t, int root) override {
    check_tensor(t, "the", "broadcast");
    check_cpu(t, "broadcast");
    if (root < 0 || root >= size())
      throw std::invalid_argument(name() + ".broadcast: root " + std::to_string(root) + " is not in a group of " +
                                  std::to_string(size()));
    if (size() == 1 || t.numel() == 0) return done();
    auto dt = mpi_type(t.scalar_type());
    int n = static_cast<int>(t.numel());
    return submit("broadcast", t.numel(), t.scalar_type(), [=](std::vector<MPI_Request>& reqs) {
      check(MPI_Ibcast(t.data_ptr(), n, dt, root, comm_, &reqs.emplace_back()), "MPI_Ibcast");
    });
  }

  WorkHandle send_recv_async(const at::Tensor& send, int dst, const at::Tensor& recv, int src) override {
    check_tensor(send, "the sent", "send_recv");
    check_tensor(recv, "the received", "send_recv");
    check_cpu(send, "send_recv");
    check_cpu(recv, "send_recv");
    if (dst < 0 || dst >= size() || src < 0 || src >= size())
      throw std::invalid_argument(name() + ".send_recv: peers " + std::to_string(dst) + "/" + std::to_string(src) +
                                  " are not in a group of " + std::to_string(size()));
    if (send.scalar_type() != recv.scalar_type())
      throw std::invalid_argument(name() + ".send_recv: sent and received dtypes differ");
    if (dst == rank() && src == rank()) {
      if (recv.data_ptr() != send.data_ptr()) recv.copy_(send);
      return done();
    }
    auto dt = mpi_type(send.scalar_type());
    int ns = static_cast<int>(send.numel()), nr = static_cast<int>(recv.numel());
    return submit("send_recv", send.numel(), send.scalar_type(), [=](std::vector<MPI_Request>& reqs) {
      constexpr int kTag = 7301;
      check(MPI_Irecv(recv.data_ptr(), nr, dt, src, kTag, comm_, &reqs.emplace_back()), "MPI_Irecv");
      check(MPI_Isend(send.data_ptr(), ns, dt, dst, kTag, comm_, &reqs.emplace_back()), "MPI_Isend");
    });
  }

  WorkHandle barrier_async() override {
    if (size() == 1) return done();
    return submit("barrier", 0, at::kByte, [=](std::vector<MPI_Request>& reqs) {
      check(MPI_Ibarrier(comm_, &reqs.emplace_back()), "MPI_Ibarrier");
    });
  }

 private:
  static WorkHandle done() { return std::make_shared<CompletedWork>(); }
  // `start` issues the nonblocking calls on the progress thread; `after` runs there once they
  // completed. The lambdas hold copies of the tensors, so their storage lives as long as the work.
  // Every collective goes into the flight recorder with this group's next sequence number, ended
  // when it completes or fails.
  WorkHandle submit(const char* op, int64_t numel, at::ScalarType dtype, QueuedWork::Start start,
                    std::function<void()> after = {}, QueuedWork::Next next = {}) {
    auto& rec = FlightRecorder::instance();
    const uint64_t h = rec.begin(op, name(), world_ranks(), ++seq_, numel, c10::toString(dtype));
    return ProgressThread::instance().submit_mpi(
        op, std::move(start), [after = std::move(after), h, &rec](bool ok) {
          rec.end(h);
          if (ok && after) after();
        }, std::move(next));
  }
  void check(int rc, const char* call) const {
    if (rc == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw std::runtime_error(name() + ": " + call + " failed: " + std::string(msg, len));
  }
  void check_cpu(const at::Tensor& t, const char* op) const {
    if (!t.device().is_cpu())
      throw std::invalid_argument(name() + "." + op + ": the MPI backend takes CPU tensors, got " + t.device().str());
  }
  // Tags of the rings' rounds (reduce-scatter, all-reduce): clear of send_recv's tag (7301) and within the
  // 32767 that MPI guarantees as MPI_TAG_UB.
  static constexpr int kRingTagBase = 10000, kRingTags = 16384;
  // From this size on, all_reduce takes the ring: on 2 ranks (bench-comm, 2026-12-07) MPI_Iallreduce
  // was as fast or faster up to 512 KiB (216-308 against 284-404 us at 64-256 KiB), the ring faster
  // from 1 MiB (395-574 against 498-900 us; 4 MiB 0.85-2.3 against 3.3-4.3 ms).
  static constexpr size_t kRingAllReduceBytes = 1 << 20;
  MPI_Comm comm_;
  uint64_t seq_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, std::string name, int rank, int size,
                                                     std::vector<int> world_ranks);

std::unique_ptr<Communicator> make_communicator(Backend backend, MPI_Comm comm, std::string name) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  // The world rank of every member, so that logs and flight records can name peers.
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  std::vector<int> world_ranks(size);
  MPI_Allgather(&me, 1, MPI_INT, world_ranks.data(), 1, MPI_INT, comm);
  if (backend == Backend::kNccl) return make_nccl_communicator(comm, std::move(name), rank, size, std::move(world_ranks));
  return std::make_unique<MpiCommunicator>(comm, std::move(name), rank, size, std::move(world_ranks));
}

}  // namespace mfsdp
