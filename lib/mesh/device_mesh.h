// The device mesh: world = dp_replicate x dp_shard x cp x tp, TP innermost so that TP peers are
// neighbouring ranks (same node), then CP, then the data-parallel dimensions. Pure arithmetic: no
// MPI and no torch, so `mfsdp validate --world-size N` can lay out a mesh it will never launch.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"

namespace mfsdp {

// The four mesh dimensions, outermost first; rank = ((rep*S + shard)*C + cp)*T + tp.
enum class MeshDim { kDpReplicate = 0, kDpShard = 1, kCp = 2, kTp = 3 };

// The groups we build communicators for: each dimension alone plus the flattened ones.
enum class MeshGroup {
  kDpReplicate,
  kDpShard,
  kCp,
  kTp,
  kDp,         // dp_replicate x dp_shard: everyone holding the same model shard (grad all-reduce/HSDP)
  kDpShardCp,  // dp_shard x cp: the FSDP sharding group (parameters are sharded over dp and cp)
  kDpCp,       // dp_replicate x dp_shard x cp: loss normalisation over all tokens
  kWorld,
};
constexpr int kNumMeshGroups = 8;
const char* to_string(MeshGroup g);

struct MeshShape {
  int64_t dp_replicate = 1, dp_shard = 1, cp = 1, tp = 1;
  int64_t world() const { return dp_replicate * dp_shard * cp * tp; }
  int64_t dp() const { return dp_replicate * dp_shard; }
  std::array<int64_t, 4> sizes() const { return {dp_replicate, dp_shard, cp, tp}; }
};

// Resolves dp_size (auto or given) against the world size. Throws ConfigError naming the keys and
// their YAML locations when the world does not factor.
MeshShape resolve_mesh_shape(const Config& cfg, int64_t world_size);

class DeviceMesh {
 public:
  DeviceMesh(MeshShape shape, int rank);

  const MeshShape& shape() const { return shape_; }
  int rank() const { return rank_; }
  // This rank's coordinate along a dimension.
  int64_t coord(MeshDim d) const { return coords_[static_cast<int>(d)]; }
  // The size of a (possibly flattened) group and this rank's index in it.
  int64_t group_size(MeshGroup g) const;
  int64_t group_rank(MeshGroup g) const;
  // The world ranks of the group that contains `rank`, in group-rank order.
  std::vector<int> group_ranks(MeshGroup g) const;
  // A number that is equal for all members of this rank's group and different between groups:
  // the `color` of MPI_Comm_split.
  int group_color(MeshGroup g) const;

  static std::array<int64_t, 4> coords_of(const MeshShape& s, int64_t rank);
  static int64_t rank_of(const MeshShape& s, const std::array<int64_t, 4>& coords);

 private:
  // Which dimensions a group spans.
  static std::vector<MeshDim> dims_of(MeshGroup g);
  MeshShape shape_;
  int rank_;
  std::array<int64_t, 4> coords_;
};

// A table of every rank's coordinates and group members, for `mfsdp validate`.
std::string describe_mesh(const MeshShape& shape);

}  // namespace mfsdp
