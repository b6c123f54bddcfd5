// model.init_from: initial weights from safetensors, each rank reading only its own slots.
#pragma once
#include <map>
#include <set>
#include <regex>
#include <string>
#include <utility>
#include <vector>

namespace mfsdp {

struct Config;
class Model;
class ParallelEngine;
class ProcessGroups;

// Fills this rank's main weights from cfg.model.init_from (a .safetensors file, or a directory with
// model.safetensors or model.safetensors.index.json, as Hugging Face writes them), matching the
// model's parameters by name (any alias of a tied weight) after cfg.model.init_from_rename. The files
// are memory-mapped and each rank copies only the elements of its slots (its TP slice, its shard),
// converting the dtype; then the engine installs them into the compute weights. Missing, unexpected
// and mis-shaped tensors are one UserError listing them all, raised on every rank. Returns a line
// for the log.
std::string init_weights_from(const Config& cfg, ProcessGroups& pg, Model& model, ParallelEngine& engine);

// A family's Hugging Face checkpoint layout where it differs from the model's names, as
// scripts/export_hf.py read it from transformers' conversion mapping (its mfsdp/hf_export.json
// "checkpoint_layout"): renames from the files' names to the model's, their reverse for writing,
// and parameters stacked from pieces (MoE experts: [E, K*r, ...] from E x K tensors of [r, ...],
// each piece one contiguous run of the parameter's elements, in order; pieces named as the model
// names them, before save_renames).
struct HfCheckpointLayout {
  std::vector<std::pair<std::regex, std::string>> renames, save_renames;
  std::map<std::string, std::vector<std::string>> stacks;
  // Stacked parameters whose pieces are concatenated along dim 0, named literally (OLMo-Hybrid's
  // q/k/v convolutions held as one conv1d). transformers saves them as torch.chunk cuts them
  // (Concatenate's reverse is Chunk): ceil(rows / count) rows each, the last one the rest. The
  // others stack E x K pieces of [r, ...] into [E, K*r, ...].
  std::set<std::string> concat_dim0;
  // As from_pretrained: a file's name that the model holds with the base model's prefix added
  // (a base model's checkpoint: GPT-2's h.0.attn... for transformer.h.0.attn...) or stripped, and
  // the file's tensors it ignores when the model lacks them (GPT-2's causal-mask attn.bias).
  std::string base_model_prefix;
  std::vector<std::pair<std::string, std::regex>> ignore_unexpected;  // (pattern text, regex)
  // The shape of piece k of stacked parameter `name` (whole shape `whole`, `count` pieces); empty
  // when the whole does not cut into `count` pieces.
  std::vector<int64_t> piece_shape(const std::string& name, const std::vector<int64_t>& whole, int64_t count,
                                   int64_t k) const;
  std::string save_name(std::string model_name) const {
    for (const auto& [re, to] : save_renames) model_name = std::regex_replace(model_name, re, to);
    return model_name;
  }
};
// From an hf_export.json text ("" or no layout: an empty one); `where` names the file for errors.
HfCheckpointLayout hf_checkpoint_layout(const std::string& hf_export_json, const std::string& where);

}  // namespace mfsdp
