// CUDA tensors over the MPI backend, staged through pinned host memory (communicator.h,
// make_staged_communicator). What it is for: 2-4 ranks sharing one GPU in tests, which NCCL
// refuses ("Duplicate GPU detected"); multi-rank sharding, TP and CP then still run on CUDA
// tensors. Not for speed: every collective crosses PCIe twice.
//
// Order of one collective, none of it blocking the caller's thread:
//   caller's stream:  ...producer kernels | D2H copy of the input into pinned memory | event
//   progress thread:  wait for the event | the MPI collective on the host copies
//   wait():           wait for the MPI work | H2D copy of the result on the caller's stream
// The progress thread runs its queue in order, so the event wait is queued just before the MPI
// call and other groups' collectives queued earlier are not held up by it. Pinned blocks come from
// torch's caching host allocator, which records the copies' streams and reuses a block only after
// they finished, so dropping the host tensors right after the copy-back is safe.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include "comm/communicator.h"
#include "device/cuda_plugin.h"
#include "comm/progress_thread.h"

namespace mfsdp {
namespace {

class StagedWork final : public Work {
 public:
  StagedWork(WorkHandle host, at::Tensor host_result, at::Tensor device_result)
      : host_(std::move(host)), host_result_(std::move(host_result)), device_result_(std::move(device_result)) {}
  void wait() override {
    host_->wait();
    if (device_result_.defined()) {
      device_result_.copy_(host_result_, /*non_blocking=*/true);
      device_result_ = at::Tensor();
      host_result_ = at::Tensor();
    }
  }
  bool is_completed() override { return host_->is_completed(); }

 private:
  WorkHandle host_;
  at::Tensor host_result_, device_result_;
};

class StagedCommunicator final : public Communicator {
 public:
  explicit StagedCommunicator(Communicator& host)
      : Communicator(host.name(), host.rank(), host.size(), host.world_ranks()), host_(host) {}
  Backend backend() const override { return Backend::kMpi; }

  WorkHandle all_gather_async(const at::Tensor& out, const at::Tensor& in) override {
    check_gather_pair(out, in, "all_gather");
    if (size() == 1 || in.numel() == 0) {
      if (out.data_ptr() != in.data_ptr()) out.copy_(in);
      return done();
    }
    return two_buffers(out, in, [&](const at::Tensor& o, const at::Tensor& i) { return host_.all_gather_async(o, i); });
  }
  WorkHandle reduce_scatter_async(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    check_gather_pair(in, out, "reduce_scatter");
    if (size() == 1 || out.numel() == 0) {
      if (out.data_ptr() != in.data_ptr()) out.copy_(in);
      return done();
    }
    return two_buffers(out, in, [&](const at::Tensor& o, const at::Tensor& i) {
      return host_.reduce_scatter_async(o, i, op);
    });
  }
  WorkHandle all_reduce_async(const at::Tensor& t, ReduceOp op) override {
    check_tensor(t, "the", "all_reduce");
    if (size() == 1 || t.numel() == 0) return done();
    at::Tensor h = stage(t);
    after_copy();
    return std::make_shared<StagedWork>(host_.all_reduce_async(h, op), h, t);
  }
  WorkHandle broadcast_async(const at::Tensor& t, int root) override {
    check_tensor(t, "the", "broadcast");
    if (size() == 1 || t.numel() == 0) return done();
    at::Tensor h = stage(t);
    after_copy();
    return std::make_shared<StagedWork>(host_.broadcast_async(h, root), h, t);
  }
  WorkHandle send_recv_async(const at::Tensor& send, int dst, const at::Tensor& recv, int src) override {
    check_tensor(send, "the sent", "send_recv");
    check_tensor(recv, "the received", "send_recv");
    if (dst == rank() && src == rank()) {
      if (recv.data_ptr() != send.data_ptr()) recv.copy_(send);
      return done();
    }
    return two_buffers(recv, send, [&](const at::Tensor& r, const at::Tensor& sd) {
      return host_.send_recv_async(sd, dst, r, src);
    });
  }
  WorkHandle barrier_async() override { return host_.barrier_async(); }

 private:
  static WorkHandle done() { return std::make_shared<CompletedWork>(); }
  static at::Tensor host_like(const at::Tensor& t) {
    return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  }
  // The D2H copy runs on the caller's current stream, after whatever produced the tensor.
  static at::Tensor stage(const at::Tensor& t) {
    at::Tensor h = host_like(t);
    h.copy_(t, /*non_blocking=*/true);
    return h;
  }
  // A collective with a separate result: the input staged, the result received into host memory
  // and copied back to `out` on wait().
  template <class F>
  WorkHandle two_buffers(const at::Tensor& out, const at::Tensor& in, F&& host_op) {
    at::Tensor h_in = stage(in), h_out = host_like(out);
    after_copy();
    return std::make_shared<StagedWork>(host_op(h_out, h_in), h_out, out);
  }
  // Queues, ahead of the MPI collective, a wait for the copies just issued on the caller's stream.
  void after_copy() {
    auto ev = std::make_shared<at::cuda::CUDAEvent>();
    ev->record();  // the current stream of the current device
    const auto device = c10::cuda::current_device();
    ProgressThread::instance().submit([ev, device] {
      c10::cuda::CUDAGuard g(device);
      ev->synchronize();
    });
  }
  Communicator& host_;
};

}  // namespace

std::unique_ptr<Communicator> cuda_plugin::make_staged_communicator(Communicator& host) {
  return std::make_unique<StagedCommunicator>(host);
}

}  // namespace mfsdp
