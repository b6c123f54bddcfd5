#include "checkpoint/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <caffe2/serialize/inline_container.h>  // one extra file of a TorchScript zip, without loading the model
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>  // PEFT's rank_pattern / alpha_pattern keys
#include <set>
#include <thread>

#include "checkpoint/checkpoint_index.h"
#include "checkpoint/init_from.h"
#include "checkpoint/safetensors.h"
#include "comm/communicator.h"
#include "fsdp/engine.h"
#include "mesh/process_groups.h"
#include "model/graph_rewrite.h"
#include "model/model.h"
#include "optim/optimizer.h"
#include "util/error.h"
#include "util/strings.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mfsdp {
namespace {

constexpr const char* kFormat = kCheckpointFormat;

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

std::string broadcast_string(Communicator& c, const std::string& s) { return all_gather_strings(c, s)[0]; }

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw UserError(tmp + ": cannot create: " + std::strerror(errno));
  const char* p = text.data();
  size_t n = text.size();
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw UserError(tmp + ": write failed: " + std::strerror(e));
    }
    p += w;
    n -= size_t(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw UserError(tmp + ": write failed: " + std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw UserError(path + ": rename failed: " + std::strerror(errno));
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError(path + ": cannot open: " + std::strerror(errno));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The step directory's index.json, checked (checkpoint_index.h lists what the readers below may
// rely on: every key they read is there with its type, every range inside its tensor).
json read_index(const std::string& dir) {
  const std::string path = dir + "/index.json";
  if (!fs::exists(path)) throw UserError(dir + ": not a complete checkpoint (no index.json)");
  return parse_checkpoint_index(read_text(path), path);
}

// Names and shapes of a model's parameters, as the index records them.
json model_params_json(const Model& model) {
  json params = json::object();
  for (const auto& p : model.params()) params[p.name] = {{"shape", p.global_shape()}, {"aliases", p.aliases}};
  return params;
}

std::string fingerprint(const json& params) {
  std::string text;
  for (auto it = params.begin(); it != params.end(); ++it) text += it.key() + ":" + it.value()["shape"].dump() + ";";
  return hex64(fnv1a64(text.data(), text.size()));
}

std::string piece_key(const std::string& kind, const std::string& name, int64_t begin) {
  return kind + "/" + name + "/" + std::to_string(begin);
}

// Opens checkpoint files on demand, verifying each file's checksum against the index first.
class PieceReader {
 public:
  PieceReader(std::string dir, const json& index) : dir_(std::move(dir)), index_(index) {}
  SafetensorsFile& file(const std::string& name) {
    auto it = open_.find(name);
    if (it != open_.end()) return *it->second;
    const std::string path = dir_ + "/" + name;
    if (!fs::exists(path)) throw UserError(path + ": missing from the checkpoint (index.json lists it)");
    const auto& meta = index_["files"].at(name);
    if (int64_t(fs::file_size(path)) != meta.at("bytes").get<int64_t>())
      throw UserError(fmt::format("{}: {} bytes, the index says {}: truncated or replaced", path, fs::file_size(path),
                                  meta.at("bytes").get<int64_t>()));
    const std::string sum = hex64(checksum_file(path));
    if (sum != meta.at("checksum").get<std::string>())
      throw UserError(path + ": checksum mismatch (file " + sum + ", index " + meta.at("checksum").get<std::string>() +
                      "): the checkpoint is corrupt");
    return *open_.emplace(name, std::make_unique<SafetensorsFile>(path)).first->second;
  }

 private:
  std::string dir_;
  const json& index_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open_;
};

// A piece's tensor in its file, which must hold the `numel` elements the index gives it.
at::Tensor piece_tensor(SafetensorsFile& f, const std::string& key, int64_t numel) {
  if (!f.has(key)) throw UserError(f.path() + ": lacks " + key + " that the index promises");
  at::Tensor t = f.get(key);
  if (t.numel() != numel)
    throw UserError(fmt::format("{}: {} holds {} elements, the index gives its piece {}", f.path(), key, t.numel(), numel));
  return t;
}

json split_json(const TpSplit& t) {
  std::vector<int64_t> v{t.dim, t.size, t.rank};
  v.insert(v.end(), t.parts.begin(), t.parts.end());
  return v;
}

bool same_layout(const TpSplit& a, const TpSplit& b) {
  if (!a.split() || !b.split()) return a.split() == b.split();
  return a.dim == b.dim && a.size == b.size && a.parts == b.parts;
}

// The whole (global) parameter `name` of kind "main" or an optimizer state, assembled from pieces
// written under any tensor-parallel and data-parallel layout.
at::Tensor read_full_param(PieceReader& reader, const json& index, const std::string& kind, const std::string& name) {
  const auto& entry = index["params"].at(name);
  const auto shape = entry.at("shape").get<std::vector<int64_t>>();
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  at::Tensor full = at::empty({numel}, at::kFloat);
  int64_t covered = 0;
  for (const auto& pc : entry.at("pieces")) {
    const int64_t pb = pc.at("begin").get<int64_t>(), pe = pc.at("end").get<int64_t>();
    SafetensorsFile& f = reader.file(pc.at("file").get<std::string>());
    const std::string key = piece_key(kind, name, pb) + (pc.contains("tp") ? "@tp" + std::to_string(pc["tp"][2].get<int64_t>()) : "");
    at::Tensor src = piece_tensor(f, key, pe - pb);
    checkpoint_piece_split(pc, shape).for_each_run(pb, pe, [&](int64_t g, int64_t l, int64_t len) {
      full.narrow(0, g, len).copy_(src.narrow(0, l - pb, len));
      covered += len;
    });
    f.release(key);  // read: its mapped pages need not stay resident (SafetensorsFile::release)
  }
  if (covered != numel)
    throw UserError(fmt::format("checkpoint: {} of the {} elements of parameter {} are in the checkpoint", covered, numel,
                                name));
  return full;
}

// Copies elements [begin, end) of this rank's slice (split `mine`) of parameter `name` from the
// checkpoint's pieces into `dst` (end - begin elements). Pieces saved with the same layout are read
// directly; otherwise the global tensor is assembled and sliced. Throws if they do not cover it.
void read_range(PieceReader& reader, const json& index, const std::string& kind, const std::string& name, int64_t begin,
                int64_t end, const TpSplit& mine, at::Tensor dst) {
  const auto& entry = index["params"].at(name);
  const auto& pieces = entry.at("pieces");
  const auto shape = entry.at("shape").get<std::vector<int64_t>>();
  bool direct = true;
  for (const auto& pc : pieces) direct = direct && same_layout(checkpoint_piece_split(pc, shape), mine);
  if (!direct) {
    at::Tensor full = read_full_param(reader, index, kind, name);
    mine.for_each_run(begin, end, [&](int64_t g, int64_t l, int64_t len) {
      dst.narrow(0, l - begin, len).copy_(full.narrow(0, g, len));
    });
    return;
  }
  int64_t covered = 0;
  for (const auto& pc : pieces) {
    if (mine.split() && checkpoint_piece_split(pc, shape).rank != mine.rank) continue;
    const int64_t pb = pc.at("begin").get<int64_t>(), pe = pc.at("end").get<int64_t>();
    const int64_t lo = std::max(begin, pb), hi = std::min(end, pe);
    if (hi <= lo) continue;
    SafetensorsFile& f = reader.file(pc.at("file").get<std::string>());
    const std::string key = piece_key(kind, name, pb) + (mine.split() ? "@tp" + std::to_string(mine.rank) : "");
    at::Tensor src = piece_tensor(f, key, pe - pb);
    dst.narrow(0, lo - begin, hi - lo).copy_(src.narrow(0, lo - pb, hi - lo));
    covered += hi - lo;
    f.release(key);
  }
  if (covered != end - begin)
    throw UserError(fmt::format("checkpoint: {} of {} elements [{}, {}) of parameter {} are in the checkpoint", covered,
                                end - begin, begin, end, name));
}

}  // namespace

// ------------------------------------------------------------------------------------------------
struct CheckpointManager::Pending {
  TrainerState state;
  int64_t optimizer_steps = 0;  // at the moment of the save (an async one completes steps later)
  std::string tmp_dir, final_dir;
  bool replaces = false;  // final_dir exists, written by an earlier run: swapped out when complete
  std::thread writer;
  std::string fragment;  // this rank's JSON fragment (or error)
  std::atomic<bool> done{false};
};

namespace {

// The buffers a model.init_from set, as rank 0 saved them ("buffer/NAME" in rank_00000.safetensors),
// copied into `module`'s buffers of those names; returns the names.
std::vector<std::string> restore_buffers(PieceReader& reader, const json& index, torch::jit::Module& module,
                                         const std::string& dir) {
  std::vector<std::string> restored;
  const std::string first = "rank_00000.safetensors";
  if (!index["files"].contains(first)) return restored;
  SafetensorsFile& f = reader.file(first);
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (!f.has("buffer/" + b.name)) continue;
    at::Tensor saved = f.get("buffer/" + b.name);
    if (saved.sizes() != b.value.sizes())
      throw UserError(fmt::format("{}: buffer {} has shape [{}] in the checkpoint, [{}] in the model", dir, b.name,
                                  fmt::join(saved.sizes(), ", "), fmt::join(b.value.sizes(), ", ")));
    b.value.copy_(saved);
    restored.push_back(b.name);
  }
  return restored;
}

}  // namespace

CheckpointManager::CheckpointManager(const Config& cfg, ProcessGroups& pg, Model& model, ParallelEngine& engine,
                                     Optimizer& optimizer)
    : cfg_(cfg), pg_(pg), model_(model), engine_(engine), optimizer_(optimizer) {
  check_shared_dir();
}

// Every rank writes its shards into checkpoint.dir and rank 0 writes the index that names them, so
// the directory has to be one directory for all ranks (a shared file system). A host whose
// checkpoint.dir is its own local disk would silently split every checkpoint: rank 0 writes a probe
// with a random token, every rank reads it back, and the ranks that cannot are named.
void CheckpointManager::check_shared_dir() {
  if (!cfg_.checkpoint.dir) return;
  Communicator& world = pg_.get(MeshGroup::kWorld);
  const std::string dir = *cfg_.checkpoint.dir;
  const std::string probe = dir + "/.mfsdp_shared_probe";
  std::string mine;
  if (world.rank() == 0) {
    try {
      fs::create_directories(dir);
      std::random_device rd;
      const std::string token = fmt::format("{:016x}{:08x}", (uint64_t(rd()) << 32) | rd(), uint32_t(::getpid()));
      write_text_atomically(probe, token);
      mine = "ok:" + token;
    } catch (const std::exception& e) {
      mine = std::string("error:") + e.what();
    }
  }
  const std::string first = all_gather_strings(world, mine)[0];
  if (first.rfind("error:", 0) == 0)
    throw UserError(cfg_.where("checkpoint.dir") + ": checkpoint.dir " + dir + ": rank 0 cannot write there: " + first.substr(6));
  std::string seen;
  {
    std::ifstream in(probe);
    std::getline(in, seen);
  }
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const auto all = all_gather_strings(world, seen == first.substr(3) ? std::string() : std::string(host));
  if (world.rank() == 0) std::remove(probe.c_str());
  std::string ranks, hosts;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
    if (hosts.find(all[r]) == std::string::npos) hosts += (hosts.empty() ? "" : ", ") + all[r];
  }
  if (!ranks.empty())
    throw UserError(cfg_.where("checkpoint.dir") + ": checkpoint.dir " + dir + ": rank(s) " + ranks + " (on " + hosts +
                    ") do not see what rank 0 writes there; every rank saves its shards into this directory and "
                    "rank 0 writes the index that names them, so it must be one shared directory on every host "
                    "(NFS, Lustre, GPFS, ...), not a local disk");
}

CheckpointManager::~CheckpointManager() {
  if (pending_ && pending_->writer.joinable()) pending_->writer.join();
}

std::string CheckpointManager::step_dir_name(int64_t step) const { return fmt::format("step_{:08d}", step); }

std::optional<std::string> CheckpointManager::resume_dir() {
  Communicator& world = pg_.get(MeshGroup::kWorld);
  std::string choice, error;
  if (world.rank() == 0) {
    try {
      const std::string& r = cfg_.checkpoint.resume;
      if (r == "none") {
      } else if (r == "auto") {
        if (cfg_.checkpoint.dir && fs::exists(*cfg_.checkpoint.dir)) {
          const std::string dir = *cfg_.checkpoint.dir;
          std::string latest;
          if (fs::exists(dir + "/latest")) latest = read_text(dir + "/latest");
          while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
          if (!latest.empty() && fs::exists(dir + "/" + latest + "/index.json")) {
            choice = dir + "/" + latest;
          } else {  // no usable pointer: the newest complete step directory
            std::string best;
            for (const auto& e : fs::directory_iterator(dir)) {
              const std::string n = e.path().filename().string();
              if (n.rfind("step_", 0) == 0 && fs::exists(e.path() / "index.json") && n > best) best = n;
            }
            if (!best.empty()) choice = dir + "/" + best;
          }
        }
      } else {
        if (!fs::exists(r + "/index.json"))
          throw UserError(cfg_.where("checkpoint.resume") + ": checkpoint.resume: " + r +
                          " is not a complete checkpoint (no index.json)");
        choice = r;
      }
    } catch (const UserError& e) {
      error = e.what();
    }
  }
  error = broadcast_string(world, error);
  if (!error.empty()) throw UserError(error);
  choice = broadcast_string(world, choice);
  if (choice.empty()) return std::nullopt;
  return choice;
}

TrainerState CheckpointManager::load(const std::string& dir) {
  Communicator& world = pg_.get(MeshGroup::kWorld);
  std::string error;
  TrainerState st;
  try {
    json index = read_index(dir);
    const json now = model_params_json(model_);
    if (index["model"].value("fingerprint", "") != fingerprint(now)) {
      std::string diff;
      for (auto it = now.begin(); it != now.end() && diff.empty(); ++it)
        if (!index["params"].contains(it.key())) diff = "the checkpoint has no parameter " + it.key();
        else if (index["params"][it.key()]["shape"] != it.value()["shape"])
          diff = "parameter " + it.key() + " has shape " + index["params"][it.key()]["shape"].dump() + " in the checkpoint, " +
                 it.value()["shape"].dump() + " in the model";
      if (diff.empty()) diff = "its parameters differ";
      throw UserError(dir + "/index.json: the checkpoint belongs to another model (" + diff + "; model.path " +
                      model_.path() + ")");
    }
    const std::string opt = index["optimizer"].value("name", "");
    if (opt != cfg_.optimizer.name)
      throw UserError(fmt::format("{}: saved with optimizer {}, the config says {} (optimizer.name): its state cannot be "
                                  "carried over",
                                  dir, opt, cfg_.optimizer.name));
    PieceReader reader(dir, index);
    auto& slots = engine_.slots();
    const auto& ranges = engine_.slot_ranges();
    at::NoGradGuard ng;
    std::vector<std::string> fresh;  // trainable now, frozen when saved: no state to carry over
    for (size_t i = 0; i < slots.size(); ++i) {
      const auto& r = ranges[i];
      read_range(reader, index, "main", slots[i].name, r.begin, r.end, r.tp, slots[i].weight);
      if (slots[i].frozen) continue;
      if (index["params"].at(slots[i].name).value("frozen", false)) {
        if (std::find(fresh.begin(), fresh.end(), slots[i].name) == fresh.end()) fresh.push_back(slots[i].name);
        for (const auto& kind : optimizer_.state_kinds()) optimizer_.slot_state(kind, i, slots).zero_();
        continue;
      }
      for (const auto& kind : optimizer_.state_kinds())
        read_range(reader, index, kind, slots[i].name, r.begin, r.end, r.tp, optimizer_.slot_state(kind, i, slots));
    }
    if (!fresh.empty())
      st.note = fmt::format("{} parameters frozen when the checkpoint was saved train now, with fresh optimizer state "
                            "({}{})", fresh.size(), fmt::join(fresh.begin(), fresh.begin() + std::min<size_t>(fresh.size(), 4), ", "),
                            fresh.size() > 4 ? ", ..." : "");
    optimizer_.set_steps_taken(index["optimizer"].value("steps", int64_t(0)));
    // Each rank's RNG, when the layout of ranks is the same.
    const std::string mine = fmt::format("rank_{:05d}.safetensors", world.rank());
    if (index.value("world_size", 0) == world.size() && index["files"].contains(mine)) {
      SafetensorsFile& f = reader.file(mine);
      if (f.has("rng/cpu")) {
        at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle to the process-wide generator
        gen.set_state(f.get("rng/cpu").clone());
      }
      if (model_.device().is_cuda() && f.has("rng/cuda")) {
        at::Generator gen = at::globalContext().defaultGenerator(model_.device());
        gen.set_state(f.get("rng/cuda").clone());
      }
    }
    // Buffers a model.init_from set when the run began: the checkpoint wins over the file's
    // values, as for the weights.
    model_.loaded_buffers() = restore_buffers(reader, index, model_.module(), dir);
    st.step = index["trainer"].at("step").get<int64_t>();
    st.consumed_samples = index["trainer"].at("consumed_samples").get<int64_t>();
  } catch (const UserError& e) {
    error = e.what();
  } catch (const std::exception& e) {
    error = dir + ": cannot load the checkpoint: " + e.what();
  }
  // Every rank learns whether any rank failed, so that none goes on alone.
  auto errors = all_gather_strings(world, error);
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) throw UserError(errors[r]);
  engine_.install_weights();
  loaded_step_ = st.step;
  return st;
}

void CheckpointManager::save(const TrainerState& state) {
  poll(/*wait=*/true);  // one checkpoint in flight at a time
  Communicator& world = pg_.get(MeshGroup::kWorld);
  const std::string dir = *cfg_.checkpoint.dir;
  auto p = std::make_unique<Pending>();
  p->state = state;
  p->optimizer_steps = optimizer_.steps_taken();
  p->final_dir = dir + "/" + step_dir_name(state.step);
  p->tmp_dir = dir + "/." + step_dir_name(state.step) + ".tmp";
  std::string error;
  if (world.rank() == 0) {
    try {
      fs::create_directories(dir);
      fs::remove_all(p->tmp_dir);  // left by a crash
      // The step this run resumed from is saved already (the same state). Any other existing
      // directory of this step is an earlier run's (checkpoint.resume none, or another config):
      // replaced once the new one is complete, never silently kept under this run's name.
      if (fs::exists(p->final_dir) && state.step == loaded_step_) error = "exists";
      else fs::create_directories(p->tmp_dir);
      p->replaces = error.empty() && fs::exists(p->final_dir);
      if (p->replaces)
        std::fprintf(stderr, "checkpoint: %s exists, written by an earlier run: replaced when this save completes\n",
                     p->final_dir.c_str());
    } catch (const std::exception& e) {
      error = std::string(dir + ": cannot create the checkpoint directory (checkpoint.dir): ") + e.what();
    }
  }
  error = broadcast_string(world, error);
  if (error == "exists") return;  // this step is already saved and complete
  if (!error.empty()) throw UserError(error);

  // What this rank writes: host copies, so that training may go on while a thread writes them.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  json pieces = json::array();
  const bool writer = engine_.checkpoint_writer();
  if (writer) {
    at::NoGradGuard ng;
    auto& slots = engine_.slots();
    const auto& ranges = engine_.slot_ranges();
    const bool tp_leader = pg_.get(MeshGroup::kTp).rank() == 0;
    for (size_t i = 0; i < slots.size(); ++i) {
      const auto& r = ranges[i];
      if (r.tp_replica && !tp_leader) continue;  // identical on every TP rank: written once
      // Keys of TP slices name the TP rank: slices of one parameter from several TP ranks may
      // share a local offset.
      const std::string suffix = r.tp.split() ? "@tp" + std::to_string(r.tp.rank) : "";
      // Host copies (device-to-host on a GPU run): the writer thread reads them after this returns.
      auto host = [](const at::Tensor& t) { return t.reshape({-1}).to(at::kCPU, /*non_blocking=*/false, /*copy=*/true); };
      tensors.emplace_back(piece_key("main", slots[i].name, r.begin) + suffix, host(slots[i].weight));
      if (!slots[i].frozen)  // model.frozen: weights only (the index marks it)
        for (const auto& kind : optimizer_.state_kinds())
          tensors.emplace_back(piece_key(kind, slots[i].name, r.begin) + suffix, host(optimizer_.slot_state(kind, i, slots)));
      json piece = {slots[i].name, r.begin, r.end};
      if (r.tp.split()) piece.push_back(split_json(r.tp));
      pieces.push_back(piece);
    }
  }
  tensors.emplace_back("rng/cpu", at::detail::getDefaultCPUGenerator().get_state());
  // Buffers model.init_from set (identical on every rank): in rank 0's file.
  if (world.rank() == 0 && !model_.loaded_buffers().empty())
    for (const auto& b : model_.module().named_buffers(/*recurse=*/true))
      if (std::find(model_.loaded_buffers().begin(), model_.loaded_buffers().end(), b.name) != model_.loaded_buffers().end())
        tensors.emplace_back("buffer/" + b.name, b.value.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
  // A GPU run's dropout draws from the device's generator: saved too, restored when the layout
  // (and the device type) match; a CPU run resuming a GPU checkpoint ignores it, and back.
  if (model_.device().is_cuda())
    tensors.emplace_back("rng/cuda", at::globalContext().defaultGenerator(model_.device()).get_state());
  const std::string file = fmt::format("rank_{:05d}.safetensors", world.rank());
  const std::string path = p->tmp_dir + "/" + file;
  auto work = [p = p.get(), tensors, pieces, file, path]() {
    json frag;
    try {
      uint64_t sum = write_safetensors(path, tensors, {{"format", kFormat}});
      frag = {{"file", file}, {"checksum", hex64(sum)}, {"bytes", int64_t(fs::file_size(path))}, {"pieces", pieces}};
    } catch (const std::exception& e) {
      frag = {{"error", e.what()}};
    }
    p->fragment = frag.dump();
    p->done = true;
  };
  pending_ = std::move(p);
  if (cfg_.checkpoint.async) {
    pending_->writer = std::thread(work);
  } else {
    work();
    poll(/*wait=*/true);
  }
}

void CheckpointManager::poll(bool wait) {
  if (!pending_) return;
  Communicator& world = pg_.get(MeshGroup::kWorld);
  if (!wait) {
    // Complete the checkpoint only when every rank's writer has finished.
    at::Tensor done = at::full({1}, int64_t(pending_->done ? 1 : 0), at::kLong);
    world.all_reduce(done, ReduceOp::kSum);
    if (done.item<int64_t>() != world.size()) return;
  }
  if (pending_->writer.joinable()) pending_->writer.join();
  std::unique_ptr<Pending> p = std::move(pending_);
  finalize(*p);
}

void CheckpointManager::finalize(Pending& p) {
  Communicator& world = pg_.get(MeshGroup::kWorld);
  auto fragments = all_gather_strings(world, p.fragment);
  std::string error;
  for (size_t r = 0; r < fragments.size(); ++r) {
    json f = json::parse(fragments[r]);
    if (f.contains("error")) error += (error.empty() ? "" : "; ") + fmt::format("rank {}: {}", r, f["error"].get<std::string>());
  }
  if (error.empty() && world.rank() == 0) {
    try {
      json index;
      index["format"] = kFormat;
      index["trainer"] = {{"step", p.state.step}, {"consumed_samples", p.state.consumed_samples}};
      index["world_size"] = world.size();
      const auto& shape = pg_.mesh().shape();
      index["mesh"] = {{"dp_replicate", shape.dp_replicate}, {"dp_shard", shape.dp_shard}, {"cp", shape.cp}, {"tp", shape.tp}};
      index["zero_dp_strategy"] = to_string(cfg_.distributed.zero_dp_strategy);
      index["compute_dtype"] = cfg_.model.compute_dtype;
      json params = model_params_json(model_);
      index["model"] = {{"path", cfg_.model.path}, {"fingerprint", fingerprint(params)}};
      index["optimizer"] = {{"name", cfg_.optimizer.name}, {"steps", p.optimizer_steps},
                            {"state", optimizer_.state_kinds()}};
      for (auto it = params.begin(); it != params.end(); ++it) it.value()["pieces"] = json::array();
      for (const auto& mp : model_.params())
        if (mp.frozen) params[mp.name]["frozen"] = true;  // its pieces hold weights, no optimizer state
      index["files"] = json::object();
      for (const auto& frag : fragments) {
        json f = json::parse(frag);
        index["files"][f["file"].get<std::string>()] = {{"checksum", f["checksum"]}, {"bytes", f["bytes"]}};
        for (const auto& pc : f["pieces"]) {
          json piece = {{"file", f["file"]}, {"begin", pc[1]}, {"end", pc[2]}};
          if (pc.size() > 3) piece["tp"] = pc[3];
          params[pc[0].get<std::string>()]["pieces"].push_back(piece);
        }
      }
      index["params"] = params;
      write_text_atomically(p.tmp_dir + "/config.yaml", "# resolved config of the run that wrote this checkpoint\n" +
                                                            to_yaml(cfg_));
      write_text_atomically(p.tmp_dir + "/index.json", index.dump(1));
      fsync_path(p.tmp_dir);
      const std::string old_dir = *cfg_.checkpoint.dir + "/." + step_dir_name(p.state.step) + ".replaced";  // hidden from resume
      if (p.replaces) {
        fs::remove_all(old_dir);
        fs::rename(p.final_dir, old_dir);
      }
      if (std::rename(p.tmp_dir.c_str(), p.final_dir.c_str()) != 0)
        throw UserError(p.final_dir + ": cannot rename the finished checkpoint into place: " + std::strerror(errno));
      const std::string dir = *cfg_.checkpoint.dir;
      fsync_path(dir);
      write_text_atomically(dir + "/latest", step_dir_name(p.state.step) + "\n");
      fsync_path(dir);
      if (p.replaces) fs::remove_all(old_dir);
      if (cfg_.checkpoint.keep_last > 0) {  // only complete directories; the new one is complete now
        std::vector<std::string> steps;
        for (const auto& e : fs::directory_iterator(dir)) {
          const std::string n = e.path().filename().string();
          if (n.rfind("step_", 0) == 0 && fs::exists(e.path() / "index.json")) steps.push_back(n);
        }
        std::sort(steps.begin(), steps.end());
        for (size_t i = 0; i + size_t(cfg_.checkpoint.keep_last) < steps.size(); ++i) fs::remove_all(dir + "/" + steps[i]);
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (!error.empty() && world.rank() == 0) {
    std::error_code ec;
    fs::remove_all(p.tmp_dir, ec);  // nothing half-written stays behind
  }
  error = broadcast_string(world, error);
  if (!error.empty())
    throw UserError("checkpoint " + p.final_dir + " not written (the previous one is untouched): " + error);
}

// ------------------------------------------------------------------------------------------------
int inspect_checkpoint(const std::string& dir, bool verbose) {
  json index = read_index(dir);
  std::printf("checkpoint %s\n  format %s, step %lld, consumed samples %lld\n", dir.c_str(), kFormat,
              (long long)index["trainer"]["step"].get<int64_t>(), (long long)index["trainer"]["consumed_samples"].get<int64_t>());
  std::printf("  written by %d ranks (mesh %s), zero_dp_strategy %s, compute %s, optimizer %s after %lld steps\n",
              index["world_size"].get<int>(), index["mesh"].dump().c_str(), index["zero_dp_strategy"].get<std::string>().c_str(),
              index["compute_dtype"].get<std::string>().c_str(), index["optimizer"]["name"].get<std::string>().c_str(),
              (long long)index["optimizer"]["steps"].get<int64_t>());
  std::printf("  model %s (fingerprint %s)\n", index["model"]["path"].get<std::string>().c_str(),
              index["model"]["fingerprint"].get<std::string>().c_str());
  int64_t total = 0;
  for (auto it = index["params"].begin(); it != index["params"].end(); ++it) {
    int64_t n = 1;
    for (int64_t d : it.value()["shape"].get<std::vector<int64_t>>()) n *= d;
    total += n;
    if (verbose)
      std::printf("    %-48s %-18s %zu pieces\n", it.key().c_str(), it.value()["shape"].dump().c_str(),
                  it.value()["pieces"].size());
  }
  std::printf("  %zu parameters, %lld elements\n", index["params"].size(), (long long)total);
  int problems = 0;
  int64_t bytes = 0;
  for (auto it = index["files"].begin(); it != index["files"].end(); ++it) {
    const std::string path = dir + "/" + it.key();
    std::string verdict = "OK";
    if (!fs::exists(path)) verdict = "MISSING";
    else if (int64_t(fs::file_size(path)) != it.value()["bytes"].get<int64_t>()) verdict = "WRONG SIZE";
    else if (hex64(checksum_file(path)) != it.value()["checksum"].get<std::string>()) verdict = "CHECKSUM MISMATCH";
    if (verdict != "OK") ++problems;
    bytes += it.value()["bytes"].get<int64_t>();
    std::printf("  %-24s %12lld bytes  checksum %s  %s\n", it.key().c_str(), (long long)it.value()["bytes"].get<int64_t>(),
                it.value()["checksum"].get<std::string>().c_str(), verdict.c_str());
  }
  std::printf("  %zu files, %lld bytes: %s\n", index["files"].size(), (long long)bytes,
              problems ? fmt::format("{} problem(s)", problems).c_str() : "all checksums verified");
  return problems;
}

namespace {
// A step directory, or a checkpoint.dir: then the step its `latest` file names.
std::string resolve_step_dir(const std::string& given) {
  std::string dir = given;
  if (!fs::exists(dir + "/index.json") && fs::exists(dir + "/latest")) {
    std::ifstream latest(dir + "/latest");
    std::string step;
    std::getline(latest, step);
    dir += "/" + step;
  }
  return dir;
}

}  // namespace

void export_checkpoint(const std::string& given, const std::string& out, const std::string& format,
                       const std::string& model_path, const std::string& state, bool only_trainable) {
  if (only_trainable && format != "safetensors")
    throw UserError("export --only-trainable: with --format safetensors (the trainable weights) or hf (a PEFT adapter)");
  const std::string dir = resolve_step_dir(given);
  json index = read_index(dir);
  if (state != "main") {
    const auto kinds = index["optimizer"]["state"].get<std::vector<std::string>>();
    if (std::find(kinds.begin(), kinds.end(), state) == kinds.end())
      throw UserError(fmt::format("export --state {}: the checkpoint's optimizer ({}) holds [{}]; 'main' is the weights",
                                  state, index["optimizer"]["name"].get<std::string>(), fmt::join(kinds, ", ")));
    if (format != "safetensors") throw UserError("export --state " + state + ": only with --format safetensors");
  }
  PieceReader reader(dir, index);
  std::vector<std::pair<std::string, at::Tensor>> weights;  // every name, aliases included
  std::vector<std::pair<std::string, at::Tensor>> unique;
  for (auto it = index["params"].begin(); it != index["params"].end(); ++it) {
    // Frozen: no optimizer state; --only-trainable: only what the run trained.
    if ((state != "main" || only_trainable) && it.value().value("frozen", false)) continue;
    auto shape = it.value()["shape"].get<std::vector<int64_t>>();
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    at::Tensor t = read_full_param(reader, index, state, it.key()).view(shape);
    unique.emplace_back(it.key(), t);
    weights.emplace_back(it.key(), t);
    for (const auto& alias : it.value()["aliases"]) weights.emplace_back(alias.get<std::string>(), t);
  }
  if (format == "safetensors") {
    std::sort(weights.begin(), weights.end(), [](auto& a, auto& b) { return a.first < b.first; });
    write_safetensors(out, weights,
                      {{"format", "pt"}, {"source", dir}, {"step", std::to_string(index["trainer"]["step"].get<int64_t>())},
                       {"state", state}});
  } else if (format == "torchscript") {
    const std::string path = model_path.empty() ? index["model"]["path"].get<std::string>() : model_path;
    Model model = Model::load(path);
    if (fingerprint(model_params_json(model)) != index["model"]["fingerprint"].get<std::string>())
      throw UserError(path + ": this TorchScript model does not match the checkpoint's parameters (export --model)");
    at::NoGradGuard ng;
    std::map<std::string, at::Tensor> by_name(unique.begin(), unique.end());
    for (auto& p : model.params()) p.tensor.copy_(by_name.at(p.name).to(p.tensor.scalar_type()));
    restore_buffers(reader, index, model.module(), dir);  // model.init_from's: the trained model computes with them
    const std::string tmp = out + ".tmp";
    model.module().save(tmp);
    if (std::rename(tmp.c_str(), out.c_str()) != 0) throw UserError(out + ": cannot write: " + std::strerror(errno));
  } else {
    throw UserError("export --format: expected safetensors or torchscript, got '" + format + "'");
  }
}

// ------------------------------------------------------------------------------------------------
// `export --format hf`: a Hugging Face model directory (DESIGN.md section 13).

namespace {

// An extra file of a TorchScript archive (torch.jit.save's _extra_files), read from the zip alone.
std::optional<std::string> torchscript_extra_file(const std::string& path, const std::string& name) {
  try {
    caffe2::serialize::PyTorchStreamReader reader(path);
    const std::string record = "extra/" + name;
    if (!reader.hasRecord(record)) return std::nullopt;
    auto [data, size] = reader.getRecord(record);
    return std::string(static_cast<const char*>(data.get()), size);
  } catch (const c10::Error& e) {
    throw UserError(path + ": not a TorchScript archive (" + e.what_without_backtrace() + ")");
  }
}

at::ScalarType hf_dtype(const std::string& name, const std::string& what) {
  if (name == "float32" || name == "fp32") return at::kFloat;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float16" || name == "fp16") return at::kHalf;
  throw UserError(what + ": expected float32, bfloat16 or float16, got '" + name + "'");
}

const char* hf_dtype_name(at::ScalarType t) {
  return t == at::kFloat ? "float32" : t == at::kBFloat16 ? "bfloat16" : "float16";
}

}  // namespace

namespace {

// One tensor of a Hugging Face directory being written: its name, shape and how to read it.
struct HfEntry {
  std::string name;
  std::vector<int64_t> shape;
  std::function<at::Tensor()> read;
  int64_t bytes = 0;
};

// Writes `entries` into `out` (new, or an empty directory) as `stem`.safetensors, or as shards of at
// most max_shard_bytes (in entry order; a larger tensor gets one of its own) with
// `stem`.safetensors.index.json, plus the given text files. One tensor in memory at a time; written
// under a temporary name and renamed, so a failed export leaves nothing.
void write_hf_dir(const std::string& out, std::vector<HfEntry>& entries, at::ScalarType dtype, int64_t max_shard_bytes,
                  const std::string& stem, const std::vector<std::pair<std::string, std::string>>& files) {
  int64_t total = 0;
  for (auto& e : entries) {
    int64_t n = 1;
    for (int64_t d : e.shape) n *= d;
    e.bytes = n * int64_t(c10::elementSize(dtype));
    total += e.bytes;
  }
  std::vector<std::vector<size_t>> shards(1);
  int64_t in_shard = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (in_shard > 0 && in_shard + entries[i].bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += entries[i].bytes;
  }
  const std::string tmp = out + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    json weight_map = json::object();
    for (size_t s = 0; s < shards.size(); ++s) {
      const std::string file = shards.size() == 1 ? stem + ".safetensors"
                                                  : fmt::format("{}-{:05d}-of-{:05d}.safetensors", stem, s + 1, shards.size());
      std::vector<SafetensorsSpec> specs;
      for (size_t i : shards[s]) {
        specs.push_back({entries[i].name, dtype, entries[i].shape});
        weight_map[entries[i].name] = file;
      }
      write_safetensors_streamed(tmp + "/" + file, specs, [&](size_t k) { return entries[shards[s][k]].read(); },
                                 {{"format", "pt"}});
    }
    if (shards.size() > 1)
      write_text_atomically(tmp + "/" + stem + ".safetensors.index.json",
                            json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) + "\n");
    for (const auto& [name, text] : files) write_text_atomically(tmp + "/" + name, text);
    if (fs::exists(out)) fs::remove(out);  // an empty directory
    fs::rename(tmp, out);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
}

// Every name of parameter `it` of the index, a tied output head left out when the config ties it
// (transformers ties it again when it loads, as save_pretrained writes it).
std::vector<std::string> names_to_write(const json::const_iterator& it, bool tied) {
  std::vector<std::string> names{it.key()};
  for (const auto& a : it.value()["aliases"]) names.push_back(a.get<std::string>());
  if (tied && names.size() > 1) {
    std::vector<std::string> kept;
    for (const auto& n : names)
      if (!ends_with(n, "lm_head.weight")) kept.push_back(n);
    if (!kept.empty()) names = {kept.front()};
  }
  return names;
}

// One parameter's entries in the family's checkpoint layout: a stacked parameter (MoE experts) as
// its per-expert pieces, read once for all of them (the last parameter read is kept), under the
// names save_pretrained writes; any other under its renamed name.
void add_in_layout(std::vector<HfEntry>& entries, const HfCheckpointLayout& layout, const std::string& name,
                   const std::vector<int64_t>& shape, const std::function<at::Tensor()>& read) {
  auto stack = layout.stacks.find(name);
  const int64_t count = stack == layout.stacks.end() ? 0 : int64_t(stack->second.size());
  if (count == 0 || layout.piece_shape(name, shape, count, 0).empty()) {
    entries.push_back({layout.save_name(name), shape, read});
    return;
  }
  auto once = std::make_shared<at::Tensor>();
  int64_t start = 0;  // piece k's first element of the flattened parameter
  for (int64_t k = 0; k < count; ++k) {
    const std::vector<int64_t> piece = layout.piece_shape(name, shape, count, k);
    int64_t n = 1;
    for (int64_t d : piece) n *= d;
    entries.push_back({layout.save_name(stack->second[size_t(k)]), piece, [once, read, piece, k, start, n, count] {
                         if (k == 0 || !once->defined()) *once = read().reshape({-1});
                         at::Tensor part = once->narrow(0, start, n).view(piece);  // holds the storage
                         if (k == count - 1) *once = at::Tensor();  // one parameter in memory at a time
                         return part;
                       }});
    start += n;
  }
}

// PEFT's modules_to_save wrap a module twice: X.original_module (frozen, the base model's) and
// X.modules_to_save.ADAPTER (trained). For the latter: its name without ".modules_to_save.ADAPTER"
// (PEFT's adapter files and the transformers model both call it X.weight); "" for other names.
std::string saved_module_name(const std::string& name) {
  static const std::string mark = ".modules_to_save.";
  auto at = name.find(mark);
  if (at == std::string::npos) return "";
  auto dot = name.find('.', at + mark.size());
  if (dot == std::string::npos) return "";
  return name.substr(0, at) + name.substr(dot);
}
bool is_original_module(const std::string& name) { return name.find(".original_module.") != std::string::npos; }

// A checkpoint of a PEFT LoRA model out as Hugging Face files: merged weights (W + s B A, s =
// lora_alpha / r, or / sqrt(r) with use_rslora; transposed for fan_in_fan_out layers such as GPT-2's
// Conv1D) in the transformers model's names, or with only_trainable the adapters in PEFT's layout.
void export_peft(const std::string& dir, const json& index, const std::string& out, const std::string& path,
                 json hf, json peft, at::ScalarType dtype, int64_t max_shard_bytes, bool only_trainable) {
  auto reader = std::make_shared<PieceReader>(dir, index);
  auto full = [reader, &index](const std::string& param) {
    const auto shape = index["params"].at(param).at("shape").get<std::vector<int64_t>>();
    return read_full_param(*reader, index, "main", param).view(shape);
  };
  // module -> its lora_A / lora_B parameter (the checkpoint's name); one adapter per module.
  // DoRA: module -> its magnitude (...q_proj.lora_magnitude_vector.default.weight), one per output row.
  std::map<std::string, std::pair<std::string, std::string>> adapters;
  std::map<std::string, std::string> magnitudes;
  for (auto it = index["params"].begin(); it != index["params"].end(); ++it) {
    std::string module;
    auto [ab, adapter] = lora_part(it.key(), &module);
    if (std::string mm = dora_magnitude_module(it.key()); !mm.empty()) magnitudes[mm] = it.key();
    if (ab.empty()) continue;
    auto& slot = adapters[module];
    (ab == "lora_A" ? slot.first : slot.second) = it.key();
  }
  for (const auto& [module, ab] : adapters)
    if (ab.first.empty() || ab.second.empty())
      throw UserError(path + ": LoRA layer " + module + " has " + (ab.first.empty() ? "no lora_A" : "no lora_B"));
  std::vector<HfEntry> entries;
  std::vector<std::pair<std::string, std::string>> files;
  if (only_trainable) {
    // PEFT's adapter_model.safetensors: the trainable tensors, the adapter name taken out of the key
    // (get_peft_model_state_dict's naming: ...q_proj.lora_A.weight).
    std::vector<std::string> frozen_lora;
    for (auto it = index["params"].begin(); it != index["params"].end(); ++it) {
      std::string module;
      auto [ab, adapter] = lora_part(it.key(), &module);
      const bool frozen = it.value().value("frozen", false);
      if (std::string mm = dora_magnitude_module(it.key()); !mm.empty()) {
        // PEFT saves a DoRA magnitude as ...q_proj.lora_magnitude_vector (adapter name and .weight dropped)
        const std::string param = it.key();
        entries.push_back({mm + ".lora_magnitude_vector", it.value()["shape"].get<std::vector<int64_t>>(),
                           [full, param] { return full(param); }});
        continue;
      }
      if (ab.empty()) {
        const std::string saved = saved_module_name(it.key());
        if (!saved.empty()) {  // modules_to_save: in PEFT's files under the wrapped module's name
          const std::string param = it.key();
          entries.push_back({saved, it.value()["shape"].get<std::vector<int64_t>>(), [full, param] { return full(param); }});
          continue;
        }
        if (!frozen)
          throw UserError(path + ": " + it.key() + " was trained but is no LoRA adapter; PEFT's adapter files hold only "
                          "adapters and modules_to_save (export the whole model with --format hf, or freeze it: "
                          "model.frozen)");
        continue;
      }
      if (frozen) frozen_lora.push_back(it.key());
      const std::string key = module + "." + ab + ".weight";
      const std::string param = it.key();
      entries.push_back({key, it.value()["shape"].get<std::vector<int64_t>>(), [full, param] { return full(param); }});
    }
    if (!frozen_lora.empty())
      std::fprintf(stderr, "export: note: %zu LoRA tensors were frozen in this run (model.frozen); written as they are\n",
                   frozen_lora.size());
    std::sort(entries.begin(), entries.end(), [](const HfEntry& a, const HfEntry& b) { return a.name < b.name; });
    peft["inference_mode"] = true;
    if (peft.value("base_model_name_or_path", json()).is_null() && hf.contains("_name_or_path")) {
      peft["base_model_name_or_path"] = hf["_name_or_path"];
    }
    files.push_back({"adapter_config.json", peft.dump(2) + "\n"});
    // One file whatever --max-shard-size says: PeftModel.from_pretrained reads adapter_model.safetensors
    // only, never an index of shards.
    write_hf_dir(out, entries, dtype, std::numeric_limits<int64_t>::max(), "adapter_model", files);
    return;
  }
  // Merged: every non-LoRA parameter under its transformers name; an adapted layer's weight with
  // its adapter's product added, in fp32 before the cast to the output dtype.
  // Per module, as PEFT's LoraModel sets it: r and lora_alpha, or rank_pattern's and
  // alpha_pattern's values for the first pattern P (a regex) that matches "(.*\.)?(P)$" against
  // the module's name in the base model. The rank is lora_A's row count either way (checked).
  const double r0 = peft.value("r", 8.0), alpha0 = peft.value("lora_alpha", 8.0);
  const bool rslora = peft.value("use_rslora", false);
  auto pattern_value = [&](const char* key, const std::string& module, double fallback) {
    if (!peft.contains(key) || !peft[key].is_object()) return fallback;
    for (auto it = peft[key].begin(); it != peft[key].end(); ++it) {
      std::regex re;
      try {
        re = std::regex("(.*\\.)?(" + it.key() + ")$");
      } catch (const std::regex_error& e) {
        throw UserError(fmt::format("{}: adapter_config.json {} key '{}' is not a regular expression: {}", path, key,
                                    it.key(), e.what()));
      }
      if (!it.value().is_number())
        throw UserError(fmt::format("{}: adapter_config.json {}['{}'] must be a number", path, key, it.key()));
      if (std::regex_match(module, re)) return it.value().get<double>();
    }
    return fallback;
  };
  std::map<std::string, double> scaling_of;
  for (const auto& [module, ab] : adapters) {
    const std::string key = peft_to_hf_name(module);
    const double r = pattern_value("rank_pattern", key, r0), alpha = pattern_value("alpha_pattern", key, alpha0);
    const auto& a_shape = index["params"].at(ab.first).at("shape");
    if (a_shape.size() != 2) throw UserError(path + ": LoRA layer " + module + ": lora_A is not a matrix (" + a_shape.dump() + ")");
    const int64_t rows = a_shape[0].get<int64_t>();
    if (rows != int64_t(r))
      throw UserError(fmt::format("{}: LoRA layer {} has rank {} (lora_A's rows) but adapter_config.json gives it r {}",
                                  path, module, rows, r));
    scaling_of[module] = rslora ? alpha / std::sqrt(r) : alpha / r;
  }
  const bool fan_in_fan_out = peft.value("fan_in_fan_out", false);
  const bool tied = hf.value("tie_word_embeddings", false);
  const HfCheckpointLayout layout =
      hf_checkpoint_layout(torchscript_extra_file(path, "mfsdp/hf_export.json").value_or(""), path);
  for (auto it = index["params"].begin(); it != index["params"].end(); ++it) {
    if (!lora_part(it.key(), nullptr).first.empty() || !dora_magnitude_module(it.key()).empty()) continue;
    const auto shape = it.value()["shape"].get<std::vector<int64_t>>();
    const std::string param = it.key();
    std::function<at::Tensor()> read = [full, param] { return full(param); };
    const auto base = param.find(".base_layer.weight");
    if (base != std::string::npos && base + std::strlen(".base_layer.weight") == param.size()) {
      auto ad = adapters.find(param.substr(0, base));
      if (ad != adapters.end()) {
        const std::string a = ad->second.first, b = ad->second.second;
        const double scaling = scaling_of.at(ad->first);
        auto mag = magnitudes.find(ad->first);
        const std::string m = mag == magnitudes.end() ? std::string() : mag->second;
        read = [full, param, a, b, m, scaling, fan_in_fan_out] {
          at::Tensor w = full(param).to(at::kFloat);
          if (fan_in_fan_out) w = w.t();  // [out, in] from here on
          at::Tensor merged = w + at::matmul(full(b).to(at::kFloat), full(a).to(at::kFloat)).mul_(scaling);
          // DoRA (PEFT's merge): each output row rescaled to its magnitude, m / ||W + s B A||_row
          if (!m.empty()) merged = merged * (full(m).to(at::kFloat) / at::linalg_vector_norm(merged, 2, {1})).unsqueeze(1);
          return fan_in_fan_out ? merged.t().contiguous() : merged;
        };
      }
    }
    for (const auto& name : names_to_write(it, tied)) {
      if (is_original_module(name)) continue;  // modules_to_save: the trained copy is written
      const std::string saved = saved_module_name(name);
      const std::string hf_name = peft_to_hf_name(saved.empty() ? name : saved);
      add_in_layout(entries, layout, hf_name, shape, read);
    }
  }
  double lo = std::numeric_limits<double>::max(), hi = 0;
  for (const auto& kv : scaling_of) lo = std::min(lo, kv.second), hi = std::max(hi, kv.second);
  const std::string lora_note =
      scaling_of.empty() ? "no adapters"
      : lo == hi         ? fmt::format("{} adapters merged, scaling {}", adapters.size(), lo)
                         : fmt::format("{} adapters merged, scaling {} to {} (rank_pattern / alpha_pattern)", adapters.size(), lo, hi);
  hf["torch_dtype"] = hf_dtype_name(dtype);
  hf["dtype"] = hf_dtype_name(dtype);
  hf["mfsdp"] = {{"checkpoint", fs::absolute(dir).string()}, {"step", index["trainer"]["step"]},
                 {"lora", lora_note}};
  files.push_back({"config.json", hf.dump(2) + "\n"});
  write_hf_dir(out, entries, dtype, max_shard_bytes, "model", files);
}

}  // namespace

void export_checkpoint_hf(const std::string& given, const std::string& out, const std::string& model_path,
                          const std::string& dtype_name, int64_t max_shard_bytes, bool only_trainable) {
  const std::string dir = resolve_step_dir(given);
  json index = read_index(dir);
  const std::string path = model_path.empty() ? index["model"]["path"].get<std::string>() : model_path;
  auto cfg_text = torchscript_extra_file(path, "mfsdp/hf_config.json");
  if (!cfg_text)
    throw UserError(path + ": holds no mfsdp/hf_config.json, so it is no Hugging Face model: export --format hf needs a "
                    "model exported by scripts/export_hf.py (--model names another file)");
  json hf;
  try {
    hf = json::parse(*cfg_text);
  } catch (const json::exception& e) {
    throw UserError(path + ": mfsdp/hf_config.json is not valid JSON: " + e.what());
  }
  const at::ScalarType dtype =
      hf_dtype(!dtype_name.empty() ? dtype_name : hf.value("torch_dtype", std::string("float32")),
               dtype_name.empty() ? path + ": mfsdp/hf_config.json torch_dtype" : "export --dtype");
  if (fs::exists(out) && !(fs::is_directory(out) && fs::is_empty(out)))
    throw UserError(out + ": exists and is not an empty directory; export --format hf writes a new directory");
  if (max_shard_bytes <= 0) throw UserError("export --max-shard-size: must be positive");
  json peft;  // the adapter config when the model is a PEFT LoRA model
  if (auto text = torchscript_extra_file(path, "mfsdp/adapter_config.json")) {
    try {
      peft = json::parse(*text);
    } catch (const json::exception& e) {
      throw UserError(path + ": mfsdp/adapter_config.json is not valid JSON: " + e.what());
    }
  }
  if (only_trainable && peft.is_null())
    throw UserError("export --only-trainable --format hf writes a PEFT adapter directory, but " + path +
                    " is no LoRA model (scripts/export_hf.py --lora-r or --adapter-dir makes one); "
                    "--format safetensors --only-trainable writes the trainable weights of any model");
  if (!peft.is_null()) return export_peft(dir, index, out, path, hf, peft, dtype, max_shard_bytes, only_trainable);

  // Every parameter under its name, from the pieces of every rank, one at a time; in the family's
  // checkpoint layout (the names and per-expert tensors save_pretrained writes) where the exporter
  // recorded one.
  const bool tied = hf.value("tie_word_embeddings", false);
  const HfCheckpointLayout layout =
      hf_checkpoint_layout(torchscript_extra_file(path, "mfsdp/hf_export.json").value_or(""), path);
  auto reader = std::make_shared<PieceReader>(dir, index);
  std::vector<HfEntry> entries;
  for (auto it = index["params"].begin(); it != index["params"].end(); ++it) {
    const auto shape = it.value()["shape"].get<std::vector<int64_t>>();
    const std::string param = it.key();
    for (const auto& name : names_to_write(it, tied))
      add_in_layout(entries, layout, name, shape, [reader, &index, param, shape] {
        return read_full_param(*reader, index, "main", param).view(shape);
      });
  }
  // Persistent buffers model.init_from loaded (DeepSeek V3's e_score_correction_bias), as saved by
  // rank 0: save_pretrained writes them too.
  const std::string first = dir + "/rank_00000.safetensors";
  if (fs::exists(first)) {
    auto f = std::make_shared<SafetensorsFile>(first);
    for (const auto& key : f->names())
      if (key.rfind("buffer/", 0) == 0) {
        const std::string name = key.substr(7);
        entries.push_back({layout.save_name(name), f->get(key).sizes().vec(), [f, key] { return f->get(key); }});
      }
  }
  hf["torch_dtype"] = hf_dtype_name(dtype);
  hf["dtype"] = hf_dtype_name(dtype);
  hf["mfsdp"] = {{"checkpoint", fs::absolute(dir).string()}, {"step", index["trainer"]["step"]}};
  write_hf_dir(out, entries, dtype, max_shard_bytes, "model", {{"config.json", hf.dump(2) + "\n"}});
}

}  // namespace mfsdp
