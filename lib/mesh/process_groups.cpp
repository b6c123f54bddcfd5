#include "mesh/process_groups.h"

#include <mpi.h>

#include "util/error.h"

namespace mfsdp {

ProcessGroups::ProcessGroups(const DeviceMesh& mesh, Backend backend) : mesh_(mesh) {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != mesh.shape().world())
    throw UserError("the job has " + std::to_string(world) + " ranks but the mesh needs " +
                    std::to_string(mesh.shape().world()));
  for (int g = 0; g < kNumMeshGroups; ++g) {
    auto group = static_cast<MeshGroup>(g);
    MPI_Comm comm;
    // Key = rank within the group, so that MPI ranks equal our group ranks.
    if (MPI_Comm_split(MPI_COMM_WORLD, mesh.group_color(group), static_cast<int>(mesh.group_rank(group)), &comm) !=
        MPI_SUCCESS)
      throw std::runtime_error(std::string("MPI_Comm_split for mesh group ") + to_string(group) + " failed");
    comms_[g] = make_communicator(backend, comm, to_string(group));
  }
}

}  // namespace mfsdp
