#include "model/model.h"

#include <fmt/format.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

#include <cstring>
#include <map>
#include <regex>
#include <set>

#include "model/cpu_attention.h"
#include "model/fast_dropout.h"
#include "model/fast_ops.h"
#include "model/graph_rewrite.h"
#include "model/skeleton_load.h"
#include "parallel/tp_ops.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {

std::string qualified_class_name(const torch::jit::Module& m) {
  std::string q = m.type()->name() ? m.type()->name()->qualifiedName() : std::string("?");
  // Traced modules get a mangled type per instance: drop the mangling namespace.
  static const std::regex mangle(R"(___torch_mangle_\d+\.)");
  q = std::regex_replace(q, mangle, "");
  return q;
}

std::string unqualified_class_name(const torch::jit::Module& m) {
  std::string q = qualified_class_name(m);
  auto dot = q.rfind('.');
  return dot == std::string::npos ? q : q.substr(dot + 1);
}

namespace {
void set_param(torch::jit::Module root, const std::string& dotted, const at::Tensor& t) {
  auto parts = split(dotted, '.');
  torch::jit::Module owner = root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) owner = owner.attr(parts[i]).toModule();
  owner.register_parameter(parts.back(), t, /*is_buffer=*/false);
}
}  // namespace

Model Model::load(const std::string& path, bool on_meta, c10::Device device) {
  if (const char* mode = std::getenv("MFSDP_JIT_EXECUTOR")) {  // measurement knob (bench/)
    std::string v = mode;
    if (v == "simple") { torch::jit::getProfilingMode() = false; torch::jit::getExecutorMode() = false; }
    if (v == "legacy") { torch::jit::getProfilingMode() = false; }
    if (v == "noopt") torch::jit::setGraphExecutorOptimize(false);
  }
  // TorchScript's TensorExpr fuser compiles fusion groups on GPUs (never on CPUs by default): off
  // unless MFSDP_JIT_FUSER=on, so that a GPU run executes the same graphs the CPU suite checks
  // (bench/gpu_llama.py measures both).
  if (device.is_cuda()) {
    const char* fuser = std::getenv("MFSDP_JIT_FUSER");
    torch::jit::setTensorExprFuserEnabled(fuser && std::string(fuser) == "on");
  }
  Model m;
  m.path_ = path;
  m.on_meta_ = on_meta;
  m.device_ = device;
  try {
    torch::jit::ExtraFilesMap extra{{"mfsdp/tp_plan.json", ""}, {"mfsdp/trainable.json", ""},
                                    {"mfsdp/hf_export.json", ""}};
    if (on_meta) {
      SkeletonStats st;
      m.module_ = load_skeleton(path, extra, &st);
      m.load_note_ = fmt::format("model loaded without its parameters' bytes (init_fsdp_with_meta_device): {} tensor "
                                 "records ({:.1f} MiB) left unread; buffers read back: {} ({:.1f} KiB)",
                                 st.records_skipped - st.tensors_read_back,
                                 (st.bytes_skipped - st.bytes_read_back) / 1048576.0, st.tensors_read_back,
                                 st.bytes_read_back / 1024.0);
    } else {
      m.module_ = torch::jit::load(path, device, extra);
    }
    m.stored_tp_plan_ = extra["mfsdp/tp_plan.json"];
    m.stored_trainable_ = extra["mfsdp/trainable.json"];
    m.stored_hf_export_ = extra["mfsdp/hf_export.json"];
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    throw UserError(path + ": cannot load this TorchScript model (model.path): " + what.substr(0, what.find('\n')));
  } catch (const std::exception& e) {
    throw UserError(path + ": cannot load this TorchScript model (model.path): " + e.what());
  }
  if (!m.module_.find_method("forward"))
    throw UserError(path + ": the TorchScript module has no forward method");
  // Repeated calls of a module traced as methods of their own (forward1, ...): pointed at forward
  // where they are the same graph, before any rewrite looks for calls of forward (graph_rewrite.h).
  {
    const TracedRepeats rep = unify_traced_repeats(m.module_);
    if (rep.unified > 0)
      m.load_note_ += fmt::format("{}{} repeated call(s) of traced modules pointed at their forward",
                                  m.load_note_.empty() ? "" : "; ", rep.unified);
    m.traced_repeats_ = rep.differing;
  }
  // Dropout traced in training (export_hf.py --dropout config, or a trace by hand) is made to follow
  // train()/eval(), so that validation runs without it; before any call (graph_rewrite.h).
  if (const int n = dropout_follows_mode(m.module_); n > 0)
    m.load_note_ += fmt::format("{}{} dropout call(s) traced in training mode: active in training, off in evaluation",
                                m.load_note_.empty() ? "" : "; ", n);
  // Unique parameters: tensors that share storage (tied weights) become one parameter, and every
  // alias attribute is pointed at the same tensor so that autograd accumulates one gradient.
  // Identity is the storage object (meta tensors have no data pointer), offset and shape.
  std::map<std::tuple<const void*, int64_t, std::vector<int64_t>>, int> seen;
  for (const auto& np : m.module_.named_parameters(/*recurse=*/true)) {
    at::Tensor t = np.value;
    auto key = std::make_tuple(static_cast<const void*>(t.storage().unsafeGetStorageImpl()), t.storage_offset(),
                               t.sizes().vec());
    auto it = seen.find(key);
    if (it != seen.end()) {
      m.params_[it->second].aliases.push_back(np.name);
      continue;
    }
    seen[key] = static_cast<int>(m.params_.size());
    t.set_requires_grad(t.is_floating_point());
    ModelParam param;
    param.name = np.name;
    param.tensor = t;
    m.params_.push_back(param);
  }
  if (m.params_.empty()) throw UserError(path + ": the model has no parameters to train");
  if (on_meta) {
    // Placeholders of the right shape; at::empty touches no pages, and the engine replaces the data.
    // Dropping the loaded tensors unmaps their unread storage.
    for (auto& p : m.params_) {
      p.tensor = at::empty(p.tensor.sizes(), at::TensorOptions().dtype(p.tensor.scalar_type())).set_requires_grad(true);
      set_param(m.module_, p.name, p.tensor);
    }
    // Buffers were read on the CPU; they go where a normal load puts them.
    if (!device.is_cpu())
      for (const auto& sub : m.module_.modules()) {
        auto type = sub.type();
        for (size_t i = 0; i < type->numAttributes(); ++i) {
          if (type->is_parameter(i)) continue;
          c10::IValue v = sub._ivalue()->getSlot(i);
          if (v.isTensor() && v.toTensor().defined()) sub._ivalue()->setSlot(i, v.toTensor().to(device));
        }
      }
  }
  for (auto& p : m.params_)
    for (const auto& alias : p.aliases) set_param(m.module_, alias, p.tensor);
  return m;
}

std::string Model::use_fast_kernels() {
  auto off = [](const char* knob) {
    const char* v = std::getenv(knob);
    return v && std::string(v) == "off";
  };
  // MFSDP_FAST_GELU=off / MFSDP_FAST_RMSNORM=off / MFSDP_FAST_SWIGLU=off / MFSDP_FAST_ROTARY=off keep
  // ATen's (bench/ measures both ways).
  if (device_.is_cuda()) {
    // RMSNorm's scaling, SwiGLU's gate and the rotary embedding through the GPU kernels that pass
    // their check on this GPU (fast_ops.h: verify_device_fast_ops); GELU stays ATen's.
    const DeviceKernelCheck c = verify_device_fast_ops(device_);
    const int rms = c.rms && !off("MFSDP_FAST_RMSNORM") ? use_fast_rms_norm(module_) : 0;
    const int swiglu = c.swiglu && !off("MFSDP_FAST_SWIGLU") ? use_fast_swiglu(module_) : 0;
    const int rotary = c.rotary && !off("MFSDP_FAST_ROTARY") ? use_fast_rotary(module_) : 0;
    if (rms + swiglu + rotary == 0 && c.report.empty()) return "";
    return fmt::format(
        "mfsdp's GPU kernels (checked against ATen on {}): {} RMSNorm scaling(s), {} SwiGLU gate(s), {} rotary "
        "embedding(s){}",
        device_.str(), rms, swiglu, rotary, c.report);
  }
  if (!device_.is_cpu()) return "";
  // GELU's tanh form, RMSNorm's scaling, SwiGLU's gate and the rotary embedding through mfsdp's CPU
  // kernels (model/fast_ops.h).
  const int gelu = off("MFSDP_FAST_GELU") ? 0 : use_fast_gelu(module_);
  const int rms = off("MFSDP_FAST_RMSNORM") ? 0 : use_fast_rms_norm(module_) + use_fast_rms_norm_op(module_);
  const int swiglu = off("MFSDP_FAST_SWIGLU") ? 0 : use_fast_swiglu(module_);
  const int rotary = off("MFSDP_FAST_ROTARY") ? 0 : use_fast_rotary(module_);
  // Dropout's masks drawn by mfsdp: ATen's numbers, without its per-element cost (fast_dropout.h).
  const int dropout = off("MFSDP_FAST_DROPOUT") ? 0 : use_fast_dropout(module_);
  if (gelu + rms + swiglu + rotary + dropout == 0) return "";
  return fmt::format(
      "mfsdp's CPU kernels: {} GELU (tanh) call(s), {} RMSNorm scaling(s), {} SwiGLU gate(s), {} rotary "
      "embedding(s), {} dropout(s)",
      gelu, rms, swiglu, rotary, dropout);
}

std::string Model::use_fast_attention(bool& in_use) {
  in_use = false;
  if (!device_.is_cpu()) return "";
  if (const char* knob = std::getenv("MFSDP_FAST_ATTENTION"); knob && std::string(knob) == "off")
    return "mfsdp's CPU attention: off (MFSDP_FAST_ATTENTION=off): ATen's scaled_dot_product_attention runs";
  const int n = mfsdp::use_fast_attention(module_), written = mfsdp::use_fast_eager_attention(module_);
  if (n + written == 0) return "";
  in_use = true;
  return fmt::format("mfsdp's CPU attention: {} scaled_dot_product_attention call(s){} (fp32, and bf16 {}; "
                     "probabilities kept up to {} keys, recomputed from a log-sum-exp beyond when causal; "
                     "ATen's flash attention for longer calls that are not)",
                     n,
                     written ? fmt::format(" and {} written out (softmax(q k^T) v, or mfsdp::attention)", written) : "",
                     cpu_attention_bf16_products() ? "with bf16 products accumulated in fp32" : "computed in fp32",
                     kCpuAttentionMaxKeys);
}

std::string peft_to_hf_name(const std::string& name) {
  static const std::string prefix = "base_model.model.", base = ".base_layer.";
  std::string n = name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
  auto at = n.find(base);
  if (at != std::string::npos) n.erase(at, base.size() - 1);
  return n;
}

bool is_lora_param(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

std::pair<std::string, std::string> lora_part(const std::string& name, std::string* module) {
  for (const char* ab : {".lora_A.", ".lora_B."}) {
    auto at = name.find(ab);
    if (at == std::string::npos) continue;
    const size_t rest = at + std::strlen(ab);
    auto dot = name.find('.', rest);
    if (dot == std::string::npos || name.substr(dot) != ".weight") return {};
    if (module) *module = name.substr(0, at);
    return {std::string(ab).substr(1, 6), name.substr(rest, dot - rest)};
  }
  return {};
}

std::string dora_magnitude_module(const std::string& name) {
  static const std::string tag = ".lora_magnitude_vector.";
  auto at = name.find(tag);
  if (at == std::string::npos) return {};
  auto dot = name.find('.', at + tag.size());
  if (dot == std::string::npos || name.substr(dot) != ".weight") return {};
  return name.substr(0, at);
}

int64_t ModelParam::global_numel() const {
  int64_t n = 1;
  for (int64_t d : global_shape()) n *= d;
  return n;
}

at::Tensor Model::forward(const at::Tensor& tokens, const at::Tensor& position_ids) {
  set_sequence_length(tokens.dim() >= 2 ? tokens.size(1) : 0);
  c10::IValue out = module_.forward({tokens, position_ids});
  if (!out.isTensor())
    throw UserError(path_ + ": forward must return the logits tensor [B, T, V] (model contract), got " +
                    out.tagKind());
  return out.toTensor();
}

int64_t Model::num_params() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.global_numel();  // whole tensors, also after a TP split
  return n;
}

int64_t Model::num_embedding_params() const {
  int64_t n = 0;
  std::set<std::string> emb_prefixes;
  for (const auto& nm : module_.named_modules())
    if (unqualified_class_name(nm.value) == "Embedding") emb_prefixes.insert(nm.name + ".");
  // A parameter is an embedding table only when every name it has lies under an Embedding: an
  // output head tied to the table (lm_head.weight = wte.weight) does the logits' matmul, whose
  // FLOPs count (6 x vocab x hidden per token, as in Megatron's formula).
  for (const auto& p : params_) {
    bool all_emb = true;
    for (const auto& name : [&] { auto v = p.aliases; v.push_back(p.name); return v; }()) {
      bool under = false;
      for (const auto& pre : emb_prefixes)
        if (name.rfind(pre, 0) == 0) under = true;
      all_emb = all_emb && under;
    }
    if (all_emb) n += p.global_numel();
  }
  return n;
}

int64_t Model::hidden_size() const {
  for (const auto& nm : module_.named_modules())
    if (unqualified_class_name(nm.value) == "Embedding")
      for (const auto& p : nm.value.named_parameters(false)) return p.value.size(1);
  // No embedding table: the width of the last weight matrix's input.
  for (auto it = params_.rbegin(); it != params_.rend(); ++it)
    if (it->tensor.dim() == 2) return it->tensor.size(1);
  return 0;
}

std::string Model::module_tree() const {
  std::string out;
  for (const auto& nm : module_.named_modules()) {
    if (nm.name.empty()) {
      out += "  (root) " + qualified_class_name(nm.value) + "\n";
      continue;
    }
    size_t depth = std::count(nm.name.begin(), nm.name.end(), '.') + 1;
    out += std::string(2 * depth + 2, ' ') + nm.name + " : " + unqualified_class_name(nm.value) + "\n";
  }
  return out;
}

std::vector<std::string> Model::modules_matching(const std::vector<std::string>& patterns) const {
  std::vector<std::string> out;
  for (const auto& nm : module_.named_modules()) {
    if (nm.name.empty()) continue;
    const std::string cls = unqualified_class_name(nm.value), qcls = qualified_class_name(nm.value);
    for (const auto& p : patterns)
      if (p == cls || p == qcls || glob_match(p, nm.name)) {
        out.push_back(nm.name);
        break;
      }
  }
  return out;
}

void Model::set_parameter(const std::string& dotted, const at::Tensor& t) { set_param(module_, dotted, t); }

std::string Model::find_units(const std::optional<std::vector<std::string>>& patterns, const std::string& where) {
  std::vector<std::pair<std::string, std::string>> chosen;  // path, class
  const auto modules = module_.named_modules();
  if (patterns) {
    for (const auto& nm : modules) {
      if (nm.name.empty()) continue;
      bool inside = false;  // outermost match wins
      for (const auto& c : chosen)
        if (nm.name.rfind(c.first + ".", 0) == 0) inside = true;
      if (inside) continue;
      const std::string cls = unqualified_class_name(nm.value), qcls = qualified_class_name(nm.value);
      for (const auto& pat : *patterns) {
        bool class_match = pat == cls || pat == qcls || (qcls.size() > pat.size() && qcls.compare(qcls.size() - pat.size(), pat.size(), pat) == 0 && qcls[qcls.size() - pat.size() - 1] == '.');
        if (class_match || glob_match(pat, nm.name)) {
          chosen.emplace_back(nm.name, cls);
          break;
        }
      }
    }
    for (const auto& nm : modules)
      for (const auto& c : chosen)
        if (nm.name == c.first && !nm.value.find_method("forward"))
          throw ConfigError(where + ": distributed.megatron_fsdp_unit_modules: module " + c.first + " (class " +
                            c.second + ") matches, but it has no forward of its own (a container such as "
                            "ModuleList is never called): name the modules inside it, such as " + c.first + ".*");
    if (chosen.empty())
      throw ConfigError(where + ": distributed.megatron_fsdp_unit_modules: [" + join(*patterns, ", ") +
                        "] matches no module of " + path_ + " (give class names such as Block, qualified names such "
                        "as __torch__.model.Block, or module-path globs such as blocks.*). The model's modules:\n" +
                        module_tree());
  } else {
    // Auto: among the children of every module, group by class; the group of repeated siblings
    // (two or more) that holds the most parameters is the set of units (ties: more members).
    // Weighing by parameters picks a model's transformer blocks over, say, the four projections
    // inside one attention layer.
    // Leaf modules (a model's two Embedding tables, say) are chosen only when no group of
    // modules with children repeats: a large position table must not outweigh the blocks.
    size_t best_count = 1;
    int64_t best_params = -1;
    bool best_leaf = true;
    for (const auto& nm : modules) {
      std::map<std::string, std::vector<std::string>> by_class;
      std::map<std::string, bool> leaf;
      for (const auto& child : nm.value.named_children()) {
        // A container without a forward of its own (ModuleList) is never called, so it cannot be
        // a unit: GraniteSWA's two ModuleLists (layers, rotary_embs) would otherwise tie with the
        // layers they hold (the same parameters, as many members) and win by coming first.
        if (!child.value.find_method("forward")) continue;
        const std::string cls = unqualified_class_name(child.value);
        by_class[cls].push_back(nm.name.empty() ? child.name : nm.name + "." + child.name);
        leaf[cls] = child.value.named_children().size() == 0;
      }
      // The elements of a container of layers (a ModuleList) of more than one class are one group:
      // a hybrid model's layers (OLMo-Hybrid's linear- and full-attention decoder layers, in any
      // ratio) are all blocks; grouped by class, only the weightier class would be units and the
      // others' parameters would stay gathered for the whole step under strategy 3, outside the
      // blocks that sequence parallelism splits. The key "" cannot be a class name.
      if (!nm.value.find_method("forward") && by_class.size() > 1 &&
          std::none_of(by_class.begin(), by_class.end(), [&](const auto& c) { return leaf[c.first]; })) {
        for (const auto& child : nm.value.named_children())
          if (child.value.find_method("forward"))
            by_class[""].push_back(nm.name.empty() ? child.name : nm.name + "." + child.name);
        leaf[""] = false;
      }
      for (const auto& [cls, paths] : by_class) {
        if (paths.size() < 2) continue;
        if (leaf[cls] && !best_leaf) continue;
        int64_t nparams = 0;
        for (const auto& p : params_)
          for (const auto& path : paths)
            if (p.name.rfind(path + ".", 0) == 0) nparams += p.tensor.numel();
        if ((best_leaf && !leaf[cls]) || nparams > best_params || (nparams == best_params && paths.size() > best_count)) {
          best_leaf = leaf[cls];
          best_count = paths.size();
          best_params = nparams;
          chosen.clear();
          for (const auto& path : paths) chosen.emplace_back(path, cls);
          if (cls.empty())  // the mixed group: each unit its own class
            for (auto& c : chosen)
              for (const auto& child : modules)
                if (child.name == c.first) c.second = unqualified_class_name(child.value);
        }
      }
    }
  }
  // Parameters of module `path` (and below) that only it uses: a tied one is also used elsewhere.
  auto own_params = [&](const std::string& path) {
    int64_t n = 0;
    for (const auto& p : params_) {
      bool inside = p.name.rfind(path + ".", 0) == 0;
      for (const auto& alias : p.aliases) inside = inside && alias.rfind(path + ".", 0) == 0;
      if (inside) n += p.tensor.numel();
    }
    return n;
  };
  if (!patterns && !chosen.empty()) {
    // Auto, besides the blocks: a leaf module outside them that holds at least as many (untied)
    // parameters as the largest block is a unit of its own. Under strategy 3 the parameters outside
    // every unit are gathered whole for the whole step with their full gradient; for a large
    // vocabulary that is the embedding table and the output head, which then set the peak
    // (bench/results_init_from.md: 1.5x against 1.2x the model's size per rank at 4 ranks).
    int64_t largest = 0;
    for (const auto& c : chosen) largest = std::max(largest, own_params(c.first));
    std::map<std::string, size_t> order;
    for (const auto& nm : modules) order.emplace(nm.name, order.size());
    std::vector<std::pair<std::string, std::string>> extra;
    for (const auto& nm : modules) {
      if (nm.name.empty() || nm.value.named_children().size() != 0) continue;
      bool inside = false;
      for (const auto& c : chosen) inside = inside || nm.name == c.first || nm.name.rfind(c.first + ".", 0) == 0;
      if (!inside && largest > 0 && own_params(nm.name) >= largest)
        extra.emplace_back(nm.name, unqualified_class_name(nm.value));
    }
    chosen.insert(chosen.end(), extra.begin(), extra.end());
    std::stable_sort(chosen.begin(), chosen.end(),
                     [&](const auto& a, const auto& b) { return order.at(a.first) < order.at(b.first); });
  }
  units_.clear();
  std::map<std::string, bool> leaf_of;
  for (const auto& nm : modules) leaf_of[nm.name] = nm.value.named_children().size() == 0;
  for (const auto& [path, cls] : chosen) units_.push_back({path, cls, {}, !leaf_of.at(path)});
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].unit = -1;
    // A tied parameter that is also used outside the unit (an embedding shared with the output
    // head) cannot be freed with the unit: it stays with the parameters outside units.
    auto inside = [&](const std::string& path) {
      if (params_[i].name.rfind(path + ".", 0) != 0) return false;
      for (const auto& alias : params_[i].aliases)
        if (alias.rfind(path + ".", 0) != 0) return false;
      return true;
    };
    for (size_t u = 0; u < units_.size(); ++u)
      if (inside(units_[u].path)) {
        params_[i].unit = static_cast<int>(u);
        units_[u].params.push_back(static_cast<int>(i));
        break;
      }
  }
  // A unit with no parameters of its own (all tied elsewhere) has nothing to shard: drop it.
  std::vector<ModelUnit> kept;
  for (auto& u : units_)
    if (!u.params.empty()) kept.push_back(u);
  units_ = kept;
  if (std::none_of(units_.begin(), units_.end(), [](const ModelUnit& u) { return u.block; }))
    for (auto& u : units_) u.block = true;  // units that are all leaf modules are the blocks
  for (auto& p : params_) p.unit = -1;
  for (size_t u = 0; u < units_.size(); ++u)
    for (int pi : units_[u].params) params_[pi].unit = static_cast<int>(u);
  if (units_.empty())
    return "no repeated sibling modules: the whole model is one unit (set distributed.megatron_fsdp_unit_modules)";
  // "22 units: 20 of class DecoderLayer (layers.0 .. layers.19), Embedding (embed_tokens), Linear (lm_head)"
  std::vector<std::pair<std::string, std::vector<std::string>>> by_class;  // in order of first unit
  for (const auto& u : units_) {
    auto it = std::find_if(by_class.begin(), by_class.end(), [&](const auto& c) { return c.first == u.class_name; });
    if (it == by_class.end()) by_class.push_back({u.class_name, {u.path}});
    else it->second.push_back(u.path);
  }
  std::vector<std::string> parts;
  for (const auto& [cls, paths] : by_class)
    parts.push_back(fmt::format("{}{} ({}{})", paths.size() > 1 ? fmt::format("{} of class ", paths.size()) : "",
                                cls, paths.front(), paths.size() > 1 ? " .. " + paths.back() : ""));
  std::vector<std::string> outer;
  for (const auto& u : units_)
    if (!u.block) outer.push_back(u.path);
  return fmt::format("{} units: {}{}{}", units_.size(), join(parts, ", "), patterns ? "" : ", auto-detected",
                     outer.empty() ? ""
                                   : fmt::format(" ({}: leaf modules outside the blocks, units of their own{})",
                                                 join(outer, ", "),
                                                 patterns ? "" : " as each holds at least a block's parameters"));
}

int64_t Model::num_block_units() const {
  return std::count_if(units_.begin(), units_.end(), [](const ModelUnit& u) { return u.block; });
}

int Model::first_block_unit() const {
  for (size_t u = 0; u < units_.size(); ++u)
    if (units_[u].block) return int(u);
  return -1;
}

}  // namespace mfsdp
