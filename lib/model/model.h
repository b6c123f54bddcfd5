// A loaded TorchScript model: its unique parameters (tied weights once), its FSDP unit modules,
// and the forward call of the model contract: forward(tokens [B,T], position_ids [B,T]) -> logits.
#pragma once
#include <torch/script.h>

#include <algorithm>
#include <string>
#include <vector>

#include "config/config.h"
#include "model/tp_split.h"

namespace mfsdp {

struct ModelParam {
  std::string name;                 // first name in named_parameters order ("blocks.0.attn.c_attn.weight")
  std::vector<std::string> aliases;  // other names of the same tensor (tied weights)
  at::Tensor tensor;                // the parameter (a leaf that requires grad)
  int unit = -1;                    // index into units, or -1 for parameters outside every unit
  TpSplit tp;                       // tensor-parallel split (tensor holds this rank's slice)
  bool tp_grad_sum = false;         // replicated over TP but fed sequence-split activations:
                                    // its gradient is summed across the TP group
  bool frozen = false;              // model.trainable / model.frozen: no gradient, no optimizer state
  std::vector<int64_t> global_shape() const { return tp.split() ? tp.global_shape : tensor.sizes().vec(); }
  int64_t global_numel() const;
};

struct ModelUnit {
  std::string path;        // module path ("blocks.3")
  std::string class_name;  // unqualified TorchScript class ("Block")
  std::vector<int> params;  // indices into Model::params
  // A block (a transformer layer) rather than a leaf module made a unit for memory (an embedding
  // table or an output head outside the layers). Only blocks see sequence-split activations under
  // sequence parallelism, are checkpointed by activation_checkpointing, count as layers in the
  // FLOP estimate and share fsdp_double_buffer's buffers. When every unit is a leaf module, every
  // unit is a block.
  bool block = true;
};

class Model {
 public:
  // Loads `path`; errors name the file. Parameters sharing storage become one parameter.
  // on_meta: the parameters' bytes are not read (load_skeleton: the file's weights never exist in
  // memory); parameters become empty CPU placeholders for the engine to fill shard by shard;
  // buffers are read and put on `device`.
  // device: where the parameters and buffers go (the file is mapped straight onto it); with
  // on_meta the placeholders stay on the CPU and the engine allocates the shards on `device`.
  static Model load(const std::string& path, bool on_meta = false, c10::Device device = c10::Device(c10::kCPU));
  bool loaded_on_meta() const { return on_meta_; }
  // What the load did, for the log ("" for a normal load).
  const std::string& load_note() const { return load_note_; }
  // "path.forwardN" of modules called more than once per forward whose traced calls differ from
  // their forward (graph_rewrite.h, unify_traced_repeats): rewrites of forward do not reach them.
  const std::vector<std::string>& traced_repeats() const { return traced_repeats_; }
  c10::Device device() const { return device_; }

  torch::jit::Module& module() { return module_; }
  const torch::jit::Module& module() const { return module_; }
  const std::vector<ModelParam>& params() const { return params_; }
  std::vector<ModelParam>& params() { return params_; }
  const std::vector<ModelUnit>& units() const { return units_; }
  // The units that are blocks (ModelUnit::block): how many, and the first one's index (-1: none).
  int64_t num_block_units() const;
  int first_block_unit() const;
  // Parameter i belongs to a block unit.
  bool in_block(size_t i) const { return params_[i].unit >= 0 && units_[size_t(params_[i].unit)].block; }
  const std::string& path() const { return path_; }
  // The tensor-parallel plan the exporter stored in the file (extra file "mfsdp/tp_plan.json", a
  // JSON object glob -> style), or "" when it has none.
  const std::string& stored_tp_plan() const { return stored_tp_plan_; }
  // The parameters the exporter marked trainable (extra file "mfsdp/trainable.json", a JSON list of
  // names: a PEFT model's adapters), or "" when it has none.
  const std::string& stored_trainable() const { return stored_trainable_; }
  // What scripts/export_hf.py recorded of a Hugging Face export (extra file "mfsdp/hf_export.json":
  // family, class, attention implementation, attention_window), or "" for other models.
  const std::string& stored_hf_export() const { return stored_hf_export_; }
  // Buffers whose values came from model.init_from (a checkpoint's persistent buffers, such as
  // DeepSeek V3's router e_score_correction_bias) rather than from the file: checkpoints save them
  // (rank 0's file, "buffer/NAME"), a resume restores them, export --format hf writes them.
  std::vector<std::string>& loaded_buffers() { return loaded_buffers_; }
  const std::vector<std::string>& loaded_buffers() const { return loaded_buffers_; }
  // Applies model.trainable / model.frozen (and the stored list when model.trainable is not set):
  // frozen parameters stop requiring gradients. Call after every step that replaces parameter
  // tensors (tensor parallelism), before the engine is built. Throws a ConfigError for a glob
  // that matches no parameter or a selection that leaves nothing to train. Returns a log line, or
  // "" when every parameter trains.
  std::string apply_trainable(const Config& cfg);
  // Which parameters model.trainable / model.frozen (or the file's mfsdp/trainable.json) leave to
  // train, by index; the same checks as apply_trainable, without changing anything. `source` names
  // where the selection came from.
  std::vector<bool> trainable_mask(const Config& cfg, std::string* source = nullptr) const;

  // Chooses the FSDP units: `patterns` (class names, qualified class names or module-path globs,
  // outermost match wins) or, when null, the largest set of repeated sibling modules, and besides
  // them every leaf module outside them whose own (untied) parameters are at least the largest
  // such block's (a large vocabulary's embedding table and output head: units of their own, as
  // torchtitan shards them). Throws a ConfigError listing the module tree when nothing matches.
  // Returns a one-line description.
  // Paths of the modules (root excluded) whose class name, qualified class name or path glob is
  // one of `patterns`, in module order.
  std::vector<std::string> modules_matching(const std::vector<std::string>& patterns) const;
  // Puts `t` on the module as parameter `dotted` ("blocks.0.attn.c_attn.weight"), replacing it.
  void set_parameter(const std::string& dotted, const at::Tensor& t);

  std::string find_units(const std::optional<std::vector<std::string>>& patterns, const std::string& where);

  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& position_ids);
  // GELU (tanh), RMSNorm's scaling, SwiGLU's gate and the rotary embedding through mfsdp's kernels
  // (model/fast_ops.h): on the CPU all four; on a GPU the last three, each once its kernel has
  // passed its check against ATen there. Graph rewrites made before the first call. Not for a model
  // that is saved again (export): the file would call mfsdp's ops. Returns a line to log, or "".
  std::string use_fast_kernels();
  // scaled_dot_product_attention without dropout through mfsdp::sdpa (model/fast_ops.h) on
  // the CPU: after context parallelism has replaced the calls it splits (those are no longer SDPA
  // calls). MFSDP_FAST_ATTENTION=off keeps ATen's (and says so). Returns a line to log, or ""; in_use
  // says whether any call now runs mfsdp::sdpa.
  std::string use_fast_attention(bool& in_use);
  void train(bool on) { module_.train(on); }

  // Parameter counts for FLOP estimates: all, and without embedding tables (Embedding modules).
  int64_t num_params() const;
  int64_t num_embedding_params() const;
  // Width of the model (the embedding dimension) and the number of units (layers).
  int64_t hidden_size() const;
  std::string module_tree() const;

 private:
  torch::jit::Module module_;
  std::string path_;
  std::vector<ModelParam> params_;
  std::vector<ModelUnit> units_;
  bool on_meta_ = false;
  std::string load_note_;
  std::vector<std::string> traced_repeats_;
  c10::Device device_{c10::kCPU};
  std::string stored_tp_plan_;
  std::string stored_trainable_;
  std::string stored_hf_export_;
  std::vector<std::string> loaded_buffers_;
};

// PEFT's names in a model file (export_hf.py wraps the transformers model in a PeftModel):
//   base_model.model.<hf module>.base_layer.weight        the adapted layer's own weight
//   base_model.model.<hf module>.lora_A.<adapter>.weight  [r, in]
//   base_model.model.<hf module>.lora_B.<adapter>.weight  [out, r]
//   base_model.model.<hf name>                             everything else
// peft_to_hf_name: to the transformers model's names ("X.base_layer.weight" -> "X.weight", the
// prefix dropped; other names unchanged). is_lora_param: an adapter tensor (lora_A or lora_B, any
// suffix). lora_part: ".lora_A.default.weight" -> ("lora_A", "default") and the module before it;
// empty for anything but an adapter weight.
std::string peft_to_hf_name(const std::string& name);
bool is_lora_param(const std::string& name);
std::pair<std::string, std::string> lora_part(const std::string& name, std::string* module);
// The adapted module of a DoRA magnitude (...q_proj.lora_magnitude_vector.ADAPTER.weight -> ...q_proj),
// else "".
std::string dora_magnitude_module(const std::string& name);

// "__torch__.___torch_mangle_3.Block" -> "Block"; "__torch__.model.Block" -> "model.Block" kept
// for qualified matching by qualified_class_name().
std::string unqualified_class_name(const torch::jit::Module& m);
std::string qualified_class_name(const torch::jit::Module& m);

}  // namespace mfsdp
