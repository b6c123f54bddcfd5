#include "mesh/device_mesh.h"

#include <fmt/format.h>

#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {

const char* to_string(MeshGroup g) {
  switch (g) {
    case MeshGroup::kDpReplicate: return "dp_replicate";
    case MeshGroup::kDpShard: return "dp_shard";
    case MeshGroup::kCp: return "cp";
    case MeshGroup::kTp: return "tp";
    case MeshGroup::kDp: return "dp";
    case MeshGroup::kDpShardCp: return "dp_shard_cp";
    case MeshGroup::kDpCp: return "dp_cp";
    case MeshGroup::kWorld: return "world";
  }
  return "?";
}

MeshShape resolve_mesh_shape(const Config& cfg, int64_t world) {
  const auto& d = cfg.distributed;
  if (world < 1) throw UserError("world size must be >= 1, got " + std::to_string(world));
  MeshShape s;
  s.tp = d.tp_size;
  s.cp = d.cp_size;
  s.dp_replicate = d.dp_replicate_size;
  const int64_t inner = d.tp_size * d.cp_size;
  if (world % inner != 0)
    throw ConfigError(fmt::format("{}: distributed.tp_size ({}) x distributed.cp_size ({}) = {} does not divide the world size {}",
                                  cfg.where(d.tp_size > 1 ? "distributed.tp_size" : "distributed.cp_size"), d.tp_size,
                                  d.cp_size, inner, world));
  const int64_t dp = world / inner;
  if (d.dp_size && *d.dp_size != dp)
    throw ConfigError(fmt::format(
        "{}: distributed.dp_size is {}, but world size {} / (tp_size {} x cp_size {}) = {}; set dp_size: auto or "
        "launch {} ranks",
        cfg.where("distributed.dp_size"), *d.dp_size, world, d.tp_size, d.cp_size, dp, *d.dp_size * inner));
  if (dp % d.dp_replicate_size != 0)
    throw ConfigError(fmt::format("{}: distributed.dp_replicate_size {} does not divide the data-parallel size {} "
                                  "(world {} / tp {} / cp {})",
                                  cfg.where("distributed.dp_replicate_size"), d.dp_replicate_size, dp, world,
                                  d.tp_size, d.cp_size));
  s.dp_shard = dp / d.dp_replicate_size;
  return s;
}

std::array<int64_t, 4> DeviceMesh::coords_of(const MeshShape& s, int64_t rank) {
  std::array<int64_t, 4> c{};
  auto sizes = s.sizes();
  for (int i = 3; i >= 0; --i) {
    c[i] = rank % sizes[i];
    rank /= sizes[i];
  }
  return c;
}

int64_t DeviceMesh::rank_of(const MeshShape& s, const std::array<int64_t, 4>& c) {
  auto sizes = s.sizes();
  int64_t r = 0;
  for (int i = 0; i < 4; ++i) r = r * sizes[i] + c[i];
  return r;
}

DeviceMesh::DeviceMesh(MeshShape shape, int rank) : shape_(shape), rank_(rank) {
  if (rank < 0 || rank >= shape.world())
    throw UserError(fmt::format("rank {} is outside a mesh of world size {}", rank, shape.world()));
  coords_ = coords_of(shape, rank);
}

std::vector<MeshDim> DeviceMesh::dims_of(MeshGroup g) {
  using D = MeshDim;
  switch (g) {
    case MeshGroup::kDpReplicate: return {D::kDpReplicate};
    case MeshGroup::kDpShard: return {D::kDpShard};
    case MeshGroup::kCp: return {D::kCp};
    case MeshGroup::kTp: return {D::kTp};
    case MeshGroup::kDp: return {D::kDpReplicate, D::kDpShard};
    case MeshGroup::kDpShardCp: return {D::kDpShard, D::kCp};
    case MeshGroup::kDpCp: return {D::kDpReplicate, D::kDpShard, D::kCp};
    case MeshGroup::kWorld: return {D::kDpReplicate, D::kDpShard, D::kCp, D::kTp};
  }
  return {};
}

int64_t DeviceMesh::group_size(MeshGroup g) const {
  int64_t n = 1;
  auto sizes = shape_.sizes();
  for (MeshDim d : dims_of(g)) n *= sizes[static_cast<int>(d)];
  return n;
}

int64_t DeviceMesh::group_rank(MeshGroup g) const {
  // Row-major over the spanned dimensions, outermost first: the same order as world ranks.
  int64_t r = 0;
  auto sizes = shape_.sizes();
  for (MeshDim d : dims_of(g)) r = r * sizes[static_cast<int>(d)] + coords_[static_cast<int>(d)];
  return r;
}

std::vector<int> DeviceMesh::group_ranks(MeshGroup g) const {
  auto dims = dims_of(g);
  auto sizes = shape_.sizes();
  std::vector<int> out;
  const int64_t n = group_size(g);
  for (int64_t i = 0; i < n; ++i) {
    auto c = coords_;
    int64_t rem = i;
    for (int k = static_cast<int>(dims.size()) - 1; k >= 0; --k) {
      int dim = static_cast<int>(dims[k]);
      c[dim] = rem % sizes[dim];
      rem /= sizes[dim];
    }
    out.push_back(static_cast<int>(rank_of(shape_, c)));
  }
  return out;
}

int DeviceMesh::group_color(MeshGroup g) const {
  // The world rank of the group's first member identifies the group.
  return group_ranks(g).front();
}

std::string describe_mesh(const MeshShape& s) {
  std::string out = fmt::format(
      "mesh: world {} = dp_replicate {} x dp_shard {} x cp {} x tp {}  (dp = {}, FSDP shard group dp_shard x cp = {})\n",
      s.world(), s.dp_replicate, s.dp_shard, s.cp, s.tp, s.dp(), s.dp_shard * s.cp);
  out += fmt::format("{:>5} {:>5} {:>5} {:>5} {:>5}  {:<16} {:<16} {:<16} {:<16} {:<16}\n", "rank", "rep", "shard",
                     "cp", "tp", "tp group", "cp group", "dp_shard group", "dp group", "dp_shard_cp group");
  auto list = [](const std::vector<int>& v) {
    std::vector<std::string> parts;
    for (int r : v) parts.push_back(std::to_string(r));
    return "[" + join(parts, ",") + "]";
  };
  for (int64_t r = 0; r < s.world(); ++r) {
    DeviceMesh m(s, static_cast<int>(r));
    out += fmt::format("{:>5} {:>5} {:>5} {:>5} {:>5}  {:<16} {:<16} {:<16} {:<16} {:<16}\n", r,
                       m.coord(MeshDim::kDpReplicate), m.coord(MeshDim::kDpShard), m.coord(MeshDim::kCp),
                       m.coord(MeshDim::kTp), list(m.group_ranks(MeshGroup::kTp)), list(m.group_ranks(MeshGroup::kCp)),
                       list(m.group_ranks(MeshGroup::kDpShard)), list(m.group_ranks(MeshGroup::kDp)),
                       list(m.group_ranks(MeshGroup::kDpShardCp)));
  }
  return out;
}

}  // namespace mfsdp
