// The NCCL backend (CUDA tensors). Compiled into the CUDA plugin when the LibTorch found has CUDA
// (the torch wheel does); see the top-level CMakeLists.txt and device/cuda_plugin.h.
//
// Each communicator owns two lanes (communicator + CUDA stream from torch's pool; see Lane). A
// collective first orders its lane's stream
// after the work already queued on the caller's stream -- torch's *current* stream, which is what
// the caller's kernels run on (not the legacy default stream) -- then runs, then records a
// completion event. Work::wait() orders the caller's current stream after that event without
// blocking the host, as c10d's ProcessGroupNCCL does; is_completed() queries the event. Both first
// ask NCCL for an asynchronous error of the communicator and throw it.
//
// Lifetime: the work object holds every tensor the collective reads or writes until wait() (c10d
// keeps them referenced the same way since it stopped using record_stream): a caller that drops
// its last reference to an input right after launching (the barrier's scratch tensor, a gradient
// buffer) cannot hand the memory back to the caching allocator while NCCL still uses it. After
// wait() the caller's stream is ordered after the collective, so freeing on that stream is safe.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include "comm/communicator.h"
#include "device/cuda_plugin.h"
#include "comm/flight_recorder.h"
#include "comm/mpi_env.h"

namespace mfsdp {
namespace {

void cuda_check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorString(e));
}
void nccl_check(ncclResult_t r, const std::string& what) {
  if (r != ncclSuccess) throw std::runtime_error(what + ": " + ncclGetErrorString(r));
}

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: throw std::invalid_argument(std::string("the NCCL backend does not carry dtype ") + c10::toString(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

// The stream the caller computes on: torch's current stream of the current device.
cudaStream_t caller_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

class NcclWork final : public Work {
 public:
  NcclWork(cudaEvent_t done, ncclComm_t comm, std::string what, std::vector<at::Tensor> tensors)
      : done_(done), comm_(comm), what_(std::move(what)), tensors_(std::move(tensors)) {}
  ~NcclWork() override {
    // Never let memory go back to the allocator while the collective may still use it.
    if (!tensors_.empty()) cudaStreamWaitEvent(caller_stream(), done_, 0);
    cudaEventDestroy(done_);
  }
  void wait() override {
    check_async_error();
    cuda_check(cudaStreamWaitEvent(caller_stream(), done_, 0), what_ + ": cudaStreamWaitEvent");
    tensors_.clear();
  }
  bool is_completed() override {
    check_async_error();
    return event_done();
  }
  // The completion event has fired (no error check: the watchdog's probe).
  bool event_done() const { return cudaEventQuery(done_) == cudaSuccess; }

 private:
  void check_async_error() const {
    ncclResult_t async = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(comm_, &async), what_ + ": ncclCommGetAsyncError");
    if (async != ncclSuccess && async != ncclInProgress)
      throw std::runtime_error(what_ + " failed: " + ncclGetErrorString(async) + " (" + ncclGetLastError(comm_) + ")");
  }
  cudaEvent_t done_;
  ncclComm_t comm_;
  std::string what_;
  std::vector<at::Tensor> tensors_;
};

// One NCCL communicator and the stream its collectives run on: a lane. A group has two (DESIGN.md
// section 11): all-gathers and broadcasts on one, reductions and point-to-point on the other, each
// its own communicator split from the first, so that the next unit's weight all-gather can run
// while the current unit's gradient reduce-scatter does (one communicator runs its collectives in
// issue order whatever stream they are on, so one communicator on two streams would not overlap).
struct Lane {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
};

class NcclCommunicator final : public Communicator {
 public:
  // The world: the unique id made on rank 0 and broadcast over MPI.
  explicit NcclCommunicator(std::string name)
      : Communicator(std::move(name), MpiEnv::world_rank(), MpiEnv::world_size(), iota(MpiEnv::world_size())) {
    check_device();
    ncclUniqueId id;
    if (rank() == 0) nccl_check(ncclGetUniqueId(&id), this->name() + ": ncclGetUniqueId");
    if (MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
      throw std::runtime_error(this->name() + ": broadcasting the NCCL unique id over MPI failed");
    nccl_check(ncclCommInitRank(&gather_.comm, size(), id, rank()), this->name() + ": ncclCommInitRank");
    finish_lanes();
  }
  // A group split from `parent` (collective over the parent's members).
  NcclCommunicator(const NcclCommunicator& parent, int color, int key, std::string name, std::vector<int> members)
      : Communicator(std::move(name), key, int(members.size()), members) {
    nccl_check(ncclCommSplit(parent.gather_.comm, color, key, &gather_.comm, nullptr), this->name() + ": ncclCommSplit");
    finish_lanes();
  }
  ~NcclCommunicator() override {
    for (auto& r : registered_) ncclCommDeregister(gather_.comm, r.handle);
    for (Lane* l : {&reduce_, &gather_})
      if (l->comm) ncclCommDestroy(l->comm);  // the pool streams belong to torch
  }
  Backend backend() const override { return Backend::kNccl; }

  WorkHandle all_gather_async(const at::Tensor& out, const at::Tensor& in) override {
    check_gather_pair(out, in, "all_gather");
    check_cuda(in, "all_gather");
    return launch(gather_, "all_gather", {out, in}, [&](Lane& l) {
      nccl_check(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), nccl_type(in.scalar_type()), l.comm, l.stream),
                 name() + ": ncclAllGather");
    });
  }
  WorkHandle reduce_scatter_async(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    check_gather_pair(in, out, "reduce_scatter");
    check_cuda(in, "reduce_scatter");
    return launch(reduce_, "reduce_scatter", {out, in}, [&](Lane& l) {
      nccl_check(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_type(in.scalar_type()),
                                   nccl_op(op), l.comm, l.stream),
                 name() + ": ncclReduceScatter");
    });
  }
  WorkHandle all_reduce_async(const at::Tensor& t, ReduceOp op) override {
    check_tensor(t, "the", "all_reduce");
    check_cuda(t, "all_reduce");
    return launch(reduce_, "all_reduce", {t}, [&](Lane& l) {
      nccl_check(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), nccl_op(op), l.comm,
                               l.stream),
                 name() + ": ncclAllReduce");
    });
  }
  WorkHandle broadcast_async(const at::Tensor& t, int root) override {
    check_tensor(t, "the", "broadcast");
    check_cuda(t, "broadcast");
    return launch(gather_, "broadcast", {t}, [&](Lane& l) {
      nccl_check(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), root, l.comm, l.stream),
                 name() + ": ncclBroadcast");
    });
  }
  WorkHandle send_recv_async(const at::Tensor& send, int dst, const at::Tensor& recv, int src) override {
    check_tensor(send, "the sent", "send_recv");
    check_tensor(recv, "the received", "send_recv");
    check_cuda(send, "send_recv");
    check_cuda(recv, "send_recv");
    return launch(reduce_, "send_recv", {send, recv}, [&](Lane& l) {
      nccl_check(ncclGroupStart(), name() + ": ncclGroupStart");
      nccl_check(ncclSend(send.data_ptr(), send.numel(), nccl_type(send.scalar_type()), dst, l.comm, l.stream),
                 name() + ": ncclSend");
      nccl_check(ncclRecv(recv.data_ptr(), recv.numel(), nccl_type(recv.scalar_type()), src, l.comm, l.stream),
                 name() + ": ncclRecv");
      nccl_check(ncclGroupEnd(), name() + ": ncclGroupEnd");
    });
  }
  WorkHandle barrier_async() override {
    // NCCL has no barrier: a one-element all-reduce orders every member, as c10d does. The work
    // object keeps the scratch tensor alive until it is waited for.
    auto dummy = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
    return all_reduce_async(dummy, ReduceOp::kSum);
  }
  // distributed.nccl_ub: the persistent double buffers, which the weight all-gathers write into,
  // registered once with the gather lane's communicator (zero-copy transports where NCCL has them;
  // NCCL keeps its own copy path for buffers it cannot use). Deregistered with the communicator.
  void register_buffer(const at::Tensor& t) override {
    check_cuda(t, "register_buffer");
    void* handle = nullptr;
    nccl_check(ncclCommRegister(gather_.comm, t.data_ptr(), t.nbytes(), &handle), name() + ": ncclCommRegister");
    registered_.push_back({handle, t});
  }

 private:
  static std::vector<int> iota(int n) {
    std::vector<int> v(n);
    for (int i = 0; i < n; ++i) v[i] = i;
    return v;
  }
  void check_device() {
    int ndev = 0;
    cuda_check(cudaGetDeviceCount(&ndev), name() + ": cudaGetDeviceCount");
    if (ndev == 0) throw std::runtime_error(name() + ": the NCCL backend needs a GPU and this node has none");
  }
  // The reduce lane is split from the gather lane (same members, same order); each lane gets a
  // stream from torch's pool of the current device (select_device set it before any of this).
  void finish_lanes() {
    cuda_check(cudaGetDevice(&device_), name() + ": cudaGetDevice");
    nccl_check(ncclCommSplit(gather_.comm, 0, rank(), &reduce_.comm, nullptr), name() + ": ncclCommSplit (reduce lane)");
    gather_.stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, c10::DeviceIndex(device_)).stream();
    reduce_.stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, c10::DeviceIndex(device_)).stream();
  }

  // Every collective goes into the flight recorder with this group's next sequence number; the
  // watchdog polls its completion event, and aborts both lanes' communicators if it hangs past the
  // timeout (an abort of one would leave the other's peers waiting).
  template <class F>
  WorkHandle launch(Lane& lane, const char* op, std::vector<at::Tensor> tensors, F&& body) {
    auto& rec = FlightRecorder::instance();
    const at::Tensor& first = tensors.front();
    const uint64_t h = rec.begin(op, name(), world_ranks(), ++seq_, first.numel(), c10::toString(first.scalar_type()));
    // The lane's stream waits for what the caller's stream has queued so far (the producer of the
    // input, and the last reader of the output buffer): an event, not a host wait.
    cudaEvent_t ready, done;
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(ready, caller_stream()), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(lane.stream, ready, 0), "cudaStreamWaitEvent");
    cudaEventDestroy(ready);  // released once recorded work completes
    body(lane);
    cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(done, lane.stream), "cudaEventRecord");
    auto work = std::make_shared<NcclWork>(done, lane.comm, name() + "." + op, std::move(tensors));
    // The probe holds the work (its event outlives the caller's handle); the device is set again on
    // the watchdog thread.
    const int device = device_;
    ncclComm_t a = gather_.comm, b = reduce_.comm;
    rec.watch(
        h,
        [work, device] {
          cudaSetDevice(device);
          return work->event_done();
        },
        [a, b] {
          ncclCommAbort(a);
          ncclCommAbort(b);
        });
    return work;
  }
  void check_cuda(const at::Tensor& t, const char* op) const {
    if (!t.device().is_cuda())
      throw std::invalid_argument(name() + "." + op + ": the NCCL backend takes CUDA tensors, got " + t.device().str());
  }
  Lane gather_, reduce_;
  int device_ = 0;
  uint64_t seq_ = 0;
  struct Registered {
    void* handle;
    at::Tensor keep;  // registered memory must stay allocated until deregistered
  };
  std::vector<Registered> registered_;

};

}  // namespace

// The plugin's side of communicator.h (cuda_plugin.h: why these are not the same names).
std::unique_ptr<Communicator> cuda_plugin::make_nccl_communicator(MPI_Comm comm, std::string name, int rank, int size,
                                                     std::vector<int> world_ranks) {
  // Only the world is bootstrapped through MPI; every other group is split from a world.
  if (comm != MPI_COMM_WORLD) MPI_Comm_free(&comm);
  if (size != MpiEnv::world_size())
    throw std::logic_error(name + ": NCCL groups other than the world are made with make_nccl_split");
  return std::make_unique<NcclCommunicator>(std::move(name));
}

std::unique_ptr<Communicator> cuda_plugin::make_nccl_world(std::string name) { return std::make_unique<NcclCommunicator>(std::move(name)); }

std::unique_ptr<Communicator> cuda_plugin::make_nccl_split(Communicator& world, int color, int key, std::string name,
                                              std::vector<int> members) {
  auto* parent = dynamic_cast<NcclCommunicator*>(&world);
  if (!parent) throw std::logic_error(name + ": make_nccl_split needs an NCCL parent communicator");
  return std::make_unique<NcclCommunicator>(*parent, color, key, std::move(name), std::move(members));
}

}  // namespace mfsdp
