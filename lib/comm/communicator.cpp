#include "comm/communicator.h"

#include <ATen/ATen.h>

#include <cstring>

#include "util/error.h"

namespace mfsdp {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

const char* to_string(Backend b) { return b == Backend::kMpi ? "mpi" : "nccl"; }

void Communicator::check_tensor(const at::Tensor& t, const char* what, const char* op) const {
  if (!t.defined())
    throw std::invalid_argument(name_ + "." + op + ": " + what + " tensor is undefined");
  if (!t.is_contiguous())
    throw std::invalid_argument(name_ + "." + op + ": " + what + " tensor must be contiguous");
  if (t.numel() > std::numeric_limits<int>::max())
    throw std::invalid_argument(name_ + "." + op + ": " + what + " tensor has " + std::to_string(t.numel()) +
                                " elements, more than one collective can carry (2^31-1); split it");
}

void Communicator::check_gather_pair(const at::Tensor& big, const at::Tensor& small, const char* op) const {
  check_tensor(big, "large", op);
  check_tensor(small, "small", op);
  if (big.scalar_type() != small.scalar_type())
    throw std::invalid_argument(name_ + "." + op + ": dtype mismatch " + std::string(c10::toString(big.scalar_type())) +
                                " vs " + c10::toString(small.scalar_type()));
  if (big.device() != small.device())
    throw std::invalid_argument(name_ + "." + op + ": tensors on different devices");
  if (big.numel() != small.numel() * size())
    throw std::invalid_argument(name_ + "." + op + ": the large tensor must have group size (" +
                                std::to_string(size()) + ") x " + std::to_string(small.numel()) + " elements, has " +
                                std::to_string(big.numel()));
}

void Communicator::register_buffer(const at::Tensor&) {
  throw UserError(name_ + ": distributed.nccl_ub registers NCCL user buffers, but this communicator's device "
                  "collectives use " + to_string(backend()) + (backend() == Backend::kMpi ? " (CPU tensors, or CUDA "
                  "tensors staged through host memory): there is nothing to register; set distributed.backend: nccl "
                  "on a GPU run or nccl_ub: false" : ""));
}

namespace {

class RoutingCommunicator final : public Communicator {
 public:
  RoutingCommunicator(std::unique_ptr<Communicator> host, std::unique_ptr<Communicator> device)
      : Communicator(host->name(), host->rank(), host->size(), host->world_ranks()),
        host_(std::move(host)),
        device_(std::move(device)) {}
  Backend backend() const override { return device_->backend(); }
  WorkHandle all_gather_async(const at::Tensor& out, const at::Tensor& in) override {
    return pick(in).all_gather_async(out, in);
  }
  WorkHandle reduce_scatter_async(const at::Tensor& out, const at::Tensor& in, ReduceOp op) override {
    return pick(in).reduce_scatter_async(out, in, op);
  }
  WorkHandle all_reduce_async(const at::Tensor& t, ReduceOp op) override { return pick(t).all_reduce_async(t, op); }
  WorkHandle broadcast_async(const at::Tensor& t, int root) override { return pick(t).broadcast_async(t, root); }
  WorkHandle send_recv_async(const at::Tensor& send, int dst, const at::Tensor& recv, int src) override {
    return pick(send).send_recv_async(send, dst, recv, src);
  }
  // A barrier orders the hosts (every rank measures at once, every rank has written its files).
  WorkHandle barrier_async() override { return host_->barrier_async(); }
  void register_buffer(const at::Tensor& t) override { pick(t).register_buffer(t); }

 private:
  Communicator& pick(const at::Tensor& t) { return t.defined() && t.device().is_cpu() ? *host_ : *device_; }
  std::unique_ptr<Communicator> host_;    // declared first: destroyed after device_, which may use it
  std::unique_ptr<Communicator> device_;
};

}  // namespace

std::unique_ptr<Communicator> make_routing_communicator(std::unique_ptr<Communicator> host,
                                                        std::unique_ptr<Communicator> device) {
  return std::make_unique<RoutingCommunicator>(std::move(host), std::move(device));
}

std::vector<std::string> all_gather_strings(Communicator& c, const std::string& s) {
  at::Tensor len = at::full({1}, int64_t(s.size()), at::kLong), lens = at::empty({c.size()}, at::kLong);
  c.all_gather(lens, len);
  const int64_t max_len = std::max<int64_t>(1, lens.max().item<int64_t>());
  at::Tensor mine = at::zeros({max_len}, at::kByte), all = at::empty({max_len * c.size()}, at::kByte);
  std::memcpy(mine.data_ptr(), s.data(), s.size());
  c.all_gather(all, mine);
  std::vector<std::string> out;
  for (int r = 0; r < c.size(); ++r)
    out.emplace_back(reinterpret_cast<const char*>(all.data_ptr<uint8_t>() + r * max_len), size_t(lens[r].item<int64_t>()));
  return out;
}

}  // namespace mfsdp
