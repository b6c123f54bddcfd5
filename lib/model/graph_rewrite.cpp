#include "model/graph_rewrite.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>

#include <map>
#include <regex>
#include <set>

#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {

namespace {
constexpr const char* kUnitAttr = "_mfsdp_unit_id";

// Passes every Tensor in `values` through `op(unit, [values...]) -> Tensor[]`, inserted at the
// graph's current insert point; returns the replacement values in the same order.
std::vector<torch::jit::Value*> through_op(torch::jit::Graph& g, const char* op, torch::jit::Value* unit,
                                           const std::vector<torch::jit::Value*>& values) {
  auto* list = g.insertNode(g.createList(c10::TensorType::get(), values))->output();
  auto* result = g.insert(c10::Symbol::fromQualString(op), {unit, list});
  auto* unpack = g.insertNode(g.createListUnpack(result, values.size()));
  std::vector<torch::jit::Value*> out(unpack->outputs().begin(), unpack->outputs().end());
  for (size_t i = 0; i < out.size(); ++i) out[i]->setType(values[i]->type());
  return out;
}

bool is_tensor(const torch::jit::Value* v) { return is_tensor_value(v); }

void rewrite_forward(torch::jit::Module& unit, const std::string& path) {
  auto& fn = torch::jit::toGraphFunction(unit.get_method("forward").function());
  std::shared_ptr<torch::jit::Graph> g = fn.graph();
  torch::jit::Value* self = g->inputs()[0];
  // Entry: after the parameters, before the first node.
  {
    torch::jit::WithInsertPoint guard(g->block()->nodes().front());
    auto* id = g->insertGetAttr(self, kUnitAttr);
    std::vector<torch::jit::Value*> tensors;
    for (size_t i = 1; i < g->inputs().size(); ++i)
      if (is_tensor(g->inputs()[i])) tensors.push_back(g->inputs()[i]);
    if (tensors.empty())
      throw UserError("FSDP unit " + path + ": its forward takes no Tensor argument; units must take and return tensors");
    auto replaced = through_op(*g, "mfsdp::pre_forward", id, tensors);
    auto* after = replaced.back()->node();
    for (size_t i = 0; i < tensors.size(); ++i) tensors[i]->replaceAllUsesAfterNodeWith(after, replaced[i]);
  }
  // Return: a Tensor, or a tuple whose Tensor elements pass through.
  {
    torch::jit::Node* ret = g->return_node();
    torch::jit::Value* out = ret->input(0);
    torch::jit::WithInsertPoint guard(ret);
    auto* id = g->insertGetAttr(self, kUnitAttr);
    if (is_tensor(out)) {
      ret->replaceInput(0, through_op(*g, "mfsdp::post_forward", id, {out})[0]);
    } else if (out->type()->kind() == c10::TypeKind::TupleType) {
      auto* unpack = g->insertNode(g->createTupleUnpack(out));
      std::vector<torch::jit::Value*> elems(unpack->outputs().begin(), unpack->outputs().end()), tensors;
      for (auto* e : elems)
        if (is_tensor(e)) tensors.push_back(e);
      if (tensors.empty()) throw UserError("FSDP unit " + path + ": forward returns no Tensor");
      auto replaced = through_op(*g, "mfsdp::post_forward", id, tensors);
      size_t k = 0;
      for (auto*& e : elems)
        if (is_tensor(e)) e = replaced[k++];
      auto* tuple = g->insertNode(g->createTuple(elems))->output();
      ret->replaceInput(0, tuple);
    } else {
      throw UserError("FSDP unit " + path + ": forward returns " + out->type()->str() +
                      "; units must return a Tensor or a tuple of Tensors");
    }
  }
}

}  // namespace

int unit_index(const torch::jit::Module& m) {
  return m.hasattr(kUnitAttr) ? int(m.attr(kUnitAttr).toInt()) : -1;
}

bool is_tensor_value(const torch::jit::Value* v) { return v->type()->kind() == c10::TypeKind::TensorType; }

torch::jit::Module submodule_at(const torch::jit::Module& root, const std::string& path) {
  torch::jit::Module m = root;
  if (path.empty()) return m;
  for (const auto& part : split(path, '.')) m = m.attr(part).toModule();
  return m;
}

namespace {

void checkpoint_calls_in(torch::jit::Block* block, const std::set<const c10::ClassType*>& unit_types,
                         const std::string& where, int& replaced) {
  for (auto it = block->nodes().begin(); it != block->nodes().end();) {
    torch::jit::Node* node = *it;
    ++it;
    for (auto* sub : node->blocks()) checkpoint_calls_in(sub, unit_types, where, replaced);
    if (node->kind() != c10::prim::CallMethod || node->s(c10::attr::name) != "forward") continue;
    auto cls = node->input(0)->type()->cast<c10::ClassType>();
    if (!cls || !unit_types.count(cls.get())) continue;
    std::vector<torch::jit::Value*> args;
    for (size_t i = 1; i < node->inputs().size(); ++i) {
      if (!is_tensor(node->input(i)))
        throw UserError("activation_checkpointing: a call of unit class " + cls->name()->name() + " in " + where +
                        " passes a non-Tensor argument (" + node->input(i)->type()->str() +
                        "); checkpointed units must take and return Tensors");
      args.push_back(node->input(i));
    }
    if (node->outputs().size() != 1 || !is_tensor(node->output()))
      throw UserError("activation_checkpointing: unit class " + cls->name()->name() + " returns " +
                      node->output()->type()->str() + "; checkpointed units must return one Tensor");
    torch::jit::Graph& g = *node->owningGraph();
    torch::jit::WithInsertPoint guard(node);
    auto* list = g.insertNode(g.createList(c10::TensorType::get(), args))->output();
    auto* result = g.insert(c10::Symbol::fromQualString("mfsdp::checkpoint"), {node->input(0), list});
    auto* unpack = g.insertNode(g.createListUnpack(result, 1));
    unpack->output(0)->setType(node->output()->type());
    node->output()->replaceAllUsesWith(unpack->output(0));
    node->destroy();
    ++replaced;
  }
}

}  // namespace

namespace {

bool constant_equals_true(const torch::jit::Value* v) {
  auto c = torch::jit::toIValue(v);
  return c && c->isBool() && c->toBool();
}

// `functions`, when given: also the graphs of the functions called (prim::CallFunction), each once.
void collect(torch::jit::Block* block, const std::set<c10::Symbol>& kinds, std::vector<torch::jit::Node*>& out,
             std::set<const torch::jit::Graph*>* functions) {
  for (torch::jit::Node* node : block->nodes()) {
    for (auto* sub : node->blocks()) collect(sub, kinds, out, functions);
    if (kinds.count(node->kind())) out.push_back(node);
    if (!functions || node->kind() != c10::prim::CallFunction) continue;
    auto ft = node->input(0)->type()->cast<c10::FunctionType>();
    if (!ft || !ft->function() || !ft->function()->isGraphFunction()) continue;
    std::shared_ptr<torch::jit::Graph> g = torch::jit::toGraphFunction(*ft->function()).graph();
    if (functions->insert(g.get()).second) collect(g->block(), kinds, out, functions);
  }
}

}  // namespace

int rewrite_nodes(torch::jit::Module& root, const std::set<c10::Symbol>& kinds,
                  const std::function<bool(torch::jit::Node*)>& f, bool into_functions) {
  std::set<const c10::ClassType*> seen;
  std::set<const torch::jit::Graph*> functions;
  std::vector<torch::jit::Node*> nodes;
  for (const auto& m : root.modules()) {
    if (!seen.insert(m.type().get()).second) continue;
    for (const auto& method : m.get_methods())
      collect(torch::jit::toGraphFunction(method.function()).graph()->block(), kinds, nodes,
              into_functions ? &functions : nullptr);
  }
  int rewritten = 0;
  for (torch::jit::Node* node : nodes) rewritten += f(node) ? 1 : 0;
  return rewritten;
}

bool replace_node_by(torch::jit::Node* node, const char* op, const std::vector<torch::jit::Value*>& args) {
  torch::jit::Graph& g = *node->owningGraph();
  torch::jit::WithInsertPoint guard(node);
  torch::jit::Value* y = g.insert(c10::Symbol::fromQualString(op), std::vector<torch::jit::NamedValue>(args.begin(), args.end()));
  y->setType(node->output()->type());
  node->output()->replaceAllUsesWith(y);
  node->destroy();
  return true;
}

int dropout_follows_mode(torch::jit::Module& root) {
  static const std::set<c10::Symbol> kDropouts = {
      c10::aten::dropout, c10::aten::dropout_, c10::aten::feature_dropout, c10::aten::feature_dropout_,
      c10::aten::alpha_dropout, c10::aten::alpha_dropout_, c10::aten::feature_alpha_dropout,
      c10::aten::feature_alpha_dropout_};
  std::set<c10::Symbol> kinds = kDropouts;
  kinds.insert(c10::aten::scaled_dot_product_attention);
  return rewrite_nodes(root, kinds, [&](torch::jit::Node* node) {
    // `training` is an attribute of every module type: the graph's first input is its module.
    torch::jit::Graph& g = *node->owningGraph();
    torch::jit::Value* self = g.inputs()[0];
    auto cls = self->type()->cast<c10::ClassType>();
    if (!cls || !cls->hasAttribute("training")) return false;
    torch::jit::WithInsertPoint guard(node);
    if (kDropouts.count(node->kind())) {
      if (node->inputs().size() != 3 || !constant_equals_true(node->input(2))) return false;
      node->replaceInput(2, g.insertGetAttr(self, "training"));
      return true;
    }
    auto p = node->inputs().size() >= 5 ? torch::jit::toIValue(node->input(4)) : std::nullopt;
    if (!p || !p->isDouble() || p->toDouble() == 0.0) return false;
    auto* on = g.insert(c10::aten::Float, {g.insertGetAttr(self, "training")});
    node->replaceInput(4, g.insert(c10::aten::mul, {node->input(4), on}));
    return true;
  });
}

int instrument_units(Model& model, bool checkpoint_activations) {
  std::set<const c10::ClassType*> rewritten, block_types;
  std::set<std::string> unit_paths;
  for (size_t u = 0; u < model.units().size(); ++u) {
    const auto& unit = model.units()[u];
    torch::jit::Module m = submodule_at(model.module(), unit.path);
    if (unit.block) block_types.insert(m.type().get());
    // register_attribute adds the slot to the (possibly shared) type and sets this instance's value.
    m.register_attribute(kUnitAttr, c10::IntType::get(), int64_t(u));
    unit_paths.insert(unit.path);
    const c10::ClassType* type = m.type().get();
    for (const auto& repeat : model.traced_repeats())
      if (split_traced_repeat(repeat).first == unit.path)
        throw UserError("FSDP unit " + unit.path + " is called more than once per forward, and torch.jit.trace "
                        "recorded a later call as another graph than its forward (" + repeat +
                        ": other operations or constants, such as shapes the trace baked in): mfsdp gathers and "
                        "frees a unit's weights around its forward only. Trace the model so that every call records "
                        "the same graph (equal shapes and arguments), or choose units that hold both calls "
                        "(distributed.megatron_fsdp_unit_modules)");
    if (rewritten.insert(type).second) rewrite_forward(m, unit.path);
  }
  // Other instances of a rewritten type run the same graph: they read -1 and the ops do nothing.
  // (hasattr() asks the shared type, not the instance, so set every one of them explicitly.)
  for (const auto& nm : model.module().named_modules()) {
    torch::jit::Module m = nm.value;
    if (rewritten.count(m.type().get()) && !unit_paths.count(nm.name)) m.setattr(kUnitAttr, int64_t(-1));
  }
  if (!checkpoint_activations) return 0;
  if (model.units().empty())
    throw UserError("activation_checkpointing: the model has no FSDP units to checkpoint (none were found or "
                    "configured; set distributed.megatron_fsdp_unit_modules)");
  // Every graph that calls a block: one rewrite per TorchScript type. Only blocks are checkpointed:
  // a leaf unit (an embedding, an output head) has nothing worth recomputing, and its TorchScript
  // type may be shared with the Linear layers inside the blocks, which must not be checkpointed
  // one by one inside a checkpointed block.
  std::set<const c10::ClassType*> seen;
  int replaced = 0;
  for (const auto& nm : model.module().named_modules()) {
    torch::jit::Module m = nm.value;
    if (!seen.insert(m.type().get()).second || !m.find_method("forward")) continue;
    auto& fn = torch::jit::toGraphFunction(m.get_method("forward").function());
    checkpoint_calls_in(fn.graph()->block(), block_types, nm.name.empty() ? "the model's forward" : nm.name + ".forward",
                        replaced);
  }
  if (replaced == 0)
    throw UserError("activation_checkpointing: no call of a unit was found in the model's graphs (units: " +
                    model.units().front().path + ", ...)");
  return replaced;
}

namespace {
// A graph's text without source locations and without the shapes a trace annotates its tensor
// types with (Float(2, 16, strides=[16, 1], ...) -> Float: annotations the executor specializes
// again; sizes the code computes with are constants or size() nodes, which stay), its values
// renamed %0, %1, ... in order of first appearance: two traces of the same code give one text
// (a norm applied to the queries and to the fewer key heads, too).
std::string canonical_text(const std::shared_ptr<torch::jit::Graph>& g) {
  static const std::regex value_name(R"(%[A-Za-z0-9_.]+)");
  // A type follows ": " or opens a tuple's element; aten::Int(%x) (after "::") is a call.
  static const std::regex tensor_annotation(R"(([ (\[,])(Float|Double|Half|BFloat16|Long|Int|Short|Char|Byte|Bool)\([^()]*\))");
  const std::string text =
      std::regex_replace(g->toString(/*print_source_locations=*/false), tensor_annotation, "$1$2");
  std::map<std::string, std::string> names;
  std::string out;
  auto it = std::sregex_iterator(text.begin(), text.end(), value_name);
  size_t last = 0;
  for (; it != std::sregex_iterator(); ++it) {
    out.append(text, last, size_t(it->position()) - last);
    out += names.emplace(it->str(), "%" + std::to_string(names.size())).first->second;
    last = size_t(it->position() + it->length());
  }
  out.append(text, last, std::string::npos);
  return out;
}

bool is_repeat_name(const std::string& name) {
  return name.size() > 7 && name.rfind("forward", 0) == 0 &&
         std::all_of(name.begin() + 7, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

void redirect_calls(torch::jit::Block* b, const std::set<std::pair<const c10::ClassType*, std::string>>& same,
                    int& n) {
  for (torch::jit::Node* node : b->nodes()) {
    for (torch::jit::Block* sub : node->blocks()) redirect_calls(sub, same, n);
    if (node->kind() != c10::prim::CallMethod) continue;
    auto cls = node->input(0)->type()->cast<c10::ClassType>();
    if (cls && same.count({cls.get(), node->s(c10::attr::name)})) {
      node->s_(c10::attr::name, "forward");
      ++n;
    }
  }
}
}  // namespace

std::pair<std::string, std::string> split_traced_repeat(const std::string& repeat) {
  const size_t dot = repeat.rfind('.');
  if (dot == std::string::npos) return {"", repeat};
  return {repeat.substr(0, dot), repeat.substr(dot + 1)};
}

TracedRepeats unify_traced_repeats(torch::jit::Module& root) {
  TracedRepeats result;
  std::vector<std::pair<std::string, torch::jit::Module>> modules;
  for (const auto& nm : root.named_modules()) modules.emplace_back(nm.name, nm.value);
  std::set<std::pair<const c10::ClassType*, std::string>> same;
  std::set<const c10::ClassType*> done;
  for (auto it = modules.rbegin(); it != modules.rend(); ++it) {  // children before their parents
    torch::jit::Module& m = it->second;
    const c10::ClassType* type = m.type().get();
    if (!done.insert(type).second) continue;
    for (torch::jit::Function* f : m.type()->methods())
      redirect_calls(torch::jit::toGraphFunction(*f).graph()->block(), same, result.unified);
    if (!m.find_method("forward")) continue;
    std::string forward_text;
    for (torch::jit::Function* f : m.type()->methods()) {
      if (!is_repeat_name(f->name())) continue;
      if (forward_text.empty())
        forward_text = canonical_text(torch::jit::toGraphFunction(m.get_method("forward").function()).graph());
      if (canonical_text(torch::jit::toGraphFunction(*f).graph()) == forward_text)
        same.insert({type, f->name()});
      else
        result.differing.push_back((it->first.empty() ? "" : it->first + ".") + f->name());
    }
  }
  // A type shared by modules at several depths was walked once, maybe before all of its callees
  // were compared: one more pass over every graph.
  for (const auto& [name, m] : modules)
    for (torch::jit::Function* f : m.type()->methods())
      redirect_calls(torch::jit::toGraphFunction(*f).graph()->block(), same, result.unified);
  return result;
}

}  // namespace mfsdp
