#include "mesh/process_groups.h"

#include <mpi.h>

#include "util/error.h"

namespace mfsdp {

ProcessGroups::ProcessGroups(const DeviceMesh& mesh, Backend backend, bool cuda) : mesh_(mesh) {
  if (backend == Backend::kNccl && !cuda) throw std::logic_error("the NCCL backend carries CUDA tensors only");
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != mesh.shape().world())
    throw UserError("the job has " + std::to_string(world) + " ranks but the mesh needs " +
                    std::to_string(mesh.shape().world()));
  // NCCL: one bootstrap for the world (an id over MPI), every other group split from it; the world
  // group's device communicator is that one (the world comes last, after every split).
  static_assert(static_cast<int>(MeshGroup::kWorld) == kNumMeshGroups - 1, "the world group must be last");
  std::unique_ptr<Communicator> nccl_world;
  if (cuda && backend == Backend::kNccl) nccl_world = make_nccl_world("world/nccl");
  for (int g = 0; g < kNumMeshGroups; ++g) {
    auto group = static_cast<MeshGroup>(g);
    MPI_Comm comm;
    // Key = rank within the group, so that MPI ranks equal our group ranks.
    if (MPI_Comm_split(MPI_COMM_WORLD, mesh.group_color(group), static_cast<int>(mesh.group_rank(group)), &comm) !=
        MPI_SUCCESS)
      throw std::runtime_error(std::string("MPI_Comm_split for mesh group ") + to_string(group) + " failed");
    auto host = make_communicator(Backend::kMpi, comm, to_string(group));
    if (!cuda) {
      comms_[g] = std::move(host);
      continue;
    }
    std::unique_ptr<Communicator> device;
    if (backend == Backend::kNccl && group == MeshGroup::kWorld)
      device = std::move(nccl_world);
    else if (backend == Backend::kNccl)
      device = make_nccl_split(*nccl_world, int(mesh.group_color(group)), int(mesh.group_rank(group)),
                               std::string(to_string(group)) + "/nccl", host->world_ranks());
    else
      device = make_staged_communicator(*host);
    comms_[g] = make_routing_communicator(std::move(host), std::move(device));
  }
}

}  // namespace mfsdp
