// One communicator per mesh group (each dimension and the flattened dp, dp_shard_cp, dp_cp, world),
// built from MPI_COMM_WORLD with MPI_Comm_split on the mesh coordinates. On a GPU run each is a
// routing communicator (communicator.h): CPU tensors through its MPI communicator, CUDA tensors
// through NCCL (split from one world communicator) or, with Backend::kMpi, staged through host
// memory over that same MPI communicator.
#pragma once
#include <array>
#include <memory>

#include "comm/communicator.h"
#include "mesh/device_mesh.h"

namespace mfsdp {

class ProcessGroups {
 public:
  // Collective over MPI_COMM_WORLD: every rank must call it with the same shape and backend.
  // cuda: device tensors travel by `backend` (kNccl or staged kMpi); otherwise everything is MPI.
  ProcessGroups(const DeviceMesh& mesh, Backend backend, bool cuda = false);
  Communicator& get(MeshGroup g) const { return *comms_[static_cast<int>(g)]; }
  const DeviceMesh& mesh() const { return mesh_; }

 private:
  DeviceMesh mesh_;
  std::array<std::unique_ptr<Communicator>, kNumMeshGroups> comms_;
};

}  // namespace mfsdp
