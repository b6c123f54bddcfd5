// Rewrites of TorchScript graphs (DESIGN.md section 4). Must run before the model's first call:
// the executor copies a graph on first run and later edits are silently ignored.
#pragma once
#include "model/model.h"

#include <functional>
#include <set>

namespace mfsdp {

// Registers the attribute "_mfsdp_unit_id" (int) on every unit instance and inserts
// mfsdp::pre_forward at the entry and mfsdp::post_forward at the return of each unit's forward
// graph, once per TorchScript type (scripted units of one class share one graph; traced ones have a
// type each). Tensor inputs and outputs (a Tensor or a tuple of Tensors) pass through the ops.
// With `checkpoint_activations`, every call of a unit (prim::CallMethod forward on a unit's type)
// in any graph of the model is replaced by mfsdp::checkpoint(module, [inputs]).
// Returns the number of unit calls replaced.
int instrument_units(Model& model, bool checkpoint_activations);
// The unit index instrument_units gave this module instance, or -1 (not a unit).
int unit_index(const torch::jit::Module& m);

// Calls f on every node of one of `kinds` in the module tree's method graphs (nested blocks too),
// once per TorchScript type (instances of one type share its graphs); with `into_functions` also in
// the graphs of the functions they call (prim::CallFunction: a scripted module calls
// torch.nn.functional's Python functions, nn.Dropout's F.dropout among them, as functions of the
// file's compilation unit), each once. The nodes are collected before the first call, so f may
// destroy its node and nodes of other kinds. Returns how many calls returned true.
int rewrite_nodes(torch::jit::Module& root, const std::set<c10::Symbol>& kinds,
                  const std::function<bool(torch::jit::Node*)>& f, bool into_functions = false);

// A trace records dropout in the mode it was traced in: aten::dropout(x, p, true) of a model traced
// in training keeps dropping in evaluation, and sdpa's dropout_p is a constant. Makes every such
// call follow the module's train/eval mode, as a scripted module's does: a constant-true `train`
// argument of the dropout family becomes prim::GetAttr "training" of the graph's module, and a
// constant nonzero dropout_p of aten::scaled_dot_product_attention becomes p * float(training).
// Calls traced in evaluation (train false, dropout_p 0) stay off. Returns the calls rewritten.
int dropout_follows_mode(torch::jit::Module& root);

// torch.jit.trace gives a module called more than once per forward a method per call: forward,
// forward1, forward2, ... (the layer a looped model such as Dory runs twice, a norm applied to two
// tensors). Every rewrite of mfsdp follows calls of `forward` (units' pre/post ops, TP call sites,
// CP's attention, the fused kernels), so a second call would escape them: under strategy 3 it
// would run on freed weights, under CP its attention would see this rank's tokens only. A method
// forwardN whose graph is forward's (the same nodes, types and constants; values named apart) has
// its calls pointed at forward. Bottom-up, so that a layer whose submodules' repeated calls were
// unified compares equal in turn. Returns {calls redirected, "path.forwardN" of the modules whose
// repeated calls differ from forward (left as traced)}.
struct TracedRepeats {
  int unified = 0;
  std::vector<std::string> differing;
};
TracedRepeats unify_traced_repeats(torch::jit::Module& root);
// "path.forwardN" as {module path ("" for the root), method name}.
std::pair<std::string, std::string> split_traced_repeat(const std::string& repeat);

// Replaces `node` (one output) by a call of `op` ("mfsdp::linear") on `args`, inserted where the
// node was, its output typed as the node's, and destroys the node. Returns true (a rewriter's
// "replaced").
bool replace_node_by(torch::jit::Node* node, const char* op, const std::vector<torch::jit::Value*>& args);

// Whether a graph value is a Tensor (not a list, tuple, scalar or module).
bool is_tensor_value(const torch::jit::Value* v);

// The module at a dotted path ("blocks.3").
torch::jit::Module submodule_at(const torch::jit::Module& root, const std::string& path);

}  // namespace mfsdp
