// Linked instead of nccl_communicator.cpp when this build has no CUDA LibTorch: asking for the
// NCCL backend is then a clear error rather than a link failure.
#include "comm/communicator.h"
#include "util/error.h"

namespace mfsdp {

bool nccl_available() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm, std::string name, int, int, std::vector<int>) {
  throw UserError("communicator '" + name +
                  "': the NCCL backend is not in this build (the LibTorch found at configure time has no CUDA); "
                  "rebuild against a CUDA LibTorch, or run on CPU with the MPI backend");
}

std::unique_ptr<Communicator> make_nccl_world(std::string name) {
  return make_nccl_communicator(MPI_COMM_WORLD, std::move(name), 0, 1, {});
}

std::unique_ptr<Communicator> make_nccl_split(Communicator&, int, int, std::string name, std::vector<int>) {
  return make_nccl_communicator(MPI_COMM_WORLD, std::move(name), 0, 1, {});
}

std::unique_ptr<Communicator> make_staged_communicator(Communicator& host) {
  throw UserError("communicator '" + host.name() + "': CUDA tensors need a build against a CUDA LibTorch");
}
