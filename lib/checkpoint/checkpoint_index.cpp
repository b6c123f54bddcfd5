// Checks of a checkpoint's index.json: what each one guards is in checkpoint_index.h.
#include "checkpoint/checkpoint_index.h"

#include <set>

#include "util/error.h"
#include "util/json_int.h"

namespace mfsdp {
namespace {

using json = nlohmann::json;

constexpr int64_t kMaxNumel = int64_t(1) << 62;

class Checker {
 public:
  explicit Checker(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw UserError(path_ + ": corrupt checkpoint index: " + key + ": " + what);
  }
  const json& object(const json& j, const std::string& key) const {
    if (!j.is_object()) fail(key, "expected an object, got " + type(j));
    return j;
  }
  const json& member(const json& obj, const char* name, const std::string& key) const {
    auto it = obj.find(name);
    if (it == obj.end()) fail(key + "." + name, "missing");
    return *it;
  }
  const json& array(const json& j, const std::string& key) const {
    if (!j.is_array()) fail(key, "expected an array, got " + type(j));
    return j;
  }
  const std::string& string(const json& j, const std::string& key) const {
    if (!j.is_string()) fail(key, "expected a string, got " + type(j));
    return j.get_ref<const std::string&>();
  }
  int64_t integer(const json& j, int64_t lo, int64_t hi, const std::string& key) const {
    return json_int(j, lo, hi, path_ + ": corrupt checkpoint index: " + key);
  }
  static std::string type(const json& j) { return std::string(j.type_name()) + (j.is_primitive() ? " " + j.dump() : ""); }

 private:
  std::string path_;
};

// A file name the index may point at: inside the step directory, nowhere else.
bool plain_file_name(const std::string& n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos && n.find('\0') == std::string::npos;
}

}  // namespace

json parse_checkpoint_index(const std::string& text, const std::string& path) {
  json idx;
  try {
    idx = json::parse(text);
  } catch (const json::exception& e) {
    throw UserError(path + ": corrupt checkpoint index: " + e.what());
  }
  const Checker c(path);
  if (!idx.is_object() || !idx.contains("format") || !idx["format"].is_string() || idx["format"] != kCheckpointFormat)
    throw UserError(path + ": not an mfsdp checkpoint index (format " +
                    (idx.is_object() && idx.contains("format") ? idx["format"].dump() : std::string("missing")) +
                    ", expected " + kCheckpointFormat + ")");
  const json& trainer = c.object(c.member(idx, "trainer", ""), "trainer");
  c.integer(c.member(trainer, "step", "trainer"), 0, INT64_MAX, "trainer.step");
  c.integer(c.member(trainer, "consumed_samples", "trainer"), 0, INT64_MAX, "trainer.consumed_samples");
  const int64_t world = c.integer(c.member(idx, "world_size", ""), 1, INT32_MAX, "world_size");
  const json& mesh = c.object(c.member(idx, "mesh", ""), "mesh");
  int64_t product = 1;
  for (const char* dim : {"dp_replicate", "dp_shard", "cp", "tp"})
    product *= c.integer(c.member(mesh, dim, "mesh"), 1, world, std::string("mesh.") + dim);
  if (product != world) c.fail("mesh", "its sizes multiply to " + std::to_string(product) + ", world_size is " + std::to_string(world));
  c.string(c.member(idx, "zero_dp_strategy", ""), "zero_dp_strategy");
  c.string(c.member(idx, "compute_dtype", ""), "compute_dtype");
  const json& model = c.object(c.member(idx, "model", ""), "model");
  c.string(c.member(model, "path", "model"), "model.path");
  c.string(c.member(model, "fingerprint", "model"), "model.fingerprint");
  const json& opt = c.object(c.member(idx, "optimizer", ""), "optimizer");
  c.string(c.member(opt, "name", "optimizer"), "optimizer.name");
  c.integer(c.member(opt, "steps", "optimizer"), 0, INT64_MAX, "optimizer.steps");
  for (const auto& s : c.array(c.member(opt, "state", "optimizer"), "optimizer.state")) c.string(s, "optimizer.state[]");

  const json& files = c.object(c.member(idx, "files", ""), "files");
  for (auto it = files.begin(); it != files.end(); ++it) {
    const std::string key = "files[\"" + it.key() + "\"]";
    if (!plain_file_name(it.key())) c.fail(key, "not a file name inside the checkpoint directory");
    c.object(it.value(), key);
    c.integer(c.member(it.value(), "bytes", key), 0, INT64_MAX, key + ".bytes");
    c.string(c.member(it.value(), "checksum", key), key + ".checksum");
  }

  const json& params = c.object(c.member(idx, "params", ""), "params");
  std::set<std::string> names;
  for (auto it = params.begin(); it != params.end(); ++it) names.insert(it.key());
  for (auto it = params.begin(); it != params.end(); ++it) {
    const std::string key = "params[\"" + it.key() + "\"]";
    const json& p = c.object(it.value(), key);
    std::vector<int64_t> shape;
    int64_t numel = 1;
    for (const auto& d : c.array(c.member(p, "shape", key), key + ".shape")) {
      shape.push_back(c.integer(d, 0, kMaxNumel, key + ".shape[]"));
      if (shape.back() != 0 && numel > kMaxNumel / shape.back()) c.fail(key + ".shape", "too many elements");
      numel *= shape.back();
    }
    for (const auto& a : c.array(c.member(p, "aliases", key), key + ".aliases"))
      if (!names.insert(c.string(a, key + ".aliases[]")).second) c.fail(key + ".aliases", "names " + a.dump() + " twice");
    if (p.contains("frozen") && !p["frozen"].is_boolean()) c.fail(key + ".frozen", "expected true or false");
    size_t i = 0;
    for (const auto& pc : c.array(c.member(p, "pieces", key), key + ".pieces")) {
      const std::string pk = key + ".pieces[" + std::to_string(i++) + "]";
      c.object(pc, pk);
      if (!files.contains(c.string(c.member(pc, "file", pk), pk + ".file")))
        c.fail(pk + ".file", pc["file"].dump() + " is not one of the index's files");
      int64_t local = numel;
      if (pc.contains("tp")) {
        const json& tp = c.array(pc["tp"], pk + ".tp");
        if (tp.size() < 4) c.fail(pk + ".tp", "expected [dim, size, rank, part sizes...], got " + tp.dump());
        const int64_t dim = c.integer(tp[0], 0, int64_t(shape.size()) - 1, pk + ".tp[0] (dim)");
        const int64_t size = c.integer(tp[1], 2, INT32_MAX, pk + ".tp[1] (size)");
        c.integer(tp[2], 0, size - 1, pk + ".tp[2] (rank)");
        int64_t sum = 0, rows = 0;  // rows: this rank's, each part's slice padded (TpSplit)
        for (size_t k = 3; k < tp.size(); ++k) {
          const int64_t part = c.integer(tp[k], 1, shape[size_t(dim)], pk + ".tp[" + std::to_string(k) + "] (part)");
          sum += part;
          rows += (part + size - 1) / size;
          if (sum > shape[size_t(dim)]) break;  // reported below; the sum cannot overflow
        }
        if (sum != shape[size_t(dim)])
          c.fail(pk + ".tp", "parts sum to " + std::to_string(sum) + ", dimension " + std::to_string(dim) + " has " +
                                 std::to_string(shape[size_t(dim)]));
        local = numel / shape[size_t(dim)] * rows;
      }
      const int64_t b = c.integer(c.member(pc, "begin", pk), 0, local, pk + ".begin");
      c.integer(c.member(pc, "end", pk), b, local, pk + ".end");
    }
  }
  return idx;
}

TpSplit checkpoint_piece_split(const json& pc, const std::vector<int64_t>& global_shape) {
  TpSplit t;
  if (!pc.contains("tp")) return t;
  auto v = pc["tp"].get<std::vector<int64_t>>();
  t.dim = int(v[0]);
  t.size = v[1];
  t.rank = v[2];
  t.parts.assign(v.begin() + 3, v.end());
  t.global_shape = global_shape;
  return t;
}

}  // namespace mfsdp
