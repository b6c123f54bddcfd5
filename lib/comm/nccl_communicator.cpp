// The NCCL backend (CUDA tensors). Compiled when the LibTorch found has CUDA (the torch wheel
// does); see the top-level CMakeLists.txt. Built and linked here, not yet run on a GPU.
//
// Each communicator owns a CUDA stream from torch's pool. A collective first orders that stream
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

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(MPI_Comm comm, std::string name, int rank, int size, std::vector<int> world_ranks)
      : Communicator(std::move(name), rank, size, std::move(world_ranks)) {
    // One GPU per local rank (ranks beyond the GPU count share them round-robin).
    int ndev = 0;
    cuda_check(cudaGetDeviceCount(&ndev), this->name() + ": cudaGetDeviceCount");
    if (ndev == 0) throw std::runtime_error(this->name() + ": the NCCL backend needs a GPU and this node has none");
    cuda_check(cudaSetDevice(MpiEnv::local_rank() % ndev), this->name() + ": cudaSetDevice");
    ncclUniqueId id;
    if (rank == 0) nccl_check(ncclGetUniqueId(&id), this->name() + ": ncclGetUniqueId");
    if (MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm) != MPI_SUCCESS)
      throw std::runtime_error(this->name() + ": broadcasting the NCCL unique id over MPI failed");
    nccl_check(ncclCommInitRank(&comm_, size, id, rank), this->name() + ": ncclCommInitRank");
    stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true).stream();
    if (comm != MPI_COMM_WORLD) MPI_Comm_free(&comm);
  }
  ~NcclCommunicator() override { ncclCommDestroy(comm_); }  // pool streams belong to torch
  Backend backend() const override { return Backend::kNccl; }

  WorkHandle all_gather_async(const at::Tensor& out, const at::Tensor& in) override {
    check_gather_pair(out, in, "all_gather");
    check_cuda(in, "all_gather");
    return launch("all_gather", {out, in}, [&] {
      nccl_check(ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), nccl_type(in.scalar_type()), comm_, stream_),
                 name() + ": ncclAllGather");
    });
  }
  WorkHandle reduce_scatter_async(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    check_gather_pair(in, out, "reduce_scatter");
    check_cuda(in, "reduce_scatter");
    return launch("reduce_scatter", {out, in}, [&] {
      nccl_check(ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_type(in.scalar_type()),
                                   nccl_op(op), comm_, stream_),
                 name() + ": ncclReduceScatter");
    });
  }
  WorkHandle all_reduce_async(const at::Tensor& t, ReduceOp op) override {
    check_tensor(t, "the", "all_reduce");
    check_cuda(t, "all_reduce");
    return launch("all_reduce", {t}, [&] {
      nccl_check(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), nccl_op(op), comm_,
                               stream_),
                 name() + ": ncclAllReduce");
    });
  }
  WorkHandle broadcast_async(const at::Tensor& t, int root) override {
    check_tensor(t, "the", "broadcast");
    check_cuda(t, "broadcast");
    return launch("broadcast", {t}, [&] {
      nccl_check(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), root, comm_, stream_),
                 name() + ": ncclBroadcast");
    });
  }
  WorkHandle send_recv_async(const at::Tensor& send, int dst, const at::Tensor& recv, int src) override {
    check_tensor(send, "the sent", "send_recv");
    check_tensor(recv, "the received", "send_recv");
    check_cuda(send, "send_recv");
    check_cuda(recv, "send_recv");
    return launch("send_recv", {send, recv}, [&] {
      nccl_check(ncclGroupStart(), name() + ": ncclGroupStart");
      nccl_check(ncclSend(send.data_ptr(), send.numel(), nccl_type(send.scalar_type()), dst, comm_, stream_),
                 name() + ": ncclSend");
      nccl_check(ncclRecv(recv.data_ptr(), recv.numel(), nccl_type(recv.scalar_type()), src, comm_, stream_),
                 name() + ": ncclRecv");
      nccl_check(ncclGroupEnd(), name() + ": ncclGroupEnd");
    });
  }
  WorkHandle barrier_async() override {
    // NCCL has no barrier: a one-element all-reduce orders every member, as c10d does. The work
    // object keeps the scratch tensor alive until it is waited for.
    auto dummy = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
    return all_reduce_async(dummy, ReduceOp::kSum);
  }

 private:
  // Every collective goes into the flight recorder with this group's next sequence number; the
  // watchdog polls its completion event, and aborts the communicator if it hangs past the timeout.
  template <class F>
  WorkHandle launch(const char* op, std::vector<at::Tensor> tensors, F&& body) {
    auto& rec = FlightRecorder::instance();
    const at::Tensor& first = tensors.front();
    const uint64_t h = rec.begin(op, name(), world_ranks(), ++seq_, first.numel(), c10::toString(first.scalar_type()));
    cudaEvent_t ready, done;
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(ready, caller_stream()), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream_, ready, 0), "cudaStreamWaitEvent");
    cudaEventDestroy(ready);
    body();
    cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    cuda_check(cudaEventRecord(done, stream_), "cudaEventRecord");
    auto work = std::make_shared<NcclWork>(done, comm_, name() + "." + op, std::move(tensors));
    // The probe holds the work (its event outlives the caller's handle); the device is the one this
    // process set at start-up, set again on the watchdog thread.
    int device = 0;
    cudaGetDevice(&device);
    ncclComm_t comm = comm_;
    rec.watch(
        h,
        [work, device] {
          cudaSetDevice(device);
          return work->event_done();
        },
        [comm] { ncclCommAbort(comm); });
    return work;
  }
  void check_cuda(const at::Tensor& t, const char* op) const {
    if (!t.device().is_cuda())
      throw std::invalid_argument(name() + "." + op + ": the NCCL backend takes CUDA tensors, got " + t.device().str());
  }
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  uint64_t seq_ = 0;
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, std::string name, int rank, int size,
                                                     std::vector<int> world_ranks) {
  return std::make_unique<NcclCommunicator>(comm, std::move(name), rank, size, std::move(world_ranks));
}

}  // namespace mfsdp
