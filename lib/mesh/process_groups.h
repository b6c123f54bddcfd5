// One communicator per mesh group (each dimension and the flattened dp, dp_shard_cp, dp_cp, world),
// built from MPI_COMM_WORLD with MPI_Comm_split on the mesh coordinates.
#pragma once
#include <array>
#include <memory>

#include "comm/communicator.h"
#include "mesh/device_mesh.h"

namespace mfsdp {

class ProcessGroups {
 public:
  // Collective over MPI_COMM_WORLD: every rank must call it with the same shape and backend.
  ProcessGroups(const DeviceMesh& mesh, Backend backend);
  Communicator& get(MeshGroup g) const { return *comms_[static_cast<int>(g)]; }
  const DeviceMesh& mesh() const { return mesh_; }

 private:
  DeviceMesh mesh_;
  std::array<std::unique_ptr<Communicator>, kNumMeshGroups> comms_;
};

}  // namespace mfsdp
