#include "parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "mesh/process_groups.h"
#include "model/graph_rewrite.h"
#include "model/model.h"
#include "parallel/tp_ops.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {
namespace {

using torch::jit::Node;
using torch::jit::Value;

constexpr const char* kSpFirstAttr = "_mfsdp_sp_first";

struct ResolvedPlan {
  TpPlan entries;
  std::string source;                     // for messages
  std::vector<std::string> entry_where;   // "file:line:col" of each entry
};

ResolvedPlan resolve_plan(const Model& model, const Config& cfg) {
  ResolvedPlan r;
  if (cfg.distributed.tp_plan) {
    r.entries = *cfg.distributed.tp_plan;
    r.source = "distributed.tp_plan (" + cfg.where("distributed.tp_plan") + ")";
    for (const auto& e : r.entries) r.entry_where.push_back(cfg.where("distributed.tp_plan." + e.first));
    return r;
  }
  if (model.stored_tp_plan().empty()) return r;
  const std::string where = model.path() + " (its stored plan, mfsdp/tp_plan.json)";
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(model.stored_tp_plan());
  } catch (const std::exception& e) {
    throw UserError(where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw UserError(where + ": expected a JSON object {\"module.glob\": \"style\"}");
  for (auto it = j.begin(); it != j.end(); ++it) {
    TpStyle st;
    const std::string text = it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
    const std::string expected = parse_tp_style(text, st);
    if (!expected.empty()) throw UserError(where + ": entry '" + it.key() + "': expected " + expected + ", got '" + text + "'");
    r.entries.emplace_back(it.key(), text);
    r.entry_where.push_back(where);
  }
  r.source = where;
  return r;
}

// Hugging Face's Conv1D (transformers.pytorch_utils.Conv1D: GPT-2's projections) computes
// addmm(bias, x.view(-1, in), weight).view(..., nf): a Linear whose weight is stored transposed
// ([in, out]), with the output width baked into the trace's view. Its aten::addmm node, or nullptr
// (for anything else, a Linear included).
Node* conv1d_node(const torch::jit::Module& mod) {
  if (!mod.find_method("forward")) return nullptr;
  auto& fn = torch::jit::toGraphFunction(mod.get_method("forward").function());
  auto g = fn.graph();
  auto self_attr = [&](Value* v, const char* name) {
    return v->node()->kind() == c10::prim::GetAttr && v->node()->input(0) == g->inputs()[0] &&
           v->node()->s(c10::attr::name) == name;
  };
  auto one = [](Value* v) {
    auto c = torch::jit::toIValue(v);
    return c && ((c->isInt() && c->toInt() == 1) || (c->isDouble() && c->toDouble() == 1.0));
  };
  Node* found = nullptr;
  for (Node* n : g->nodes()) {
    if (n->kind() == c10::aten::linear) return nullptr;
    if (n->kind() != c10::aten::addmm) continue;
    if (found || n->inputs().size() != 5 || !self_attr(n->input(0), "bias") || !self_attr(n->input(2), "weight") ||
        !one(n->input(3)) || !one(n->input(4)))
      return nullptr;
    found = n;
  }
  return found;
}

// The module path of `v` relative to the graph's `self`, when v is a chain of GetAttr from it.
std::optional<std::string> attr_chain(Value* v, Value* self) {
  std::vector<std::string> parts;
  while (v != self) {
    Node* node = v->node();
    if (node->kind() != c10::prim::GetAttr) return std::nullopt;
    parts.push_back(node->s(c10::attr::name));
    v = node->input(0);
  }
  std::reverse(parts.begin(), parts.end());
  return join(parts, ".");
}

std::string child_path(const std::string& parent, const std::string& rel) {
  return parent.empty() ? rel : rel.empty() ? parent : parent + "." + rel;
}

// Calls fn(target, node) for every prim::CallMethod on a submodule in the forward graph of module
// `m` (at `path` in the model), in graph order, nested blocks included; target is the called
// module's full path. Descending further is fn's choice: the three walks over the forward graphs
// (the SP checks of modules after the units and of what they call, and the call order behind
// sequence_parallel_gather) differ only in that.
void for_each_call(const std::string& path, const torch::jit::Module& m,
                   const std::function<void(const std::string& target, Node* call)>& fn) {
  if (!m.find_method("forward")) return;
  auto g = torch::jit::toGraphFunction(m.get_method("forward").function()).graph();
  Value* self = g->inputs()[0];
  std::function<void(torch::jit::Block*)> walk = [&](torch::jit::Block* b) {
    for (Node* node : b->nodes()) {
      for (auto* sub : node->blocks()) walk(sub);
      if (node->kind() != c10::prim::CallMethod) continue;
      if (auto rel = attr_chain(node->input(0), self)) fn(child_path(path, *rel), node);
    }
  };
  walk(g->block());
}

std::string shape_str(const std::vector<int64_t>& s) { return "[" + fmt::format("{}", fmt::join(s, ", ")) + "]"; }

// The styled module whose forward's output the model returns as its logits, followed back from
// the return value through single-input ops (casts such as .float(), Gemma 2's soft cap) and into
// the graphs of unstyled wrapper modules (a PeftModel's base_model, its model); "" when the logits
// come from elsewhere, or from one of mfsdp's own ops (a gathered output, after the rewrite).
// `styled(path)` says whether the plan styles a module.
std::string logits_module(const Model& model, const std::function<bool(const std::string&)>& styled) {
  auto g = torch::jit::toGraphFunction(model.module().get_method("forward").function()).graph();
  std::string prefix;
  Value* v = g->return_node()->input(0);
  for (int hop = 0; hop < 16; ++hop) {
    Node* node = v->node();
    if (node->kind() == c10::prim::CallMethod) {
      auto rel = attr_chain(node->input(0), g->inputs()[0]);
      if (!rel || node->s(c10::attr::name) != "forward") return "";
      const std::string path = child_path(prefix, *rel);
      if (styled(path)) return path;
      torch::jit::Module sub = submodule_at(model.module(), path);
      g = torch::jit::toGraphFunction(sub.get_method("forward").function()).graph();
      prefix = path;
      v = g->return_node()->input(0);
      continue;
    }
    if (node->inputs().empty() || node->kind().is_prim() || !is_tensor_value(node->input(0))) return "";
    if (std::string(node->kind().toQualString()).rfind("mfsdp::", 0) == 0) return "";
    v = node->input(0);
  }
  return "";
}

std::string logits_module(const Model& model, const std::vector<std::pair<std::string, TpStyle>>& styles) {
  return logits_module(model, [&](const std::string& path) {
    return std::any_of(styles.begin(), styles.end(), [&](const auto& ps) { return ps.first == path; });
  });
}

bool style_splits_weight(const std::string& k) {
  return k == "colwise" || k == "colwise_rep" || k == "rowwise" || k == "rowwise_rep" || k == "vocab_parallel" ||
         k == "moe_experts";
}

}  // namespace

TpAssignment plan_tensor_parallel(const Model& model, const Config& cfg, int64_t tp) {
  const ResolvedPlan plan = resolve_plan(model, cfg);
  const bool sp = cfg.distributed.sequence_parallel;
  TpAssignment a;
  a.plan_source = plan.source;
  const size_t n = model.params().size();
  a.param_styles.assign(n, "");
  a.split_dim.assign(n, -1);
  a.parts.assign(n, {});
  a.grad_sum.assign(n, false);
  if (tp > 1)
    for (const auto& p : model.params())
      // DoRA scales each output row of W + s B A by m / ||W + s B A||_row, a norm over the whole input
      // dimension: a rowwise split would take it over one TP rank's columns and train a different model.
      if (!dora_magnitude_module(p.name).empty())
        throw ConfigError(cfg.where("distributed.tp_size") + ": distributed.tp_size is " + std::to_string(tp) +
                          " but " + model.path() + " has DoRA adapters (" + p.name +
                          "), which mfsdp does not split over tensor parallelism; train it with tp_size 1 "
                          "(dp_shard and cp shard it)");
  if (plan.entries.empty()) {
    if (tp > 1) {
      // The exporter's reason for storing no plan (hf_export.json tp_plan_note), e.g. DoRA adapters.
      std::string why;
      if (!model.stored_hf_export().empty()) {
        auto j = nlohmann::json::parse(model.stored_hf_export(), nullptr, false);
        if (j.is_object() && j.contains("tp_plan_note") && j["tp_plan_note"].is_string())
          why = " (the exporter: " + j["tp_plan_note"].get<std::string>() + ")";
      }
      throw ConfigError(cfg.where("distributed.tp_size") + ": distributed.tp_size is " + std::to_string(tp) +
                        " but there is no tensor-parallel plan: " + model.path() + " stores none" + why +
                        " and the config gives no distributed.tp_plan. Give one, e.g.\n"
                        "  tp_plan: {\"blocks.*.attn.c_attn\": \"colwise:3\", \"blocks.*.attn.c_proj\": rowwise, ...}\n"
                        "The model's modules:\n" + model.module_tree());
    }
    return a;
  }
  // Parameter index by every name (aliases included).
  std::map<std::string, int> by_name;
  for (size_t i = 0; i < n; ++i) {
    by_name[model.params()[i].name] = int(i);
    for (const auto& al : model.params()[i].aliases) by_name[al] = int(i);
  }
  std::vector<int> used(plan.entries.size(), 0);
  std::vector<std::string> owner(n);  // the module that decided a parameter's split
  struct Padded {
    size_t param, entry;
    std::string module, kind;
  };
  std::vector<Padded> padded;  // vocabulary splits that tp does not divide
  auto fail = [&](size_t e, const std::string& msg) -> void {
    throw ConfigError(plan.entry_where[e] + ": distributed.tp_plan entry '" + plan.entries[e].first + ": " +
                      plan.entries[e].second + "': " + msg);
  };
  for (const auto& nm : model.module().named_modules()) {
    if (nm.name.empty()) continue;
    size_t e = 0;
    while (e < plan.entries.size() && !glob_match(plan.entries[e].first, nm.name)) ++e;
    if (e == plan.entries.size()) continue;
    ++used[e];
    TpStyle style;
    parse_tp_style(plan.entries[e].second, style);
    // A glob's * spans dots: model.layers.*.conv matches LFM2's model.layers.0.conv.conv as well.
    // Inside a block of the same kind the outer block's one gather already covers it.
    if (style.kind == "sequence_whole" || style.kind == "sequence_gathered") {
      bool nested = false;
      for (const auto& [path, outer] : a.module_styles)
        nested = nested || (outer.kind == style.kind && nm.name.rfind(path + ".", 0) == 0);
      if (nested) continue;
    }
    // Inside a sequence_whole block every parameter's gradient is whole: a broader glob's
    // replicated style (MiniMax's layers.*.self_attn.norm, a mark for the layers whose attention
    // is split, matching the norm of a linear-attention layer kept whole) says nothing more there.
    if (style.kind == "sequence_parallel" || style.kind == "sequence_parallel_gather" ||
        style.kind == "replicated_with_grad_allreduce" || style.kind == "replicate") {
      bool in_whole = false;
      for (const auto& [path, outer] : a.module_styles)
        in_whole = in_whole || (outer.kind == "sequence_whole" && nm.name.rfind(path + ".", 0) == 0);
      if (in_whole) continue;
    }
    a.module_styles.emplace_back(nm.name, style);
    auto direct = nm.value.named_parameters(/*recurse=*/false);
    auto param_of = [&](const std::string& local) -> int {
      for (const auto& p : direct)
        if (p.name == local) return by_name.at(nm.name + "." + local);
      return -1;
    };
    auto assign = [&](int pi, int dim, std::vector<int64_t> parts) {
      const auto& p = model.params()[size_t(pi)];
      const auto shape = p.tensor.sizes().vec();
      if (dim >= 0) {
        const int64_t D = shape[size_t(dim)];
        if (parts.empty()) parts = {D};
        else if (parts.size() == 1) {  // N equal parts
          if (D % parts[0] != 0)
            fail(e, fmt::format("parameter {} has shape {}: dimension {} ({}) does not split into {} equal parts",
                                p.name, shape_str(shape), dim, D, parts[0]));
          parts = std::vector<int64_t>(size_t(parts[0]), D / parts[0]);
        } else {
          int64_t sum = 0;
          for (int64_t x : parts) sum += x;
          if (sum != D)
            fail(e, fmt::format("parameter {} has shape {}: the parts {} add up to {}, not dimension {} ({})", p.name,
                                shape_str(shape), shape_str(parts), sum, dim, D));
        }
        for (int64_t x : parts)
          if (x % tp != 0) {
            // A vocabulary that tp_size does not divide (GPT-2's 50257) is padded (TpSplit): the
            // embedding's rows, or the output head's, whose padding logits the loss masks; checked
            // below once the head is known.
            if ((style.kind == "vocab_parallel" || style.kind == "colwise") && parts.size() == 1 && dim == 0) {
              padded.push_back({size_t(pi), e, nm.name, style.kind});
              continue;
            }
            fail(e, fmt::format("parameter {} has shape {}: {} cuts dimension {} into {}, and {} is not divisible by "
                                "tp_size {}",
                                p.name, shape_str(shape), plan.entries[e].second, dim,
                                parts.size() > 1 ? "parts of " + shape_str(parts) : std::to_string(D), x, tp));
          }
      }
      if (!owner[size_t(pi)].empty() && (a.split_dim[size_t(pi)] != dim || a.parts[size_t(pi)] != parts))
        fail(e, fmt::format("parameter {} (tied) is also split by module {} ({}), differently", p.name,
                            owner[size_t(pi)], a.param_styles[size_t(pi)]));
      a.param_styles[size_t(pi)] = owner[size_t(pi)].empty() ? plan.entries[e].second
                                                               : a.param_styles[size_t(pi)] + " + " + plan.entries[e].second + " (tied)";
      owner[size_t(pi)] = nm.name;
      a.split_dim[size_t(pi)] = dim;
      a.parts[size_t(pi)] = parts;
    };
    const std::string& k = style.kind;
    if (style_splits_weight(k) && k != "moe_experts") {
      const int w = param_of("weight");
      if (w < 0 || model.params()[size_t(w)].tensor.dim() != 2)
        fail(e, fmt::format("module {} (class {}) has no 2-D parameter 'weight'; {} applies to Linear{} modules", nm.name,
                            unqualified_class_name(nm.value), k, k == "vocab_parallel" ? " and Embedding" : ""));
      // A Conv1D's weight is [in, out]: its output dimension is 0 for a Linear, 1 here.
      const bool conv1d = k != "vocab_parallel" && conv1d_node(nm.value) != nullptr;
      if (k == "rowwise" || k == "rowwise_rep") {
        assign(w, conv1d ? 0 : 1, {});
        const int b = param_of("bias");
        if (b >= 0 && sp) a.grad_sum[size_t(b)] = true;  // added after the reduce-scatter: partial sums
        if (b >= 0 && a.param_styles[size_t(b)].empty()) a.param_styles[size_t(b)] = "rowwise (bias)";
      } else if (k == "vocab_parallel") {
        assign(w, 0, {});
      } else {
        assign(w, conv1d ? 1 : 0, style.parts);
        const int b = param_of("bias");
        if (b >= 0) assign(b, 0, style.parts);
      }
    } else if (k == "moe_experts") {
      // Every expert's intermediate dimension split: the gate/up projection in its two packed parts
      // (HF's packed_colwise), the down projection along its input. Layout from the shapes:
      // gate_up_proj [E, 2I, H] with down_proj [E, H, I], or the transposes [E, H, 2I] / [E, I, H].
      const int gu = param_of("gate_up_proj") >= 0 ? param_of("gate_up_proj") : param_of("up_proj");
      const bool gated = param_of("gate_up_proj") >= 0;
      const int dn = param_of("down_proj");
      auto shape = [&](int pi) { return model.params()[size_t(pi)].tensor.sizes().vec(); };
      if (gu < 0 || dn < 0 || shape(gu).size() != 3 || shape(dn).size() != 3)
        fail(e, fmt::format("module {} (class {}) has no 3-D parameters gate_up_proj (or up_proj) and down_proj; "
                            "moe_experts applies to experts modules that hold every expert's weights in one tensor",
                            nm.name, unqualified_class_name(nm.value)));
      const auto a_gu = shape(gu), a_dn = shape(dn);
      const int64_t mult = gated ? 2 : 1;
      int gu_dim = -1, dn_dim = -1;
      if (a_gu[1] == mult * a_dn[2] && a_gu[2] == a_dn[1]) gu_dim = 1, dn_dim = 2;       // [E, 2I, H], [E, H, I]
      else if (a_gu[2] == mult * a_dn[1] && a_gu[1] == a_dn[2]) gu_dim = 2, dn_dim = 1;  // [E, H, 2I], [E, I, H]
      if (gu_dim < 0 || a_gu[0] != a_dn[0])
        fail(e, fmt::format("module {}: the expert weights' shapes {} and {} are neither [E, {}I, H] / [E, H, I] nor "
                            "their transposes", nm.name, shape_str(a_gu), shape_str(a_dn), gated ? "2" : ""));
      assign(gu, gu_dim, gated ? std::vector<int64_t>{2} : std::vector<int64_t>{});
      assign(dn, dn_dim, {});
      for (const auto& p : direct) {
        const int pi = by_name.at(nm.name + "." + p.name);
        if (pi == gu || pi == dn) continue;
        // A bias of the down projection would be added once per rank to the partial sums.
        fail(e, fmt::format("module {} has parameter {} besides the expert weights (biases are not supported "
                            "by moe_experts)", nm.name, p.name));
      }
    } else if (k == "replicated_with_grad_allreduce") {
      // Hugging Face's name (Qwen3's q_norm/k_norm): replicated weights applied to this rank's part
      // of the heads, so each rank's gradient is a partial sum: summed over TP, with or without SP.
      for (const auto& p : nm.value.named_parameters(/*recurse=*/true)) {
        const int pi = by_name.at(nm.name + "." + p.name);
        if (a.split_dim[size_t(pi)] >= 0) continue;
        a.grad_sum[size_t(pi)] = true;
        if (a.param_styles[size_t(pi)].empty()) a.param_styles[size_t(pi)] = k;
      }
    } else if (k == "sequence_parallel" || k == "sequence_parallel_gather") {
      for (const auto& p : nm.value.named_parameters(/*recurse=*/true)) {
        const int pi = by_name.at(nm.name + "." + p.name);
        if (a.split_dim[size_t(pi)] >= 0) continue;
        a.grad_sum[size_t(pi)] = sp;
        if (a.param_styles[size_t(pi)].empty()) a.param_styles[size_t(pi)] = k;
      }
    } else if (k == "sequence_whole") {
      // A block every TP rank runs whole (attention the plan does not split: Hugging Face configs
      // whose base_model_tp_plan leaves it out, gpt-oss's with its sinks, Qwen3-Next's linear
      // attention): its parameters are replicated and, its input gathered whole, their gradients
      // whole on every rank, with or without sequence parallelism: no sum.
      for (const auto& p : nm.value.named_parameters(/*recurse=*/true)) {
        const int pi = by_name.at(nm.name + "." + p.name);
        if (a.split_dim[size_t(pi)] < 0 && a.param_styles[size_t(pi)].empty()) a.param_styles[size_t(pi)] = k;
      }
    } else if (k == "replicate") {
      // Said explicitly: replicated with a gradient that is whole on every TP rank (inside a
      // sequence_gathered block, code between a colwise_rep layer's gathered output and a
      // rowwise_rep layer: OLMoE's q/k norms over all heads), so no sum.
      for (const auto& p : nm.value.named_parameters(/*recurse=*/true)) {
        const int pi = by_name.at(nm.name + "." + p.name);
        if (a.split_dim[size_t(pi)] < 0 && a.param_styles[size_t(pi)].empty()) a.param_styles[size_t(pi)] = k;
      }
    }
  }
  // Entries no module matched may name parameters: a module's own parameter beside its styled
  // submodules (Dory's per-layer lambda_1 and lambda_2, rates applied to the residual stream between
  // its attention and its MLP), which a style on the module would give to every parameter below it.
  // Only the replicated styles apply to a parameter alone; it must not be styled already.
  for (size_t e = 0; e < plan.entries.size(); ++e) {
    if (used[e]) continue;
    TpStyle style;
    parse_tp_style(plan.entries[e].second, style);
    for (size_t i = 0; i < n; ++i) {
      std::vector<std::string> names = model.params()[i].aliases;
      names.insert(names.begin(), model.params()[i].name);
      if (std::none_of(names.begin(), names.end(), [&](const std::string& nm) { return glob_match(plan.entries[e].first, nm); }))
        continue;
      const std::string& k = style.kind;
      if (k != "sequence_parallel" && k != "replicated_with_grad_allreduce" && k != "replicate")
        fail(e, "matches parameter " + model.params()[i].name + " and no module; a parameter alone takes "
                "sequence_parallel, replicated_with_grad_allreduce or replicate (the other styles apply to modules)");
      if (!a.param_styles[i].empty())
        fail(e, "parameter " + model.params()[i].name + " already has the style " + a.param_styles[i] +
                " from its module's entry");
      ++used[e];
      a.param_styles[i] = k + " (parameter)";
      a.grad_sum[i] = k == "replicated_with_grad_allreduce" || (k == "sequence_parallel" && sp);
    }
  }
  // A split parameter must be split for every module that uses it: a tied weight split by the
  // output head's colwise is also the embedding's table, which then needs vocab_parallel.
  for (size_t i = 0; i < n; ++i) {
    if (a.split_dim[i] < 0) continue;
    std::vector<std::string> names = model.params()[i].aliases;
    names.insert(names.begin(), model.params()[i].name);
    for (const auto& name : names) {
      const std::string owner_path = name.substr(0, name.rfind('.'));
      bool styled = false;
      for (const auto& [path, style] : a.module_styles)
        if (path == owner_path && style_splits_weight(style.kind)) styled = true;
      if (!styled)
        throw ConfigError(plan.source + ": parameter " + name + " is split by the style of module " + owner[i] + " (" +
                          a.param_styles[i] + "), but module " + owner_path +
                          " uses it too (tied) and has no splitting style in the plan; give it one (an embedding "
                          "tied to a colwise output head: vocab_parallel)");
    }
  }
  // Padding is sound only where nothing reads the padding rows: an embedding looks up real ids
  // only, and the padding columns of the logits are masked by the vocab-parallel loss, which
  // needs the colwise layer to be the output head (its output the model's logits, sharded).
  if (!padded.empty()) {
    const std::string head = logits_module(model, a.module_styles);
    for (const auto& pd : padded) {
      const auto& p = model.params()[pd.param];
      if (pd.kind == "colwise" && pd.module != head)
        fail(pd.entry, fmt::format("parameter {} has shape {}: colwise cuts dimension 0 into tp_size {} parts and {} is "
                                   "not divisible by {}; mfsdp pads an uneven split only for a vocabulary (a "
                                   "vocab_parallel embedding, or the colwise output head whose logits the model "
                                   "returns{})",
                                   p.name, shape_str(p.tensor.sizes().vec()), tp, p.tensor.size(0), tp,
                                   head.empty() ? ": this model's logits come from no colwise module" : ": here " + head));
    }
  }
  for (size_t e = 0; e < plan.entries.size(); ++e)
    if (!used[e]) fail(e, "matches no module of " + model.path() + " (patterns are globs over full module paths, or "
                          "parameter paths for the replicated styles). The model's modules:\n" + model.module_tree());
  auto inside = [&](const char* kind, const std::string& name) {
    for (const auto& [path, style] : a.module_styles)
      if (style.kind == kind && name.rfind(path + ".", 0) == 0) return true;
    return false;
  };
  auto gathered = [&](const std::string& name) { return inside("sequence_gathered", name); };
  auto whole = [&](const std::string& name) { return inside("sequence_whole", name); };
  // A sequence_whole block runs unsplit: a splitting style inside it would leave its output
  // partial (nothing reduces it), and a sequence_gathered block around it or inside it would
  // gather an input twice.
  for (const auto& [path, style] : a.module_styles) {
    if (style.kind == "sequence_whole" && gathered(path))
      throw ConfigError(plan.source + ": sequence_whole module " + path + " lies inside a sequence_gathered block");
    if (whole(path) && (style_splits_weight(style.kind) || style.kind == "sequence_gathered" || style.kind == "sequence_whole"))
      throw ConfigError(plan.source + ": module " + path + " (" + style.kind + ") lies inside a sequence_whole block, "
                        "which every tensor-parallel rank runs whole; leave it out of the plan, or split the block "
                        "(sequence_gathered with colwise and rowwise layers)");
  }
  if (tp > 1) {
    // Inside a sequence_gathered block the colwise layers have no collective of their own (the
    // block's input takes the one reduction, DESIGN.md section 13), so the gradient reaching a
    // replicated module inside it is this rank's share only: DeepSeek's q_a_proj and its norm feed
    // the heads' colwise q_b_proj, a per-head norm sees this rank's heads. Left unmarked, each TP
    // rank would step its copy with a different partial gradient and train another model, silently
    // (measured: 1.7e-4 off PyTorch in 11 steps). Such a module says which sum it needs:
    // replicated_with_grad_allreduce (before or beside the split layers: always summed) or
    // sequence_parallel (after the block's rowwise output: summed under sequence parallelism),
    // or replicate where the gradient is whole (after a colwise_rep layer's gathered output, before
    // a rowwise_rep layer, whose split input's gradient is all-gathered whole). Frozen parameters
    // take no gradient and need nothing.
    const std::vector<bool> trained = model.trainable_mask(cfg);
    std::vector<std::string> partial;
    for (size_t i = 0; i < n; ++i)
      if (trained[i] && a.split_dim[i] < 0 && a.param_styles[i].empty() && gathered(model.params()[i].name))
        partial.push_back(model.params()[i].name);
    if (!partial.empty())
      throw ConfigError(plan.source + ": these parameters are replicated inside a sequence_gathered block, whose "
                        "colwise layers leave their input gradients partial, and no plan entry says how to sum their "
                        "gradients over tensor parallelism: " + join(partial, ", ") +
                        ". Give their modules replicated_with_grad_allreduce (read before or beside the split layers: "
                        "a projection or norm feeding colwise layers, a per-head norm), sequence_parallel (after "
                        "the block's rowwise output) or replicate (whole gradients: between a colwise_rep layer's "
                        "gathered output and a rowwise_rep layer)");
  }
  if (sp) {
    // Inside units, a replicated parameter sees this rank's part of the sequence only; its gradient
    // is right only when summed across TP. Ask for it explicitly rather than guess. Inside a
    // sequence_gathered block the check above has already asked.
    // A frozen parameter takes no gradient (AFMoE's router expert_bias); one inside a
    // sequence_whole block gets a whole gradient.
    const std::vector<bool> trained = model.trainable_mask(cfg);
    std::vector<std::string> unmarked;
    for (size_t i = 0; i < n; ++i)
      if (trained[i] && model.in_block(i) && a.split_dim[i] < 0 && !a.grad_sum[i] &&
          !gathered(model.params()[i].name) && !whole(model.params()[i].name))
        unmarked.push_back(model.params()[i].name);
    if (!unmarked.empty())
      throw ConfigError(cfg.where("distributed.sequence_parallel") +
                        ": distributed.sequence_parallel: these parameters are replicated across tensor-parallel ranks "
                        "inside units, where activations are split along the sequence, and no plan entry says how: " +
                        join(unmarked, ", ") + ". Mark their modules sequence_parallel in the plan where they work "
                        "token by token (norms, an unsplit MLP), or the block around them sequence_whole where they "
                        "read the whole sequence (an unsplit attention) (" + plan.source + ")");
    // Outside blocks, modules called after the first block (a final norm, also one inside a
    // container of the blocks such as HF's `model.norm`; an output head made a unit of its own)
    // see sequence-split activations too. Walk the forward graphs in call order, descending into
    // the containers of blocks.
    std::vector<std::string> unit_paths;
    for (const auto& u : model.units())
      if (u.block) unit_paths.push_back(u.path);
    std::vector<std::string> unmarked_after;
    bool after_units = false;
    // A module called after the units: its own parameters, and those of the submodules its forward
    // calls (one it holds but never calls, such as PEFT's modules_to_save original_module, sees no
    // activations at all).
    std::function<void(const std::string&, const torch::jit::Module&)> flag_called = [&](const std::string& path,
                                                                                         const torch::jit::Module& m) {
      for (const auto& own : m.named_parameters(/*recurse=*/false)) {
        const int i = by_name.at(path + "." + own.name);
        if (trained[size_t(i)] && !model.in_block(size_t(i)) && a.split_dim[size_t(i)] < 0 && !a.grad_sum[size_t(i)] &&
            !whole(model.params()[size_t(i)].name))
          unmarked_after.push_back(model.params()[size_t(i)].name);
      }
      for_each_call(path, m, [&](const std::string& target, Node*) {
        flag_called(target, submodule_at(model.module(), target));
      });
    };
    std::function<void(const std::string&, const torch::jit::Module&)> scan = [&](const std::string& path,
                                                                                   const torch::jit::Module& m) {
      for_each_call(path, m, [&](const std::string& target, Node*) {
        bool unit = false, container = false;
        for (const auto& u : unit_paths) {
          if (target == u || target.rfind(u + ".", 0) == 0) unit = true;
          else if (u.rfind(target + ".", 0) == 0) container = true;
        }
        if (unit) {
          after_units = true;
        } else if (container) {
          scan(target, submodule_at(model.module(), target));
        } else if (after_units) {
          flag_called(target, submodule_at(model.module(), target));
        }
      });
    };
    scan("", model.module());
    if (!unmarked_after.empty())
      throw ConfigError(cfg.where("distributed.sequence_parallel") +
                        ": distributed.sequence_parallel: these parameters belong to modules called after the units, "
                        "on sequence-split activations, and no plan entry says how: " + join(unmarked_after, ", ") +
                        ". Mark their modules sequence_parallel in the plan where they work token by token (the final norm), "
                        "or sequence_whole where they read the whole sequence (" + plan.source + ")");
  }
  return a;
}

std::string describe_tp_assignment(const Model& model, const TpAssignment& a, int64_t tp) {
  std::string out = fmt::format("tensor parallel: tp_size {}, plan from {}\n", tp, a.plan_source.empty() ? "(none)" : a.plan_source);
  out += fmt::format("  {:<44} {:<14} {:<32} {}\n", "parameter", "global shape", "style", "split -> shape per TP rank");
  for (size_t i = 0; i < model.params().size(); ++i) {
    const auto& p = model.params()[i];
    std::vector<int64_t> local = p.tensor.sizes().vec();
    std::string split = "replicated";
    if (a.split_dim[i] >= 0 && tp > 1) {
      TpSplit t;
      t.dim = a.split_dim[i], t.parts = a.parts[i], t.size = tp;
      local[size_t(a.split_dim[i])] = t.local_rows();  // padded slices of an uneven vocabulary
      split = fmt::format("dim {}{} -> {}", a.split_dim[i], a.parts[i].size() > 1 ? fmt::format(" ({} parts)", a.parts[i].size()) : "",
                          shape_str(local));
    }
    if (a.grad_sum[i]) split += ", grad summed over tp";
    out += fmt::format("  {:<44} {:<14} {:<32} {}\n", p.name, shape_str(p.tensor.sizes().vec()),
                       a.param_styles[i].empty() ? "-" : a.param_styles[i], split);
  }
  return out;
}

namespace {

Value* insert_op(torch::jit::Graph& g, const char* op, std::vector<torch::jit::NamedValue> args, const c10::TypePtr& type) {
  Value* out = g.insert(c10::Symbol::fromQualString(op), args);
  out->setType(type);
  return out;
}


class TensorParallelImpl final : public TensorParallel {
 public:
  TensorParallelImpl(Model& model, const Config& cfg, ProcessGroups& pg)
      : model_(model), cfg_(cfg), tp_(pg.get(MeshGroup::kTp)) {
    size_ = tp_.size();
    rank_ = tp_.rank();
    sp_ = cfg.distributed.sequence_parallel;
    const bool have_plan = cfg.distributed.tp_plan || !model.stored_tp_plan().empty();
    if (size_ == 1 && !have_plan) return;
    a_ = plan_tensor_parallel(model, cfg, size_);
    if (size_ == 1) return;  // the plan is valid; nothing to split
    if (sp_) {
      const int64_t local_seq = cfg.training.seq_length / cfg.distributed.cp_size;
      if (local_seq % size_ != 0)
        throw ConfigError(cfg.where("training.seq_length") + fmt::format(
                              ": training.seq_length: sequence parallel splits each rank's {} tokens (seq_length / "
                              "cp_size) over tp_size {}; they must divide evenly",
                              local_seq, size_));
      if (model.num_block_units() == 0)
        throw ConfigError(cfg.where("distributed.sequence_parallel") +
                          ": distributed.sequence_parallel: the sequence is split at the input of the first FSDP unit, "
                          "and this model has none (set distributed.megatron_fsdp_unit_modules)");
    }
    split_parameters();
    find_after_gather();
    rewrite_graphs();
    set_tp_context(&tp_, sp_);
  }
  ~TensorParallelImpl() override {
    if (size_ > 1) set_tp_context(nullptr, false);
  }

  bool logits_sharded() const override { return logits_sharded_; }
  int64_t vocab_start(int64_t local_vocab) const override { return rank_ * local_vocab; }
  int64_t vocab_size(int64_t local_vocab) const override {
    return logits_sharded_ ? (head_vocab_ > 0 ? head_vocab_ : local_vocab * size_) : local_vocab;
  }
  bool sequence_parallel() const override { return sp_ && size_ > 1; }

  std::string describe() const override {
    if (size_ == 1)
      return a_.plan_source.empty() ? "" : "tensor parallel: tp_size 1 (plan from " + a_.plan_source + " checked, unused)";
    int64_t sharded = 0, global = 0, local = 0, summed = 0;
    for (const auto& p : model_.params()) {
      global += p.global_numel();
      local += p.tensor.numel();
      if (p.tp.split()) ++sharded;
      if (p.tp_grad_sum) ++summed;
    }
    return fmt::format("tensor parallel: tp_size {} (plan from {}): {} call sites rewritten, {} parameters split, this TP "
                       "rank holds {} of {} elements ({:.3f}){}; logits {}",
                       size_, a_.plan_source, rewritten_, sharded, local, global, double(local) / double(global),
                       sp_ ? fmt::format("; sequence parallel, {} replicated parameters' gradients summed over tp{}", summed,
                                         side_inputs_.empty() ? "" : "; units' inputs cut like the hidden state where "
                                                                     "they span the sequence: " + join(side_inputs_, ", "))
                           : "",
                       logits_sharded_ ? "sharded over the vocabulary (vocab-parallel cross entropy)" : "full");
  }

 private:
  void split_parameters() {
    at::NoGradGuard ng;
    auto& params = model_.params();
    for (size_t i = 0; i < params.size(); ++i) {
      auto& p = params[i];
      p.tp_grad_sum = a_.grad_sum[i];
      if (a_.split_dim[i] < 0) continue;
      p.tp.dim = a_.split_dim[i];
      p.tp.parts = a_.parts[i];
      p.tp.size = size_;
      p.tp.rank = rank_;
      p.tp.global_shape = p.tensor.sizes().vec();
      at::Tensor local;
      std::vector<int64_t> shape = p.tp.global_shape;
      shape[size_t(p.tp.dim)] = p.tp.local_rows();
      if (model_.loaded_on_meta()) {  // placeholders: only the shape matters
        local = at::empty(shape, p.tensor.options().requires_grad(false));
      } else {
        // This rank's slice of every part, its padding rows (an uneven vocabulary) zero.
        local = at::zeros(shape, p.tensor.options().requires_grad(false));
        int64_t start = 0, at_row = 0;
        for (int64_t part : p.tp.parts) {
          const int64_t real = p.tp.real_rows(part, rank_);
          if (real > 0)
            local.narrow(p.tp.dim, at_row, real).copy_(p.tensor.detach().narrow(p.tp.dim, start + rank_ * p.tp.slice(part), real));
          start += part;
          at_row += p.tp.slice(part);
        }
      }
      p.tensor = local.set_requires_grad(true);
      model_.set_parameter(p.name, p.tensor);
      for (const auto& al : p.aliases) model_.set_parameter(al, p.tensor);
    }
  }

  const TpStyle* style_of(const std::string& path) const {
    for (const auto& [p, s] : a_.module_styles)
      if (p == path) return &s;
    return nullptr;
  }

  void rewrite_graphs() {
    logits_path_ = logits_module(model_, a_.module_styles);  // before the rewrite: its calls change
    // Instances by TorchScript type: scripted modules of one class share one graph.
    std::map<const c10::ClassType*, std::vector<std::string>> instances;
    std::map<const c10::ClassType*, torch::jit::Module> any_instance;
    for (const auto& nm : model_.module().named_modules()) {
      instances[nm.value.type().get()].push_back(nm.name);
      any_instance.emplace(nm.value.type().get(), nm.value);
    }
    // A module called more than once per forward whose later calls the trace recorded as other
    // graphs (graph_rewrite.h, unify_traced_repeats) would escape the call-site rewrite below.
    for (const std::string& repeat : model_.traced_repeats()) {
      const std::string path = split_traced_repeat(repeat).first;
      for (const auto& [split, style] : a_.module_styles)
        if (style_splits_weight(style.kind) && (split == path || split.rfind(path + ".", 0) == 0 || path.empty()))
          throw ConfigError(a_.plan_source + ": module " + split + " (" + style.kind + ") is called inside " + repeat +
                            ", a repeated call that torch.jit.trace recorded as another graph than the module's forward "
                            "(other operations or constants): tensor parallelism rewrites the calls of forward only. "
                            "Trace the model so that each call of a module is one graph (equal shapes), or leave " +
                            split + " out of the plan");
    }
    for (auto& [type, paths] : instances) {
      torch::jit::Module m = any_instance.at(type);
      if (!m.find_method("forward")) continue;
      auto& fn = torch::jit::toGraphFunction(m.get_method("forward").function());
      rewrite_block(fn.graph()->block(), fn.graph()->inputs()[0], paths);
    }
    for (const auto& [path, style] : a_.module_styles)
      if (style_splits_weight(style.kind) && !called_.count(path))
        throw ConfigError(a_.plan_source + ": tp_plan gives module " + path + " the style " + style.kind +
                          ", but no graph of the model calls its forward (a weight used as self." + path +
                          ".weight directly cannot get its collectives); call the module, or leave it out of the plan");
    if (sp_) {
      insert_sequence_scatter();
      split_unit_side_inputs();
    }
    detect_sharded_logits();
    // plan_tensor_parallel allowed an uneven colwise split only for the output head; the loss must
    // then see the logits sharded to mask the padding columns.
    for (size_t i = 0; i < model_.params().size(); ++i) {
      const auto& p = model_.params()[i];
      if (p.tp.padded() && !logits_sharded_ && a_.param_styles[i].find("colwise") != std::string::npos)
        throw ConfigError(a_.plan_source + ": parameter " + p.name + " is padded to split its " +
                          std::to_string(p.tp.global_shape[size_t(p.tp.dim)]) + " rows over tp_size " + std::to_string(size_) +
                          ", but the model's logits do not come back sharded from its colwise module");
    }
  }

  void rewrite_block(torch::jit::Block* block, Value* self, const std::vector<std::string>& owners) {
    for (auto it = block->nodes().begin(); it != block->nodes().end();) {
      Node* node = *it;
      ++it;
      for (auto* sub : node->blocks()) rewrite_block(sub, self, owners);
      if (node->kind() != c10::prim::CallMethod || node->s(c10::attr::name) != "forward") continue;
      auto rel = attr_chain(node->input(0), self);
      if (!rel) continue;
      const TpStyle* style = nullptr;
      std::string first_target;
      for (const auto& owner : owners) {
        const std::string target = child_path(owner, *rel);
        const TpStyle* s = style_of(target);
        if (first_target.empty()) {
          first_target = target;
          style = s;
        } else if ((s == nullptr) != (style == nullptr) || (s && s->kind != style->kind)) {
          throw ConfigError(a_.plan_source + ": modules " + first_target + " and " + target +
                            " are called from one shared TorchScript graph, so they must have the same tp_plan style (" +
                            (style ? style->kind : std::string("none")) + " vs " + (s ? s->kind : std::string("none")) + ")");
        }
        if (s) called_.insert(target);
      }
      if (style && style->kind == "sequence_gathered") {
        gather_sequence_at_call(node, first_target);
        ++rewritten_;
        continue;
      }
      if (style && style->kind == "sequence_whole") {
        whole_sequence_at_call(node, first_target);
        ++rewritten_;
        continue;
      }
      if (style && style->kind == "sequence_parallel_gather") {
        gather_sequence_after_call(node, first_target);
        ++rewritten_;
        continue;
      }
      if (!style || !style_splits_weight(style->kind)) continue;
      rewrite_call(node, *style, first_target);
      ++rewritten_;
    }
  }

  // The aten::linear node of a Linear-like module's forward, or nullptr.
  static Node* linear_node(torch::jit::Module& mod) {
    auto& fn = torch::jit::toGraphFunction(mod.get_method("forward").function());
    for (Node* n : fn.graph()->nodes())
      if (n->kind() == c10::aten::linear) return n;
    return nullptr;
  }

  // The value at the call site that a value of the callee's graph stands for: an argument, or an
  // attribute of the module (inserted here as a GetAttr). nullptr otherwise.
  static Value* at_call_site(Value* v, Node* call) {
    auto* callee_graph = v->owningGraph();
    for (size_t i = 1; i < callee_graph->inputs().size(); ++i)
      if (callee_graph->inputs()[i] == v) return call->input(i);
    if (v->node()->kind() == c10::prim::GetAttr && v->node()->input(0) == callee_graph->inputs()[0])
      return call->owningGraph()->insertGetAttr(call->input(0), v->node()->s(c10::attr::name));
    return nullptr;
  }

  // The index of the first Tensor among a call's arguments or a graph's inputs (index 0, the
  // module itself, skipped): the hidden state by the contract's convention; 0 if there is none.
  static size_t first_tensor(at::ArrayRef<Value*> values) {
    for (size_t i = 1; i < values.size(); ++i)
      if (is_tensor_value(values[i])) return i;
    return 0;
  }

  // Which argument of the call is the activation: the input of the callee's linear (a traced
  // model with tied weights passes the weight as an argument too), else the first Tensor one.
  static size_t activation_arg(Node* call, torch::jit::Module& mod) {
    if (Node* lin = linear_node(mod)) {
      auto* callee_graph = lin->owningGraph();
      for (size_t i = 1; i < callee_graph->inputs().size(); ++i)
        if (callee_graph->inputs()[i] == lin->input(0)) return i;
    }
    return first_tensor(call->inputs());
  }

  // Whether module `path` lies inside a sequence_gathered block (whose call site holds the
  // block's one tp_copy).
  bool inside_gathered(const std::string& path) const {
    for (const auto& [p, s] : a_.module_styles)
      if (s.kind == "sequence_gathered" && path.rfind(p + ".", 0) == 0) return true;
    return false;
  }

  // Whether module `path` is called after a sequence_parallel_gather module (in the model's call
  // order, not inside it): its input is that module's gathered output, copied once already.
  bool after_gather(const std::string& path) const { return after_gather_.count(path) > 0; }
  bool input_copied(const std::string& path) const { return inside_gathered(path) || after_gather(path); }

  // Module paths in the order the forward graphs call them, depth first (a module before the
  // modules it calls); each call site of a shared graph under its own path.
  void call_order(const std::string& path, const torch::jit::Module& m, std::vector<std::string>& out) const {
    if (out.size() > 100000) return;
    for_each_call(path, m, [&](const std::string& target, Node* call) {
      if (call->s(c10::attr::name) != "forward") return;
      out.push_back(target);
      call_order(target, submodule_at(model_.module(), target), out);
    });
  }

  // The modules called after each sequence_parallel_gather module (their inputs are whole).
  void find_after_gather() {
    std::vector<std::string> order;
    bool any = false;
    for (const auto& [p, s] : a_.module_styles) any = any || s.kind == "sequence_parallel_gather";
    if (!any) return;
    call_order("", model_.module(), order);
    for (const auto& [p, s] : a_.module_styles) {
      if (s.kind != "sequence_parallel_gather") continue;
      auto it = std::find(order.begin(), order.end(), p);
      if (it == order.end())
        throw ConfigError(a_.plan_source + ": tp_plan gives module " + p +
                          " the style sequence_parallel_gather, but no graph of the model calls its forward");
      for (++it; it != order.end(); ++it)
        if (it->rfind(p + ".", 0) != 0) after_gather_.insert(*it);
    }
  }

  // A sequence_parallel_gather module's call (a final norm): it runs on this rank's part of the
  // sequence like a sequence_parallel one, and its output goes through tp_copy: under sequence
  // parallelism all-gathered along the sequence (reduce-scattered backward), so code after it
  // that reshapes by the global sequence length (GPT-2's view to the input's shape) sees the
  // whole sequence; without it the identity (all-reduce backward). The colwise output head called
  // after it reads that value and needs no copy of its own: its partial input gradient is summed
  // by this one reduction, as inside a sequence_gathered block.
  void gather_sequence_after_call(Node* node, const std::string& path) {
    if (node->outputs().size() != 1 || !is_tensor_value(node->output()))
      throw ConfigError(a_.plan_source + ": sequence_parallel_gather module " + path + " must return one Tensor");
    torch::jit::Graph& g = *node->owningGraph();
    torch::jit::WithInsertPoint guard(node->next());
    Value* y = node->output();
    Value* full = insert_op(g, "mfsdp::tp_copy", {y}, y->type());
    y->replaceAllUsesAfterNodeWith(full->node(), full);
  }

  // A sequence_gathered block's call: its hidden-state argument (the first Tensor one) goes
  // through tp_copy, which under sequence parallelism all-gathers it along the sequence (and
  // reduce-scatters its gradient), without it is the identity (and all-reduces its gradient).
  // Either way that one reduction sums the partial input gradients of everything inside that
  // reads the block's input from a column slice (its colwise layers, which then need no copy of
  // their own, and a LoRA adapter's lora_A beside them). Its rowwise output layer's tp_reduce
  // reduce-scatters under SP, so the block returns this rank's part of the sequence again.
  void gather_sequence_at_call(Node* node, const std::string& path) {
    const size_t arg = first_tensor(node->inputs());
    if (arg == 0) throw UserError(path + ": a sequence_gathered module must take a Tensor argument");
    torch::jit::Graph& g = *node->owningGraph();
    torch::jit::WithInsertPoint guard(node);
    node->replaceInput(arg, insert_op(g, "mfsdp::tp_copy", {node->input(arg)}, node->input(arg)->type()));
  }

  // A sequence_whole block's call: under sequence parallelism its hidden-state argument (the
  // first Tensor one) all-gathered along the sequence, whose gradient is this rank's slice of the
  // whole one (no reduction: every rank computes the same whole gradient), and its output (a
  // Tensor, or the first of a tuple) cut back to this rank's part of the sequence, whose gradient
  // is all-gathered whole. One all-gather each way, no reduction, and the parameters' gradients
  // whole on every rank. Without sequence parallelism both are the identity: the block is plain
  // replicated code, its input and output whole already.
  void whole_sequence_at_call(Node* node, const std::string& path) {
    const size_t arg = first_tensor(node->inputs());
    if (arg == 0) throw UserError(path + ": a sequence_whole module must take a Tensor argument");
    torch::jit::Graph& g = *node->owningGraph();
    {
      torch::jit::WithInsertPoint guard(node);
      node->replaceInput(arg, insert_op(g, "mfsdp::sp_gather_whole", {node->input(arg)}, node->input(arg)->type()));
    }
    if (node->outputs().size() != 1)
      throw ConfigError(a_.plan_source + ": sequence_whole module " + path + " must return a Tensor or a tuple");
    // An output head kept whole (one that is no plain linear layer: Dory's scales its logits by a
    // vocabulary-sized parameter) returns the logits of the whole sequence on every TP rank, as the
    // loss takes them; its input's gradient is still this rank's slice of the whole one.
    if (path == logits_path_) return;
    Value* out = node->output();
    torch::jit::WithInsertPoint guard(node->next());
    if (is_tensor_value(out)) {
      Value* mine = insert_op(g, "mfsdp::sp_split_whole", {out}, out->type());
      out->replaceAllUsesAfterNodeWith(mine->node(), mine);
      return;
    }
    auto tuple = out->type()->cast<c10::TupleType>();
    if (!tuple || tuple->elements().empty() || !tuple->elements()[0]->isSubtypeOf(*c10::TensorType::get()))
      throw ConfigError(a_.plan_source + ": sequence_whole module " + path +
                        " must return a Tensor or a tuple whose first element is the hidden state (it returns " +
                        out->type()->str() + ")");
    Node* unpack = g.insertNode(g.createTupleUnpack(out));
    std::vector<Value*> items(unpack->outputs().begin(), unpack->outputs().end());
    items[0] = insert_op(g, "mfsdp::sp_split_whole", {items[0]}, items[0]->type());
    Value* rebuilt = g.insertNode(g.createTuple(items))->output();
    rebuilt->setType(out->type());
    out->replaceAllUsesAfterNodeWith(rebuilt->node(), rebuilt);
  }

  void rewrite_call(Node* node, const TpStyle& style, const std::string& path) {
    torch::jit::Graph& g = *node->owningGraph();
    torch::jit::Module mod = submodule_at(model_.module(), path);
    const size_t arg = activation_arg(node, mod);
    if (arg == 0) throw UserError(path + ": a " + style.kind + " module must take a Tensor argument");
    Value* x = node->input(arg);
    const std::string& k = style.kind;
    if (k == "moe_experts") return rewrite_experts_call(node, path);
    if (k == "rowwise_rep") {
      // rowwise on a replicated input (HF's rowwise_split_input, after a colwise_rep layer): this
      // rank's slice of the input features first, whose gradient is all-gathered back.
      torch::jit::WithInsertPoint guard(node);
      x = insert_op(g, "mfsdp::tp_split_last", {x}, x->type());
      node->replaceInput(arg, x);
    }
    if (k == "colwise" || k == "colwise_rep" || k == "rowwise" || k == "rowwise_rep")
      if (Node* mm = conv1d_node(mod)) return rewrite_conv1d(node, mm, arg, style, path);
    if (k == "colwise") localise_head_views(node->output(), path);
    // Inside a sequence_gathered block the block's call holds the copy (and the gradient
    // reduction) of the input. colwise_rep's gathered output then feeds replicated code on the
    // whole sequence, whose gradient it slices back to this rank's columns: a partial input
    // gradient like a colwise layer's, summed by the same one reduction.
    if (k == "colwise" && input_copied(path)) return;
    if (k == "colwise_rep" && input_copied(path)) {
      torch::jit::WithInsertPoint guard(node->next());
      Value* y = node->output();
      Value* full = insert_op(g, "mfsdp::tp_gather_last", {y}, y->type());
      y->replaceAllUsesAfterNodeWith(full->node(), full);
      return;
    }
    if (k == "colwise" || k == "colwise_rep") {
      // Colwise calls on the same input (q, k and v projections; gate and up) share one tp_copy:
      // one all-gather forward (sequence parallel) and one reduction of the summed input
      // gradient backward, as a fused projection would have.
      node->replaceInput(arg, shared_copy(node, x));
      if (k == "colwise_rep") {
        torch::jit::WithInsertPoint guard(node->next());
        Value* y = node->output();
        Value* full = insert_op(g, "mfsdp::tp_gather_last", {y}, y->type());
        y->replaceAllUsesAfterNodeWith(full->node(), full);
      }
    } else if (k == "vocab_parallel") {
      const int64_t rows = mod.attr("weight").toTensor().size(0);  // local rows
      const int64_t start = rank_ * rows, end = start + rows;
      localise_padding_idx(mod, path, start, end);
      {
        torch::jit::WithInsertPoint guard(node);
        node->replaceInput(arg, insert_op(g, "mfsdp::tp_vocab_ids", {x, start, end}, x->type()));
      }
      torch::jit::WithInsertPoint guard(node->next());
      Value* y = node->output();
      Value* reduced = insert_op(g, "mfsdp::tp_vocab_reduce", {y, x, start, end}, y->type());
      y->replaceAllUsesAfterNodeWith(reduced->node(), reduced);
    } else if (k == "rowwise" || k == "rowwise_rep") {
      // The module must be a plain linear layer: its call becomes tp_reduce(linear(x, W)) + b.
      Node* lin = linear_node(mod);
      bool other = false;
      if (lin)
        for (Node* n : lin->owningGraph()->nodes())
          if (n != lin && n->kind() != c10::prim::GetAttr && n->kind() != c10::prim::Constant) other = true;
      if (!lin || other)
        throw ConfigError(a_.plan_source + ": rowwise applies to Linear modules (forward(x) = linear(x, weight, bias)) and HF Conv1D ones; " +
                          path + " (class " + unqualified_class_name(mod) + ") computes something else");
      torch::jit::WithInsertPoint guard(node);
      Value* w = at_call_site(lin->input(1), node);
      Value* b = lin->input(2)->type()->kind() == c10::TypeKind::NoneType ? nullptr : at_call_site(lin->input(2), node);
      if (!w || (lin->input(2)->type()->kind() != c10::TypeKind::NoneType && !b))
        throw ConfigError(a_.plan_source + ": rowwise module " + path + ": cannot follow its weight and bias to the call site");
      if (k == "rowwise") localise_merge_view(x, path);
      Value* z = insert_op(g, "aten::linear", {x, w}, node->output()->type());
      Value* y = insert_op(g, "mfsdp::tp_reduce", {z}, z->type());
      if (b) y = insert_op(g, "aten::add", {y, b}, y->type());
      node->output()->replaceAllUsesWith(y);
      node->destroy();
    }
  }

  // An embedding's padding_idx (nn.Embedding(padding_idx=p): row p gets no gradient; Gemma's
  // configs have pad_token_id 0) is a global row; ids reach a vocab_parallel table shifted to this
  // rank's rows (tp_vocab_ids), so the aten::embedding of the module's forward gets p - start where
  // this rank holds row p and -1 (none) elsewhere. Left global, every rank's local row p would lose
  // its gradient instead (measured: Gemma at TP 4, 1.9e-3 off PyTorch by step 15). The index is a
  // constant of aten::embedding in a traced graph, or F.embedding's argument in a scripted one.
  void localise_padding_idx(torch::jit::Module& mod, const std::string& path, int64_t start, int64_t end) {
    if (!mod.find_method("forward")) return;
    auto g = torch::jit::toGraphFunction(mod.get_method("forward").function()).graph();
    if (!padding_localised_.insert(g.get()).second) return;
    auto local = [&](int64_t p) { return p >= start && p < end ? p - start : int64_t(-1); };
    for (Node* n : g->nodes()) {
      if (n->kind() == c10::aten::embedding && n->inputs().size() >= 3) {  // traced: a constant
        // scale_grad_by_freq divides a row's gradient by its count in the batch, and this rank's
        // ids outside its rows are all clamped onto its first or last row: those counts would be off.
        if (n->inputs().size() >= 4)
          if (auto f = torch::jit::toIValue(n->input(3)); !f || !f->isBool() || f->toBool())
            throw ConfigError(a_.plan_source + ": vocab_parallel module " + path + " scales its gradient by the ids' "
                              "frequency (scale_grad_by_freq), which a split vocabulary cannot count; leave the module "
                              "out of the plan");
        auto c = torch::jit::toIValue(n->input(2));
        if (!c || !c->isInt())
          throw ConfigError(a_.plan_source + ": vocab_parallel module " + path + ": its embedding's padding_idx is "
                            "computed in its forward, so it cannot be made this rank's row; leave the module out of the plan");
        if (c->toInt() < 0) continue;
        torch::jit::WithInsertPoint at(n);
        n->replaceInput(2, g->insertConstant(local(c->toInt())));
      } else if (n->kind() == c10::prim::CallFunction) {
        // Scripted: F.embedding(input, weight, padding_idx: Optional[int], ...), which checks the
        // index against the table's rows and wraps a negative one around it, so a rank without
        // the row passes None. Its argument is this module's attribute padding_idx (an int).
        auto fn = n->input(0)->type()->cast<c10::FunctionType>();
        if (!fn || fn->function()->name() != "embedding") continue;
        const auto& args = fn->function()->getSchema().arguments();
        for (size_t i = 0; i < args.size(); ++i) {
          if (args[i].name() == "scale_grad_by_freq" && i + 1 < n->inputs().size()) {
            Value* v = n->input(i + 1);
            std::optional<c10::IValue> f = torch::jit::toIValue(v);
            if (!f && v->node()->kind() == c10::prim::GetAttr && v->node()->input(0) == g->inputs()[0])
              f = mod.attr(v->node()->s(c10::attr::name));
            if (!f || !f->isBool() || f->toBool())
              throw ConfigError(a_.plan_source + ": vocab_parallel module " + path + " scales its gradient by the "
                                "ids' frequency (scale_grad_by_freq), which a split vocabulary cannot count; leave the "
                                "module out of the plan");
          }
          if (args[i].name() != "padding_idx" || i + 1 >= n->inputs().size()) continue;
          Value* v = n->input(i + 1);
          std::optional<int64_t> p;
          if (auto c = torch::jit::toIValue(v)) {
            if (c->isInt()) p = c->toInt();
          } else if (v->node()->kind() == c10::prim::GetAttr && v->node()->input(0) == g->inputs()[0]) {
            const c10::IValue a = mod.attr(v->node()->s(c10::attr::name));
            if (a.isInt()) p = a.toInt();
            else if (!a.isNone()) continue;
          } else {
            throw ConfigError(a_.plan_source + ": vocab_parallel module " + path + ": its embedding's padding_idx is "
                              "computed in its forward, so it cannot be made this rank's row; leave the module out of the plan");
          }
          if (!p || *p < 0) continue;  // none, or counted from the end (not seen in exported models)
          torch::jit::WithInsertPoint at(n);
          n->replaceInput(i + 1, local(*p) >= 0 ? g->insertConstant(local(*p)) : g->insertConstant(c10::IValue()));
        }
      }
    }
  }

  // An experts module's call: each Tensor argument (the tokens' hidden states, the routing
  // weights, the chosen experts' ids) through tp_copy -- the identity forward and, for the
  // differentiable ones, the sum of the ranks' partial gradients backward; under sequence
  // parallelism the tokens of the whole TP group all-gathered (the module's inputs are flattened
  // [tokens, ...], gathered rank by rank, which token-wise experts do not see) -- and its output,
  // each rank's partial sum over its slice of the intermediate dimension, through tp_reduce
  // (all-reduced; reduce-scattered back to this rank's tokens under SP). The router before it runs
  // replicated on this rank's tokens: its gradients are summed over TP under SP (sequence_parallel
  // in the plan). Inside a sequence_gathered block the block's copy already holds the input.
  void rewrite_experts_call(Node* node, const std::string& path) {
    if (input_copied(path))
      throw ConfigError(a_.plan_source + ": moe_experts module " + path + " lies inside a sequence_gathered block; "
                        "leave the block out of the plan (the experts' call gathers its own inputs)");
    if (node->outputs().size() != 1 || !is_tensor_value(node->output()))
      throw ConfigError(a_.plan_source + ": moe_experts module " + path + " must return one Tensor");
    torch::jit::Graph& g = *node->owningGraph();
    {
      torch::jit::WithInsertPoint guard(node);
      for (size_t i = 1; i < node->inputs().size(); ++i)
        if (is_tensor_value(node->input(i)))
          node->replaceInput(i, insert_op(g, "mfsdp::tp_copy", {node->input(i)}, node->input(i)->type()));
    }
    torch::jit::WithInsertPoint guard(node->next());
    Value* y = node->output();
    Value* reduced = insert_op(g, "mfsdp::tp_reduce", {y}, y->type());
    y->replaceAllUsesAfterNodeWith(reduced->node(), reduced);
  }

  // One tp_copy per input value and block, shared by the colwise calls that read it.
  Value* shared_copy(Node* node, Value* x) {
    auto key = std::make_pair(node->owningBlock(), x);
    auto it = copies_.find(key);
    if (it == copies_.end()) {
      torch::jit::WithInsertPoint guard(node);
      it = copies_.emplace(key, insert_op(*node->owningGraph(), "mfsdp::tp_copy", {x}, x->type())).first;
    }
    return it->second;
  }

  // A Conv1D call becomes x @ W + b on this rank's slice of W, at the call site (so the width its
  // own graph bakes in never applies): colwise (W [in, out/tp], b [out/tp]) behind the input's
  // tp_copy, with tp_gather_last for colwise_rep; rowwise (W [in/tp, out]) reduced before the bias.
  // A packed colwise output (GPT-2's c_attn: q, k, v) is cut by its caller with
  // aten::split(y, part, -1); that constant is a global part width and becomes the local one.
  void rewrite_conv1d(Node* node, Node* mm, size_t arg, const TpStyle& style, const std::string& path) {
    torch::jit::Graph& g = *node->owningGraph();
    const std::string& k = style.kind;
    torch::jit::WithInsertPoint guard(node);
    Value* w = at_call_site(mm->input(2), node);
    Value* b = at_call_site(mm->input(0), node);
    if (!w || !b) throw ConfigError(a_.plan_source + ": " + k + " module " + path + ": cannot follow its weight and bias to the call site");
    Value* x = node->input(arg);
    Value* y = nullptr;
    if (k == "rowwise" || k == "rowwise_rep") {
      Value* z = insert_op(g, "aten::matmul", {x, w}, node->output()->type());
      y = insert_op(g, "mfsdp::tp_reduce", {z}, z->type());
      y = insert_op(g, "aten::add", {y, b}, y->type());
    } else {
      if (!input_copied(path)) x = shared_copy(node, x);
      y = insert_op(g, "aten::matmul", {x, w}, node->output()->type());
      y = insert_op(g, "aten::add", {y, b}, y->type());
      if (k == "colwise_rep") y = insert_op(g, "mfsdp::tp_gather_last", {y}, y->type());
    }
    node->output()->replaceAllUsesWith(y);
    if (k == "colwise") localise_split_widths(y, path);
    // Last: a WithInsertPoint restores the point it found, so none may outlive a node it saw.
    node->destroy();
  }

  // A colwise projection's output viewed by heads with constant counts: a trace of OPT's
  // view(bsz, -1, num_heads, head_dim) bakes the global head count in, and with -1 before it the
  // view would succeed on this rank's columns with the sequence cut instead (silently wrong). The
  // head count becomes this rank's. Recognised: aten::view / aten::reshape of the output, or of it
  // after up to three elementwise ops (OPT scales q first), whose size list ends in two constants
  // H, D with H x D the projection's global width and H divisible by tp_size.
  void localise_head_views(Value* y, const std::string& path) {
    int64_t width = 0;
    for (const auto& p : model_.params())
      if (p.name == path + ".weight" && p.tp.split() && !p.tp.global_shape.empty()) width = p.tp.global_shape[0];
    if (width == 0) return;
    std::function<void(Value*, int)> follow = [&](Value* v, int depth) {
      for (const auto& use : std::vector<torch::jit::Use>(v->uses())) {
        Node* u = use.user;
        if (use.offset != 0) continue;
        const auto kind = u->kind();
        if ((kind == c10::aten::view || kind == c10::aten::reshape) && u->inputs().size() == 2) {
          Node* list = u->input(1)->node();
          if (list->kind() != c10::prim::ListConstruct || list->inputs().size() < 2) continue;
          const size_t n = list->inputs().size();
          auto h = torch::jit::toIValue(list->input(n - 2)), d = torch::jit::toIValue(list->input(n - 1));
          if (!h || !d || !h->isInt() || !d->isInt() || h->toInt() <= 0 || h->toInt() * d->toInt() != width ||
              h->toInt() % size_ != 0)
            continue;
          torch::jit::WithInsertPoint at(list);
          list->replaceInput(n - 2, v->owningGraph()->insertConstant(h->toInt() / size_));
        } else if (depth < 3 && (kind == c10::aten::mul || kind == c10::aten::div || kind == c10::aten::add ||
                                 kind == c10::aten::sub || kind == c10::aten::to || kind == c10::aten::contiguous)) {
          follow(u->output(), depth + 1);
        }
      }
    };
    follow(y, 0);
  }

  // The mirror image at a rowwise projection's input: heads merged back with a constant width. A
  // trace of GPT-Neo's _merge_heads, view(B, T, num_heads * head_dim), bakes the global width in,
  // while this rank holds only its heads (the view would fail on the element count). The width
  // becomes this rank's. Recognised: aten::view / aten::reshape producing the input, directly or
  // through up to three elementwise ops, whose size list ends in the weight's global input width
  // (its split dimension), divisible by tp_size.
  void localise_merge_view(Value* x, const std::string& path) {
    int64_t width = 0;
    for (const auto& p : model_.params())
      if (p.name == path + ".weight" && p.tp.split() && size_t(p.tp.dim) < p.tp.global_shape.size())
        width = p.tp.global_shape[size_t(p.tp.dim)];
    if (width == 0 || width % size_ != 0) return;
    Value* v = x;
    for (int depth = 0; depth <= 3; ++depth) {
      Node* n = v->node();
      const auto kind = n->kind();
      if ((kind == c10::aten::view || kind == c10::aten::reshape) && n->inputs().size() == 2) {
        Node* list = n->input(1)->node();
        if (list->kind() != c10::prim::ListConstruct || list->inputs().empty()) return;
        const size_t last = list->inputs().size() - 1;
        auto c = torch::jit::toIValue(list->input(last));
        if (!c || !c->isInt() || c->toInt() != width) return;
        torch::jit::WithInsertPoint at(list);
        list->replaceInput(last, v->owningGraph()->insertConstant(width / size_));
        return;
      }
      if (n->inputs().empty() || !(kind == c10::aten::mul || kind == c10::aten::div || kind == c10::aten::to ||
                                   kind == c10::aten::contiguous || kind == c10::aten::dropout))
        return;
      v = n->input(0);
    }
  }

  // A packed colwise output cut by constant-width aten::split(y, part, -1): the local width.
  void localise_split_widths(Value* y, const std::string& path) {
    std::vector<int64_t> parts;
    for (const auto& p : model_.params())
      if (p.name == path + ".weight") parts = p.tp.parts;
    if (parts.size() < 2 || std::any_of(parts.begin(), parts.end(), [&](int64_t q) { return q != parts[0]; })) return;
    for (const auto& use : std::vector<torch::jit::Use>(y->uses())) {
      Node* u = use.user;
      if (u->kind() != c10::aten::split || use.offset != 0 || u->inputs().size() < 2) continue;
      auto c = torch::jit::toIValue(u->input(1));
      if (!c || !c->isInt() || c->toInt() != parts[0]) continue;
      torch::jit::WithInsertPoint at(u);
      u->replaceInput(1, y->owningGraph()->insertConstant(parts[0] / size_));
    }
  }

  // Sequence parallel: the first block splits its hidden-state input (its first Tensor argument)
  // along the sequence; every later block receives it split already.
  void insert_sequence_scatter() {
    const std::string& path = model_.units()[size_t(model_.first_block_unit())].path;
    torch::jit::Module first = submodule_at(model_.module(), path);
    first.register_attribute(kSpFirstAttr, c10::IntType::get(), int64_t(1));
    for (const auto& nm : model_.module().named_modules())
      if (nm.value.type() == first.type() && nm.name != path) {
        torch::jit::Module other = nm.value;
        other.setattr(kSpFirstAttr, int64_t(0));
      }
    auto& fn = torch::jit::toGraphFunction(first.get_method("forward").function());
    auto g = fn.graph();
    const size_t arg = first_tensor(g->inputs());
    if (!arg) throw UserError("sequence parallel: unit " + path + " takes no Tensor argument to split");
    Value* x = g->inputs()[arg];
    torch::jit::WithInsertPoint guard(g->block()->nodes().front());
    Value* flag = g->insertGetAttr(g->inputs()[0], kSpFirstAttr);
    Value* split = insert_op(*g, "mfsdp::sp_scatter", {flag, x}, x->type());
    x->replaceAllUsesAfterNodeWith(split->node(), split);
  }

  // Under sequence parallelism the units' hidden state is this rank's part of the sequence, but
  // other inputs shaped by the sequence come whole from the code before the units: Gemma 4's
  // per-layer inputs ([B, T, D], one per layer), DeepSeek V4's token ids (hash routing). Where the
  // layer uses such an input token by token, it must be cut like the hidden state. Each Tensor
  // input of a block unit's graph besides the hidden state goes through mfsdp::sp_split_like,
  // which cuts it along dim 1 when that is the whole of the hidden state's length (backward: the
  // gradient all-gathered) and passes anything else through (masks, scalars). An input that flows
  // into a sequence_gathered or sequence_whole block's call (the rotary cos/sin the attention
  // reads whole), or into a module holding one or a colwise layer (the reference Llama's position
  // ids, read beside its gathering q/k/v projections), is left whole.
  void split_unit_side_inputs() {
    std::set<const torch::jit::Graph*> done;
    for (const auto& u : model_.units()) {
      if (!u.block) continue;
      torch::jit::Module m = submodule_at(model_.module(), u.path);
      auto g = torch::jit::toGraphFunction(m.get_method("forward").function()).graph();
      if (!done.insert(g.get()).second) continue;
      Value* self = g->inputs()[0];
      const size_t hidden = first_tensor(g->inputs());
      if (!hidden) continue;
      Value* like = g->inputs()[hidden];
      Node* after = nullptr;  // the first unit's scatter, inserted first: its output is the split state
      for (Node* n : g->block()->nodes())
        if (n->kind() == c10::Symbol::fromQualString("mfsdp::sp_scatter") && n->input(1) == like) {
          like = n->output();
          after = n;
        }
      for (size_t i = hidden + 1; i < g->inputs().size(); ++i) {
        Value* v = g->inputs()[i];
        if (!is_tensor_value(v) || v->uses().empty() || reaches_block(v, self, u.path)) continue;
        const std::string what = fmt::format("{} input {} ({})", u.class_name, i, v->debugName());
        if (std::find(side_inputs_.begin(), side_inputs_.end(), what) == side_inputs_.end()) side_inputs_.push_back(what);
        torch::jit::WithInsertPoint guard(after ? after->next() : g->block()->nodes().front());
        Value* cut = insert_op(*g, "mfsdp::sp_split_like", {v, like}, v->type());
        v->replaceAllUsesAfterNodeWith(cut->node(), cut);
      }
    }
  }

  // Whether value v of a unit's graph flows (through any ops) into the call of a sequence_gathered
  // or sequence_whole block, or of a module that holds one or a colwise layer: code that works on
  // the whole sequence.
  bool reaches_block(Value* v, Value* self, const std::string& unit_path) const {
    std::vector<Value*> todo{v};
    std::set<Value*> seen{v};
    while (!todo.empty()) {
      Value* x = todo.back();
      todo.pop_back();
      for (const auto& use : x->uses()) {
        Node* n = use.user;
        if (n->kind() == c10::prim::CallMethod) {
          if (auto rel = attr_chain(n->input(0), self)) {
            const std::string target = child_path(unit_path, *rel);
            for (const auto& [p, st] : a_.module_styles) {
              const bool at_or_in = p == target || p.rfind(target + ".", 0) == 0;
              if ((st.kind == "sequence_gathered" || st.kind == "sequence_whole") &&
                  (at_or_in || target.rfind(p + ".", 0) == 0))
                return true;
              // A colwise layer gathers its input under SP: code around it in that module (the
              // reference Llama's attention, rotary angles from position_ids) runs on the whole
              // sequence too.
              if ((st.kind == "colwise" || st.kind == "colwise_rep") && at_or_in) return true;
            }
          }
        }
        for (Value* o : n->outputs())
          if (seen.insert(o).second) todo.push_back(o);
      }
    }
    return false;
  }

  // Logits are sharded when the model's return value comes from a colwise module's call
  // (logits_module, on the rewritten graphs: a colwise_rep head's gathered output is not).
  void detect_sharded_logits() {
    const std::string path = logits_module(model_, [&](const std::string& p) { return style_of(p) != nullptr; });
    const TpStyle* s = path.empty() ? nullptr : style_of(path);
    logits_sharded_ = s && s->kind == "colwise";
    if (logits_sharded_)
      for (const auto& p : model_.params())
        if (p.tp.split() && (p.name == path + ".weight" ||
                             std::find(p.aliases.begin(), p.aliases.end(), path + ".weight") != p.aliases.end()))
          head_vocab_ = p.tp.global_shape[size_t(p.tp.dim)];
  }

  Model& model_;
  const Config& cfg_;
  Communicator& tp_;
  int64_t size_ = 1, rank_ = 0;
  bool sp_ = false, logits_sharded_ = false;
  int64_t head_vocab_ = 0;  // the sharded logits' global width (the head's rows), 0 if unknown
  std::string logits_path_;  // the styled module whose output the model returns (logits_module)
  TpAssignment a_;
  std::set<std::string> called_;
  std::set<const torch::jit::Graph*> padding_localised_;  // embedding graphs whose padding_idx is local
  std::set<std::string> after_gather_;  // modules called after a sequence_parallel_gather one
  std::vector<std::string> side_inputs_;  // units' inputs cut like the hidden state (split_unit_side_inputs)
  std::map<std::pair<torch::jit::Block*, Value*>, Value*> copies_;  // shared tp_copy per input
  int rewritten_ = 0;
};

}  // namespace

std::unique_ptr<TensorParallel> apply_tensor_parallel(Model& model, const Config& cfg, ProcessGroups& pg) {
  return std::make_unique<TensorParallelImpl>(model, cfg, pg);
}

}  // namespace mfsdp
