// Device mesh layout: TP innermost, groups per dimension and flattened, dp inferred, errors.
#include <set>

#include "catch.h"
#include "config/config.h"
#include "mesh/device_mesh.h"
#include "util/error.h"

using namespace mfsdp;

namespace {
Config cfg_with(const std::string& dist) {
  return load_config_string("model: {path: m}\ndata: {train: d}\ntraining: {global_batch_size: 64, micro_batch_size: 1}\n"
                            "distributed:\n" + dist,
                            "m.yaml");
}
std::string error_of(const Config& c, int world) {
  try {
    resolve_mesh_shape(c, world);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("dp is inferred from the world size") {
  auto s = resolve_mesh_shape(cfg_with("  tp_size: 2\n  cp_size: 2\n  dp_replicate_size: 2\n"), 16);
  CHECK(s.dp_replicate == 2);
  CHECK(s.dp_shard == 2);
  CHECK(s.cp == 2);
  CHECK(s.tp == 2);
  CHECK(s.world() == 16);
  CHECK(s.dp() == 4);
  auto t = resolve_mesh_shape(cfg_with("  dp_size: auto\n"), 8);
  CHECK(t.dp_shard == 8);
}

TEST_CASE("TP is innermost, then CP, dp_shard, dp_replicate") {
  MeshShape s{2, 2, 2, 2};
  for (int r = 0; r < 16; ++r) {
    DeviceMesh m(s, r);
    CHECK(m.coord(MeshDim::kTp) == r % 2);
    CHECK(m.coord(MeshDim::kCp) == (r / 2) % 2);
    CHECK(m.coord(MeshDim::kDpShard) == (r / 4) % 2);
    CHECK(m.coord(MeshDim::kDpReplicate) == r / 8);
    CHECK(DeviceMesh::rank_of(s, DeviceMesh::coords_of(s, r)) == r);
  }
  DeviceMesh m5(s, 5);  // rep 0, shard 1, cp 0, tp 1
  CHECK(m5.group_ranks(MeshGroup::kTp) == std::vector<int>{4, 5});
  CHECK(m5.group_ranks(MeshGroup::kCp) == std::vector<int>{5, 7});
  CHECK(m5.group_ranks(MeshGroup::kDpShard) == std::vector<int>{1, 5});
  CHECK(m5.group_ranks(MeshGroup::kDpReplicate) == std::vector<int>{5, 13});
  CHECK(m5.group_ranks(MeshGroup::kDp) == std::vector<int>{1, 5, 9, 13});
  CHECK(m5.group_ranks(MeshGroup::kDpShardCp) == std::vector<int>{1, 3, 5, 7});
  CHECK(m5.group_ranks(MeshGroup::kDpCp) == std::vector<int>{1, 3, 5, 7, 9, 11, 13, 15});
  CHECK(m5.group_rank(MeshGroup::kDpShardCp) == 2);
  CHECK(m5.group_rank(MeshGroup::kDp) == 1);
  CHECK(m5.group_size(MeshGroup::kWorld) == 16);
}

TEST_CASE("every group partitions the world and its members agree on it") {
  for (MeshShape s : {MeshShape{1, 8, 1, 1}, MeshShape{2, 2, 1, 2}, MeshShape{1, 2, 2, 2}, MeshShape{3, 1, 2, 1}}) {
    for (int g = 0; g < kNumMeshGroups; ++g) {
      auto group = static_cast<MeshGroup>(g);
      std::set<int> covered;
      for (int r = 0; r < s.world(); ++r) {
        DeviceMesh m(s, r);
        auto members = m.group_ranks(group);
        CHECK(int64_t(members.size()) == m.group_size(group));
        CHECK(members[m.group_rank(group)] == r);
        for (int peer : members) CHECK(DeviceMesh(s, peer).group_color(group) == m.group_color(group));
        covered.insert(r);
      }
      CHECK(int64_t(covered.size()) == s.world());
    }
  }
}

TEST_CASE("world sizes that do not factor are errors naming the key and its line") {
  auto c = cfg_with("  tp_size: 4\n");
  std::string e = error_of(c, 6);
  CHECK(e.find("m.yaml:5:12") != std::string::npos);
  CHECK(e.find("distributed.tp_size") != std::string::npos);
  CHECK(e.find("world size 6") != std::string::npos);

  auto d = cfg_with("  dp_size: 4\n");
  e = error_of(d, 2);
  CHECK(e.find("m.yaml:5:12") != std::string::npos);
  CHECK(e.find("distributed.dp_size is 4") != std::string::npos);

  auto r = cfg_with("  dp_replicate_size: 3\n");
  e = error_of(r, 4);
  CHECK(e.find("distributed.dp_replicate_size") != std::string::npos);
  CHECK(e.find("m.yaml:5:22") != std::string::npos);

  auto p = cfg_with("  cp_size: 2\n");
  CHECK(error_of(p, 3).find("distributed.cp_size") != std::string::npos);
  CHECK(error_of(p, 4).empty());
}
