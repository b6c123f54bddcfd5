// Graph matching shared by mfsdp's rewrites (model/graph_match.h).
#include "model/graph_match.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>

#include <algorithm>
#include <limits>
#include <set>
#include <vector>

namespace mfsdp {

std::optional<int64_t> constant_int(torch::jit::Value* v) {
  auto c = torch::jit::toIValue(v);
  if (c && c->isInt()) return c->toInt();
  return std::nullopt;
}

// Destroys n, then the producers of its inputs that nothing uses any more (drop_dead).
void destroy_and_drop(torch::jit::Node* n) {
  std::vector<torch::jit::Node*> producers;
  for (torch::jit::Value* i : n->inputs()) producers.push_back(i->node());
  n->destroy();
  for (torch::jit::Node* p : producers) drop_dead(p);
}

// Pure nodes the matchers leave behind (slices, chunk, list plumbing, size arithmetic): dropped when
// nothing uses them any more, with the producers of their inputs in turn.
void drop_dead(torch::jit::Node* n) {
  static const std::set<c10::Symbol> pure = {
      c10::aten::slice, c10::aten::neg,         c10::aten::chunk,  c10::prim::ListUnpack, c10::prim::ListConstruct,
      c10::aten::Int,   c10::aten::floor_divide, c10::aten::floordiv, c10::prim::NumToTensor, c10::aten::size,
      c10::aten::__getitem__, c10::aten::cat, c10::prim::GetAttr, c10::aten::silu,
      c10::aten::unsqueeze, c10::aten::expand, c10::aten::reshape, c10::aten::mul, c10::aten::repeat_interleave,
      c10::aten::transpose};
  if (!pure.count(n->kind())) return;
  for (torch::jit::Value* o : n->outputs())
    if (!o->uses().empty()) return;
  destroy_and_drop(n);
}

// The value a full slice (start 0, end None or INT64_MAX, step 1: `x[:, :]` traced) was taken of,
// else nullptr.
torch::jit::Value* through_full_slice(torch::jit::Value* v) {
  torch::jit::Node* n = v->node();
  if (n->kind() != c10::aten::slice || n->inputs().size() != 5) return nullptr;
  auto start = torch::jit::toIValue(n->input(2)), end = torch::jit::toIValue(n->input(3)),
       step = torch::jit::toIValue(n->input(4));
  if (!start || !end || !step) return nullptr;
  const bool from0 = start->isNone() || (start->isInt() && start->toInt() == 0);
  const bool to_end = end->isNone() || (end->isInt() && end->toInt() == std::numeric_limits<int64_t>::max());
  return from0 && to_end && step->isInt() && step->toInt() == 1 ? n->input(0) : nullptr;
}

// (t, d) when v is size(t, d) or size(t)[d] with a constant d, possibly through the int/tensor
// round trips a trace records (aten::Int(prim::NumToTensor(size(t, d)))).
std::optional<std::pair<torch::jit::Value*, int64_t>> size_of(torch::jit::Value* v) {
  for (;;) {
    const c10::Symbol k = v->node()->kind();
    if (k != c10::aten::Int && k != c10::prim::NumToTensor) break;
    v = v->node()->input(0);
  }
  torch::jit::Node* n = v->node();
  if (n->kind() == c10::aten::__getitem__ && n->inputs().size() == 2) {  // scripted: size(t)[d]
    torch::jit::Node* sz = n->input(0)->node();
    auto d = constant_int(n->input(1));
    if (sz->kind() != c10::aten::size || sz->inputs().size() != 1 || !d) return std::nullopt;
    return std::make_pair(sz->input(0), *d);
  }
  if (n->kind() != c10::aten::size || n->inputs().size() != 2) return std::nullopt;
  auto d = constant_int(n->input(1));
  if (!d) return std::nullopt;
  return std::make_pair(n->input(0), *d);
}

// A repeat of the heads of a 4-D x along dimension `heads` (1: [B, H, T, D], as attention takes it;
// 2: [B, T, H, D], before the transpose), each head n times in place (head h of the result is
// head h / n of x), in the two spellings models use; returns (x, n as a graph value) or nothing:
// - Hugging Face's repeat_kv as a trace records it (heads 1): x[:, :, None] (full slices around an
//   unsqueeze at heads + 1), .expand(...) with x's sizes and the constant n there, .reshape(...)
//   whose other dims are x's (so the heads' dim can only be kv * n); torchtitan's repeat_kv is
//   the same at heads 2 ([B, T, H, D]: x[:, :, :, None, :]);
// - x.repeat_interleave(n, dim=heads) (scripted GQA: `k.repeat_interleave(h // hkv, dim=1)`).
std::optional<std::pair<torch::jit::Value*, torch::jit::Value*>> repeat_of(torch::jit::Value* v, int64_t heads) {
  using torch::jit::Node;
  using torch::jit::Value;
  Node* node = v->node();
  if (node->kind() == c10::aten::repeat_interleave) {
    if (node->inputs().size() != 4 || node->input(1)->type()->kind() != c10::TypeKind::IntType ||
        constant_int(node->input(2)) != heads)
      return std::nullopt;
    auto size = torch::jit::toIValue(node->input(3));
    if (!size || !size->isNone()) return std::nullopt;
    return std::make_pair(node->input(0), node->input(1));
  }
  Node* reshape = node;
  if (reshape->kind() != c10::aten::reshape || reshape->inputs().size() != 2) return std::nullopt;
  Node* expand = reshape->input(0)->node();
  if (expand->kind() != c10::aten::expand || expand->inputs().size() != 3) return std::nullopt;
  Value* x = expand->input(0);
  while (Value* in = through_full_slice(x)) x = in;
  Node* unsq = x->node();
  if (unsq->kind() != c10::aten::unsqueeze || constant_int(unsq->input(1)) != heads + 1) return std::nullopt;
  x = unsq->input(0);
  while (Value* in = through_full_slice(x)) x = in;
  Node* sizes = expand->input(1)->node();
  Node* shape = reshape->input(1)->node();
  if (sizes->kind() != c10::prim::ListConstruct || sizes->inputs().size() != 5 ||
      shape->kind() != c10::prim::ListConstruct || shape->inputs().size() != 4)
    return std::nullopt;
  Value* n = sizes->input(size_t(heads + 1));
  if (!constant_int(n) || *constant_int(n) < 1) return std::nullopt;
  auto is_size = [&](Value* s, int64_t d) {
    auto sz = size_of(s);
    return sz && sz->first == x && sz->second == d;
  };
  for (int64_t i = 0; i < 5; ++i)  // expand: x's dims around the new one
    if (i != heads + 1 && !is_size(sizes->input(size_t(i)), i < heads + 1 ? i : i - 1)) return std::nullopt;
  for (int64_t j = 0; j < 4; ++j)  // reshape: x's dims but the heads'
    if (j != heads && !is_size(shape->input(size_t(j)), j)) return std::nullopt;
  return std::make_pair(x, n);
}

namespace {
// Whether two repeat counts are the same: one graph value, or equal constants.
bool same_count(torch::jit::Value* a, torch::jit::Value* b) {
  const auto ca = constant_int(a), cb = constant_int(b);
  return a == b || (ca && cb && *ca == *cb);
}
}  // namespace

std::optional<Unrepeated> unrepeated(torch::jit::Value* k, torch::jit::Value* v) {
  if (auto rk = repeat_of(k, 1), rv = repeat_of(v, 1); rk && rv && same_count(rk->second, rv->second))
    return Unrepeated{rk->first, rv->first, false};
  auto swapped_12 = [](torch::jit::Value* t) -> torch::jit::Value* {
    torch::jit::Node* n = t->node();
    if (n->kind() != c10::aten::transpose || n->inputs().size() != 3) return nullptr;
    const auto a = constant_int(n->input(1)), b = constant_int(n->input(2));
    return a && b && std::min(*a, *b) == 1 && std::max(*a, *b) == 2 ? n->input(0) : nullptr;
  };
  torch::jit::Value *tk = swapped_12(k), *tv = swapped_12(v);
  if (!tk || !tv) return std::nullopt;
  if (auto rk = repeat_of(tk, 2), rv = repeat_of(tv, 2); rk && rv && same_count(rk->second, rv->second))
    return Unrepeated{rk->first, rv->first, true};
  return std::nullopt;
}

namespace {
// Reads of the sizes of a head repeat ([B, H, T, D]) other than the heads' read them of x.
void sizes_of_unrepeated(torch::jit::Value* repeated, torch::jit::Value* x) {
  // Dimension d of a 4-D tensor other than 1 (the heads'), negative or not.
  auto not_heads = [](std::optional<int64_t> d) { return d && *d >= -4 && *d <= 3 && *d != 1 && *d != -3; };
  // (Collected first: replacing an input edits the use list.)
  std::vector<torch::jit::Node*> readers;
  for (const torch::jit::Use& u : repeated->uses()) readers.push_back(u.user);
  for (torch::jit::Node* n : readers) {
    if (n->kind() != c10::aten::size || n->input(0) != repeated) continue;
    bool ok = false;
    if (n->inputs().size() == 2) {
      ok = not_heads(constant_int(n->input(1)));
    } else if (n->inputs().size() == 1) {
      ok = !n->output()->uses().empty();
      for (const torch::jit::Use& u : n->output()->uses())
        ok &= u.user->kind() == c10::aten::__getitem__ && u.offset == 0 && not_heads(constant_int(u.user->input(1)));
    }
    if (ok) n->replaceInput(0, x);
  }
}
}  // namespace

bool take_unrepeated(torch::jit::Graph& g, torch::jit::Value*& k, torch::jit::Value*& v) {
  auto kv = unrepeated(k, v);
  if (!kv) return false;
  if (kv->transposed) {
    k = g.insert(c10::aten::transpose, {kv->k, 1, 2});
    v = g.insert(c10::aten::transpose, {kv->v, 1, 2});
  } else {
    sizes_of_unrepeated(k, kv->k);
    sizes_of_unrepeated(v, kv->v);
    k = kv->k;
    v = kv->v;
  }
  return true;
}

std::shared_ptr<torch::jit::Graph> callee_graph(torch::jit::Node* call, std::string* qualname) {
  torch::jit::Function* fn = nullptr;
  if (call->kind() == c10::prim::CallFunction) {
    auto ft = call->input(0)->type()->cast<c10::FunctionType>();
    if (ft) fn = ft->function();
  } else if (call->kind() == c10::prim::CallMethod && call->s(c10::attr::name) == "forward") {
    auto cls = call->input(0)->type()->cast<c10::ClassType>();
    if (cls) fn = cls->findMethod("forward");
  }
  if (!fn || !fn->isGraphFunction()) return nullptr;
  if (qualname) *qualname = fn->qualname().qualifiedName();
  return torch::jit::toGraphFunction(*fn).graph();
}

}  // namespace mfsdp
