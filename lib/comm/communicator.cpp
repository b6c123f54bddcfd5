#include "comm/communicator.h"

#include <ATen/ATen.h>

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

}  // namespace mfsdp
