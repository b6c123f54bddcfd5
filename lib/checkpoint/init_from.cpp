// model.init_from (init_from.h; DESIGN.md section 13).
#include "checkpoint/init_from.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "checkpoint/safetensors.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "fsdp/engine.h"
#include "mesh/process_groups.h"
#include "model/model.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {
namespace fs = std::filesystem;

namespace {

// The safetensors files of `path` (a file; a directory's model.safetensors; or the shards its
// model.safetensors.index.json names).
std::vector<std::string> weight_files(const std::string& path) {
  if (!fs::exists(path)) throw UserError(path + ": model.init_from: no such file or directory");
  if (!fs::is_directory(path)) return {path};
  const std::string index = path + "/model.safetensors.index.json";
  if (fs::exists(index)) {
    nlohmann::json j;
    try {
      std::ifstream f(index);
      j = nlohmann::json::parse(f);
    } catch (const nlohmann::json::exception& e) {
      throw UserError(index + ": not valid JSON: " + e.what());
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw UserError(index + ": expected {\"weight_map\": {tensor: file, ...}}");
    std::set<std::string> files;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) throw UserError(index + ": weight_map[" + it.key() + "] is not a file name");
      files.insert(path + "/" + it.value().get<std::string>());
    }
    return {files.begin(), files.end()};
  }
  if (fs::exists(path + "/model.safetensors")) return {path + "/model.safetensors"};
  throw UserError(path + ": model.init_from: the directory holds neither model.safetensors nor "
                  "model.safetensors.index.json (pytorch_model.bin is not read: convert it to safetensors)");
}

std::string list(const std::vector<std::string>& v, size_t most = 12) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < most; ++i) s += (i ? ", " : "") + v[i];
  if (v.size() > most) s += fmt::format(", ... ({} in all)", v.size());
  return s;
}

}  // namespace

std::vector<int64_t> HfCheckpointLayout::piece_shape(const std::string& name, const std::vector<int64_t>& whole,
                                                     int64_t count, int64_t k) const {
  if (whole.empty() || count <= 0) return {};
  if (concat_dim0.count(name)) {
    const int64_t rows = (whole[0] + count - 1) / count, last = whole[0] - rows * (count - 1);
    if (last <= 0) return {};  // torch.chunk would give fewer pieces
    std::vector<int64_t> piece = whole;
    piece[0] = k < count - 1 ? rows : last;
    return piece;
  }
  if (whole.size() < 2 || whole[0] <= 0 || count % whole[0] != 0 || whole[1] % (count / whole[0]) != 0) return {};
  std::vector<int64_t> piece(whole.begin() + 1, whole.end());
  piece[0] /= count / whole[0];
  return piece;
}

HfCheckpointLayout hf_checkpoint_layout(const std::string& hf_export_json, const std::string& where) {
  HfCheckpointLayout layout;
  if (hf_export_json.empty()) return layout;
  const auto j = nlohmann::json::parse(hf_export_json, nullptr, false);
  if (!j.is_object()) return layout;
  try {
    if (j.contains("base_model_prefix") && j["base_model_prefix"].is_string())
      layout.base_model_prefix = j["base_model_prefix"].get<std::string>();
    if (j.contains("ignore_unexpected") && j["ignore_unexpected"].is_array())
      for (const auto& p : j["ignore_unexpected"]) layout.ignore_unexpected.emplace_back(p.get<std::string>(), std::regex(p.get<std::string>()));
  } catch (const std::exception& e) {
    throw UserError(where + ": its mfsdp/hf_export.json ignore_unexpected is malformed: " + e.what());
  }
  if (!j.contains("checkpoint_layout") || !j["checkpoint_layout"].is_object()) return layout;
  try {
    const auto& l = j["checkpoint_layout"];
    const nlohmann::json renames = l.value("renames", nlohmann::json::array());
    const nlohmann::json save = l.value("save_renames", nlohmann::json::array());
    const nlohmann::json stacked = l.value("stacks", nlohmann::json::object());  // held: items() views it
    for (const auto& r : renames) layout.renames.emplace_back(std::regex(r.at(0).get<std::string>()), r.at(1).get<std::string>());
    for (const auto& r : save) layout.save_renames.emplace_back(std::regex(r.at(0).get<std::string>()), r.at(1).get<std::string>());
    for (const auto& [param, pieces] : stacked.items()) layout.stacks[param] = pieces.get<std::vector<std::string>>();
    for (const auto& param : l.value("concat_dim0", nlohmann::json::array())) layout.concat_dim0.insert(param.get<std::string>());
  } catch (const std::exception& e) {
    throw UserError(where + ": its mfsdp/hf_export.json checkpoint_layout is malformed: " + e.what());
  }
  return layout;
}

std::string init_weights_from(const Config& cfg, ProcessGroups& pg, Model& model, ParallelEngine& engine) {
  Communicator& world = pg.get(MeshGroup::kWorld);
  const std::string& src = cfg.model.init_from;
  std::string error, summary;
  try {
    // The family's HF checkpoint layout, as the exporter read it from transformers' conversion
    // mapping (scripts/export_hf.py checkpoint_layout): module renames from the files' names to the
    // model's (Mixtral's block_sparse_moe -> mlp), applied after model.init_from_rename (whose
    // rules see the files' own names), and parameters stacked from per-expert tensors
    // (experts.gate_up_proj [E, 2I, H] from experts.e.gate_proj.weight and experts.e.up_proj.weight,
    // e = 0..E-1), each piece one contiguous run of the parameter's elements, in order.
    const HfCheckpointLayout layout = hf_checkpoint_layout(model.stored_hf_export(), model.path());
    const auto& layout_renames = layout.renames;
    const auto& stacks = layout.stacks;
    std::vector<std::pair<std::regex, std::string>> rules;
    for (const auto& r : cfg.model.init_from_rename) {
      auto eq = r.find('=');
      rules.emplace_back(std::regex(r.substr(0, eq)), r.substr(eq + 1));
    }
    // Every tensor of the files under its renamed name.
    std::vector<std::unique_ptr<SafetensorsFile>> files;
    struct Source {
      const SafetensorsFile* file;
      std::string name;
    };
    std::map<std::string, Source> by_name;
    std::map<std::string, std::string> dtypes;
    for (const auto& path : weight_files(src)) {
      files.push_back(std::make_unique<SafetensorsFile>(path));
      for (const auto& original : files.back()->names()) {
        std::string name = original;
        for (const auto& [re, to] : rules) name = std::regex_replace(name, re, to);
        for (const auto& [re, to] : layout_renames) name = std::regex_replace(name, re, to);
        if (name.empty()) continue;  // dropped by a rule
        if (by_name.count(name))
          throw UserError(fmt::format("{}: model.init_from: two tensors become {} ({} and {}{})", src, name,
                                      by_name[name].name, original, rules.empty() ? "" : " after model.init_from_rename"));
        by_name[name] = {files.back().get(), original};
        dtypes[c10::toString(files.back()->get(original).scalar_type())] = "";
      }
    }
    // from_pretrained's prefix rule, name by name: a file's name the model lacks is taken with the
    // base model's prefix added, or stripped, when the model holds that one (and no file has it).
    int64_t prefixed = 0;
    if (const std::string& pre = layout.base_model_prefix; !pre.empty()) {
      std::set<std::string> wanted;
      for (const auto& p : model.params()) {
        wanted.insert(p.name);
        wanted.insert(p.aliases.begin(), p.aliases.end());
        wanted.insert(peft_to_hf_name(p.name));
        for (const auto& al : p.aliases) wanted.insert(peft_to_hf_name(al));
      }
      for (const auto& [param, pieces] : stacks) wanted.insert(pieces.begin(), pieces.end());
      for (const auto& b : model.module().named_buffers(/*recurse=*/true)) {
        wanted.insert(b.name);
        wanted.insert(peft_to_hf_name(b.name));
      }
      std::map<std::string, Source> renamed;
      for (auto it = by_name.begin(); it != by_name.end();) {
        std::string other;
        if (!wanted.count(it->first)) {
          if (it->first.rfind(pre + ".", 0) == 0 && wanted.count(it->first.substr(pre.size() + 1)))
            other = it->first.substr(pre.size() + 1);
          else if (wanted.count(pre + "." + it->first))
            other = pre + "." + it->first;
        }
        if (other.empty() || by_name.count(other) || renamed.count(other)) {
          ++it;
          continue;
        }
        renamed[other] = it->second;
        it = by_name.erase(it);
        ++prefixed;
      }
      by_name.insert(renamed.begin(), renamed.end());
    }
    // Each model parameter by its name or an alias; shapes must be the global ones. A LoRA model
    // (PEFT's names) takes the transformers model's weights as they are: its base weights by their
    // transformers names, its adapters kept as exported when the files lack them (PEFT's own
    // from_pretrained + get_peft_model: pretrained base, fresh adapters).
    bool peft = false;
    for (const auto& p : model.params()) {
      peft = peft || is_lora_param(p.name);
      // DoRA's magnitudes are the row norms of the base weights the adapter was made on; other base
      // weights loaded under them would make a different model than PEFT's from_pretrained +
      // get_peft_model (which computes them from the loaded weights).
      if (p.name.find(".lora_magnitude_vector.") != std::string::npos)
        throw ConfigError(cfg.where("model.init_from") + ": " + model.path() +
                          " has DoRA adapters (" + p.name + "), whose magnitudes were computed from the base weights "
                          "at export; export the model from the HF directory with its weights instead "
                          "(scripts/export_hf.py --model-dir DIR --lora-dora, without --random-init) and drop model.init_from");
    }
    // Each parameter's source: one tensor of its name, or the pieces of a stacked one.
    std::vector<std::vector<const Source*>> of_param(model.params().size());
    std::set<std::string> used;
    std::vector<std::string> missing, misshaped;
    int64_t kept_adapters = 0, stacked = 0;
    for (size_t i = 0; i < model.params().size(); ++i) {
      const auto& p = model.params()[i];
      std::vector<std::string> names{p.name};
      names.insert(names.end(), p.aliases.begin(), p.aliases.end());
      if (peft)
        for (size_t k = 0, n = names.size(); k < n; ++k)
          if (peft_to_hf_name(names[k]) != names[k]) names.push_back(peft_to_hf_name(names[k]));
      for (const auto& n : names) {
        auto it = by_name.find(n);
        if (it == by_name.end()) continue;
        used.insert(n);
        if (of_param[i].empty()) of_param[i] = {&it->second};
        const auto shape = it->second.file->get(it->second.name).sizes().vec();
        if (shape != p.global_shape())
          misshaped.push_back(fmt::format("{} [{}] in the file, [{}] in the model", n, fmt::join(shape, ", "),
                                          fmt::join(p.global_shape(), ", ")));
      }
      bool pieces_missing = false;  // some pieces of a stacked parameter are there, not all
      for (size_t k = 0; k < names.size() && of_param[i].empty() && !pieces_missing; ++k) {
        auto st = stacks.find(names[k]);
        if (st == stacks.end()) continue;
        // Every piece must be there, of the shape of one row-block of the parameter: [E, K*r, ...]
        // stacks E x K pieces of [r, ...]; a concatenation along dim 0 [n*r, ...] n of [r, ...].
        const std::vector<int64_t> whole = p.global_shape();
        const int64_t count = int64_t(st->second.size());
        std::vector<const Source*> pieces;
        std::vector<std::string> absent;
        for (size_t k = 0; k < st->second.size(); ++k) {
          const std::string& n = st->second[k];
          const std::vector<int64_t> piece_shape = layout.piece_shape(p.name, whole, count, int64_t(k));
          auto it = by_name.find(n);
          if (it == by_name.end()) {
            absent.push_back(n);
            continue;
          }
          used.insert(n);
          pieces.push_back(&it->second);
          const auto shape = it->second.file->get(it->second.name).sizes().vec();
          if (shape != piece_shape)
            misshaped.push_back(fmt::format("{} [{}] in the file, [{}] expected as one of the {} pieces of {} [{}]", n,
                                            fmt::join(shape, ", "), fmt::join(piece_shape, ", "), count, p.name,
                                            fmt::join(whole, ", ")));
        }
        if (absent.size() == st->second.size()) continue;  // stored whole under another name, or missing
        if (!absent.empty()) {
          missing.push_back(fmt::format("{} (the pieces {})", p.name, list(absent, 4)));
          pieces_missing = true;
        } else {
          of_param[i] = pieces;
          ++stacked;
        }
      }
      if (of_param[i].empty() && !pieces_missing) {
        if (peft && is_lora_param(p.name)) ++kept_adapters;
        else missing.push_back(p.name);
      }
    }
    // Persistent buffers the files hold (DeepSeek V3's router e_score_correction_bias: it decides
    // which experts a token goes to, and save_pretrained writes it): loaded whole on every rank.
    std::vector<std::pair<at::Tensor, const Source*>> buffers;
    std::vector<std::string> buffer_names;
    for (const auto& b : model.module().named_buffers(/*recurse=*/true)) {
      std::string n = b.name;
      auto it = by_name.find(n);
      if (it == by_name.end() && peft) it = by_name.find(n = peft_to_hf_name(b.name));
      if (it == by_name.end() || used.count(n)) continue;
      used.insert(n);
      const auto shape = it->second.file->get(it->second.name).sizes().vec();
      if (shape != b.value.sizes().vec())
        misshaped.push_back(fmt::format("{} [{}] in the file, [{}] in the model (a buffer)", n, fmt::join(shape, ", "),
                                        fmt::join(b.value.sizes(), ", ")));
      else {
        buffers.emplace_back(b.value, &it->second);
        buffer_names.push_back(b.name);
      }
    }
    std::vector<std::string> unexpected;
    std::set<std::string> ignored_by;  // the patterns of from_pretrained's ignored tensors that matched
    int64_t ignored = 0;
    for (const auto& [n, s] : by_name) {
      if (used.count(n)) continue;
      bool ignore = false;
      for (const auto& [text, re] : layout.ignore_unexpected)
        if (std::regex_search(n, re)) {
          ignore = true;
          ignored_by.insert(text);
          break;
        }
      if (ignore) ++ignored;
      else unexpected.push_back(n == s.name ? n : n + " (from " + s.name + ")");
    }
    if (!missing.empty() || !unexpected.empty() || !misshaped.empty()) {
      std::string msg = src + ": model.init_from does not fit " + model.path() + ":";
      if (!missing.empty()) msg += fmt::format("\n  missing (in the model, not in the files): {}", list(missing));
      if (!unexpected.empty()) msg += fmt::format("\n  unexpected (in the files, not in the model): {}", list(unexpected));
      if (!misshaped.empty()) msg += fmt::format("\n  mis-shaped: {}", list(misshaped, 6));
      msg += "\n  (model.init_from_rename: \"REGEX=REPLACEMENT\" rules map the files' names; an empty result drops one)";
      throw UserError(msg);
    }
    // This rank's slots: their elements of the global tensor (its TP slice, its shard of that).
    int64_t copied = 0;
    at::NoGradGuard ng;
    auto& slots = engine.slots();
    const auto& ranges = engine.slot_ranges();
    std::map<std::string, size_t> param_by_name;
    for (size_t i = 0; i < model.params().size(); ++i) param_by_name[model.params()[i].name] = i;
    for (size_t i = 0; i < slots.size(); ++i) {
      const auto& sources = of_param.at(param_by_name.at(slots[i].name));
      if (sources.empty()) continue;  // a LoRA adapter the files lack: as exported
      // The global elements laid end to end: one tensor, or a stack's pieces in order (views of
      // the mapped files); starts[k] is piece k's first global element.
      std::vector<at::Tensor> flat;
      std::vector<int64_t> starts{0};
      for (const Source* s : sources) {
        flat.push_back(s->file->get(s->name).reshape({-1}));
        starts.push_back(starts.back() + flat.back().numel());
      }
      at::Tensor dst = slots[i].weight.reshape({-1});
      const auto& r = ranges[i];
      r.tp.for_each_run(r.begin, r.end, [&](int64_t g, int64_t l, int64_t len) {
        size_t k = size_t(std::upper_bound(starts.begin(), starts.end(), g) - starts.begin()) - 1;
        for (int64_t done = 0; done < len; ++k) {  // a run may span pieces
          const int64_t from = g + done - starts[k], n = std::min(len - done, starts[k + 1] - (g + done));
          dst.narrow(0, l - r.begin + done, n).copy_(flat[k].narrow(0, from, n));
          done += n;
        }
        copied += len;
      });
      // The slice read, its mapped pages need not stay resident: otherwise the peak of the load
      // is this rank's shards plus every page of the files it touched.
      for (const Source* s : sources) s->file->release(s->name);
    }
    for (auto& [buffer, s] : buffers) {
      buffer.copy_(s->file->get(s->name));
      s->file->release(s->name);
    }
    model.loaded_buffers() = buffer_names;
    std::string types;
    for (const auto& [t, _] : dtypes) types += (types.empty() ? "" : "/") + t;
    summary = fmt::format("initial weights from {}: {} tensors in {} file(s) ({}), this rank read {} elements of its "
                          "slots{}",
                          src, used.size(), files.size(), types, copied,
                          rules.empty() ? "" : fmt::format(", {} rename rule(s)", rules.size())) +
              (stacked ? fmt::format("; {} parameter(s) stacked from per-expert tensors (the family's HF layout)",
                                     stacked)
                       : "") +
              (prefixed ? fmt::format("; {} name(s) taken with the base model's prefix '{}' added or stripped (as "
                                      "from_pretrained)", prefixed, layout.base_model_prefix)
                        : "") +
              (ignored ? fmt::format("; {} tensor(s) left out as from_pretrained leaves them ({})", ignored,
                                     join(std::vector<std::string>(ignored_by.begin(), ignored_by.end()), ", "))
                       : "") +
              (buffers.empty() ? "" : fmt::format("; {} buffer(s) ({}{})", buffers.size(), buffer_names.front(),
                                                  buffers.size() > 1 ? ", ..." : "")) +
              (kept_adapters ? fmt::format("; {} LoRA adapter tensors not in the files kept as exported", kept_adapters)
                             : "");
  } catch (const UserError& e) {
    error = e.what();
  } catch (const std::exception& e) {
    error = src + ": model.init_from: " + e.what();
  }
  auto errors = all_gather_strings(world, error);
  for (const auto& e : errors)
    if (!e.empty()) throw UserError(e);
  engine.install_weights();
  return summary;
}

}  // namespace mfsdp
