// Attention written out as products and a softmax, taken by mfsdp::sdpa (model/fast_ops.h:
// use_fast_eager_attention; DESIGN.md section 7, "Attention written out").
//
// Why: many models users bring do not call scaled_dot_product_attention. minGPT and Meta's
// reference Llama write `softmax(q @ k^T * scale + mask) @ v` out; a Hugging Face model exported
// with attn_implementation="eager" traces the same ops; scripts/export_hf.py puts families that
// have eager attention only behind one operator, mfsdp::attention. ATen then computes the whole
// [B, H, T, T] score matrix (the causal half too), masks it in a pass of its own, keeps three
// such tensors for the backward and runs four batched products and three elementwise backwards.
// The same attention through mfsdp's kernel computes the causal triangle only and keeps one
// [B, H, T, T] tensor. PyTorch running the same file does the former: this is a step where
// mfsdp can be faster than the peer by more than the peer's overheads.
//
// What is matched (all in one graph, each intermediate read by the next op only):
//   S = matmul(q, k.transpose(-2, -1))              (or transpose(2, 3): k as [B, H, T, D])
//   S = S * c  |  S / c                             (optional: a float or int constant or value)
//   S = S + M  |  M + S                             (optional: an additive mask)
//     | S.masked_fill(C, f) | where(C, S, f)        (or a boolean one and its fill value)
//   S = S.float()                                   (optional: to fp32)
//   P = softmax(S, -1[, fp32])
//   P = P.to(fp32) | P.to(q.dtype) | P.type_as(q)   (optional; q, k or v)
//   P = dropout(P, p, train)                        (optional: aten's, mfsdp's, F.dropout, nn.Dropout)
//   P = P.to(fp32) | P.to(q.dtype) | P.type_as(q)   (optional)
//   O = matmul(P, v)
// becomes mfsdp::sdpa(q, k, v, mask, p * train, false, c or 1 / c, gqa). The masked_fill and where
// forms become an additive mask (`where(C, f, 0)`, `where(C, 0, f)`): adding f to a logit gives
// what filling with f gives wherever the fill decides the softmax (f = -inf or the dtype's lowest:
// the logit is lost to rounding; f = -1e9: exp of either is 0 in fp32), and the kernel runs when that mask is exactly the causal one
// (model/cpu_attention.h: is_causal_mask); any other mask is ATen's SDPA with it. Keys and values
// repeated over their heads before the product (HF's repeat_kv) are taken unrepeated with
// enable_gqa, as for SDPA calls. Dropout over the probabilities draws what ATen's dropout draws
// over that [B, H, T, T] tensor (fast_ops.cpp: sdpa_dropout_mask), so a run's masks and its
// generator state after are PyTorch's.
//
// A scripted model's F.softmax and F.dropout are calls of functions, and nn.Dropout a call of its
// module: those are matched as the ops they compute.
//
// Not matched (left as written): a scale applied after the mask, soft-capped logits, logits in a
// dtype other than fp32, keys transposed by a permute or already stored transposed.
#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "model/fast_ops.h"
#include "model/graph_match.h"
#include "model/graph_rewrite.h"

namespace mfsdp {
namespace {

using torch::jit::Node;
using torch::jit::Value;

constexpr int64_t kFloat32 = 6;  // c10::ScalarType::Float, as graphs carry dtypes

// The node that reads v, when it is v's only use.
Node* only_user(Value* v) { return v->uses().size() == 1 ? v->uses()[0].user : nullptr; }

bool is_none(Value* v) { return v->type()->kind() == c10::TypeKind::NoneType; }

bool constant_bool(Value* v, bool want) {
  auto c = torch::jit::toIValue(v);
  return c && c->isBool() && c->toBool() == want;
}

std::optional<double> constant_number(Value* v) {
  auto c = torch::jit::toIValue(v);
  if (!c) return std::nullopt;
  if (c->isDouble()) return c->toDouble();
  if (c->isInt()) return double(c->toInt());
  if (c->isTensor() && c->toTensor().numel() == 1 && c->toTensor().dim() == 0)
    return c->toTensor().to(at::kDouble).item<double>();
  return std::nullopt;
}

// A static rank when the graph records one (traces do), else -1.
int64_t rank_of(Value* v) {
  auto t = v->type()->cast<c10::TensorType>();
  if (!t) return -1;
  auto d = t->dim();
  return d ? int64_t(*d) : -1;
}

// x.to(fp32) (aten::to(x, 6, non_blocking, copy=False, memory_format)): what `.float()` and
// `.to(torch.float32)` record; the input, else nullptr.
Value* through_to_fp32(Node* n) {
  if (n->kind() != c10::aten::to || n->inputs().size() != 5 || n->outputs().size() != 1) return nullptr;
  if (n->input(1)->type()->kind() != c10::TypeKind::IntType || constant_int(n->input(1)) != kFloat32) return nullptr;
  return constant_bool(n->input(3), false) ? n->input(0) : nullptr;
}

// x.type_as(t) or x.to(t.dtype) (scripted: aten::to(x, prim::dtype(t), ...)): t, else nullptr.
Value* dtype_of(Node* n) {
  if (n->kind() == c10::aten::type_as && n->inputs().size() == 2) return n->input(1);
  if (n->kind() != c10::aten::to || n->inputs().size() != 5 || !constant_bool(n->input(3), false)) return nullptr;
  Node* d = n->input(1)->node();
  return d->kind() == c10::prim::dtype && d->inputs().size() == 1 ? d->input(0) : nullptr;
}

// A call of torch.nn.functional.<name> (a scripted model's F.softmax, F.dropout: functions of the
// file's compilation unit).
bool calls_functional(Node* n, const std::string& name) {
  std::string q;
  if (n->kind() != c10::prim::CallFunction || !callee_graph(n, &q)) return false;
  return q == "torch.nn.functional." + name || q == "__torch__.torch.nn.functional." + name;
}

// softmax(x, dim, dtype): aten::softmax, or F.softmax called (fn, x, dim, _stacklevel, dtype).
struct Softmax {
  Value *x, *dim, *dtype;
};
std::optional<Softmax> softmax_of(Node* n) {
  if (n->outputs().size() != 1) return std::nullopt;
  if (n->kind() == c10::aten::softmax && n->inputs().size() == 3) return Softmax{n->input(0), n->input(1), n->input(2)};
  if (n->inputs().size() == 5 && calls_functional(n, "softmax")) return Softmax{n->input(1), n->input(2), n->input(4)};
  return std::nullopt;
}

// dropout(x, p, train) over the probabilities: aten's or mfsdp's op (traces), F.dropout called
// (fn, x, p, training, inplace=False), or an nn.Dropout module's forward called (scripted: its
// body F.dropout(input, self.p, self.training, self.inplace) with p and inplace constants; train is
// then the module's training flag, read where the attention is).
struct Dropout {
  Value* p = nullptr;  // or p_constant
  std::optional<double> p_constant;
  Value* train = nullptr;   // or module's "training"
  Value* module = nullptr;
};
std::optional<Dropout> dropout_of(Node* n) {
  static const c10::Symbol mfsdp_dropout = c10::Symbol::fromQualString("mfsdp::dropout");
  auto typed = [](Value* p, Value* train) {
    return p->type()->kind() == c10::TypeKind::FloatType && train->type()->kind() == c10::TypeKind::BoolType;
  };
  if ((n->kind() == c10::aten::dropout || n->kind() == mfsdp_dropout) && n->inputs().size() == 3 &&
      typed(n->input(1), n->input(2)))
    return Dropout{n->input(1), std::nullopt, n->input(2), nullptr};
  if (n->inputs().size() == 5 && calls_functional(n, "dropout") && constant_bool(n->input(4), false) &&
      typed(n->input(2), n->input(3)))
    return Dropout{n->input(2), std::nullopt, n->input(3), nullptr};
  if (n->kind() != c10::prim::CallMethod || n->inputs().size() != 2) return std::nullopt;
  auto cls = n->input(0)->type()->cast<c10::ClassType>();
  const std::string dropout_class = "torch.nn.modules.dropout.Dropout";
  if (!cls || !cls->name()) return std::nullopt;
  const std::string name = cls->name()->qualifiedName();
  if (name.size() < dropout_class.size() || name.compare(name.size() - dropout_class.size(), std::string::npos, dropout_class) != 0)
    return std::nullopt;
  auto g = callee_graph(n);
  if (!g || g->inputs().size() != 2 || g->outputs().size() != 1) return std::nullopt;
  Node* call = g->outputs()[0]->node();
  if (call->inputs().size() != 5 || !calls_functional(call, "dropout") || call->input(1) != g->inputs()[1] ||
      !constant_bool(call->input(4), false))
    return std::nullopt;
  Node* training = call->input(3)->node();
  auto p = constant_number(call->input(2));
  if (!p || training->kind() != c10::prim::GetAttr || training->s(c10::attr::name) != "training" ||
      training->input(0) != g->inputs()[0])
    return std::nullopt;
  return Dropout{nullptr, p, nullptr, n->input(0)};
}

// The pieces of one matched attention, and the nodes it replaces (first to last).
struct Match {
  Value *q = nullptr, *k = nullptr, *v = nullptr;
  Value* scale = nullptr;  // the multiplier, or the divisor when `divide`
  std::optional<double> scale_constant;
  bool divide = false;
  enum class MaskKind { kNone, kAdditive, kFillWhere, kKeepWhere } mask_kind = MaskKind::kNone;
  Value *mask = nullptr, *fill = nullptr;  // M; or C and f
  std::optional<Dropout> dropout;
  Node* transpose = nullptr;
  std::vector<Node*> chain;  // matmul(q, k^T) ... matmul(P, v)
};

// matmul(q, k.transpose(-2, -1)) (the dims -2/2 and -1/3 in either order): fills q, k.
bool match_scores(Node* mm, Match& m) {
  if (mm->kind() != c10::aten::matmul || mm->inputs().size() != 2) return false;
  Node* t = mm->input(1)->node();
  if (t->kind() != c10::aten::transpose || t->inputs().size() != 3) return false;
  auto a = constant_int(t->input(1)), b = constant_int(t->input(2));
  if (!a || !b) return false;
  const int64_t r = rank_of(t->input(0));
  auto last = [&](int64_t d) { return d == -1 || (d == 3 && (r == 4 || r == -1)); };
  auto second = [&](int64_t d) { return d == -2 || (d == 2 && (r == 4 || r == -1)); };
  if (!((last(*a) && second(*b)) || (second(*a) && last(*b)))) return false;
  m.q = mm->input(0);
  m.k = t->input(0);
  m.transpose = t;
  return true;
}

// S * c or S / c with c a number (a constant, or a float/int value), S the scores' product.
bool match_scaled(Value* s, Match& m) {
  Node* n = s->node();
  if ((n->kind() == c10::aten::mul || n->kind() == c10::aten::div) && n->inputs().size() == 2 &&
      only_user(n->input(0)) == n && match_scores(n->input(0)->node(), m)) {
    Value* c = n->input(1);
    const c10::TypeKind kind = c->type()->kind();
    m.scale_constant = constant_number(c);
    if (!m.scale_constant && kind != c10::TypeKind::FloatType && kind != c10::TypeKind::IntType) return false;
    m.scale = c;
    m.divide = n->kind() == c10::aten::div;
    m.chain.push_back(n->input(0)->node());
    m.chain.push_back(n);
    return true;
  }
  if (!match_scores(n, m)) return false;
  m.chain.push_back(n);
  return true;
}

// The logits the softmax reads: [mask op of] [scaled] scores.
bool match_logits(Value* s, Match& m) {
  Node* n = s->node();
  const c10::Symbol kind = n->kind();
  if (kind == c10::aten::add && n->inputs().size() == 3 && constant_number(n->input(2)) == 1.0) {
    for (int i = 0; i < 2; ++i) {
      Value *chain = n->input(size_t(i)), *mask = n->input(size_t(1 - i));
      if (only_user(chain) != n || !is_tensor_value(mask)) continue;
      Match tried = m;
      if (!match_scaled(chain, tried)) continue;
      m = tried;
      m.mask_kind = Match::MaskKind::kAdditive;
      m.mask = mask;
      m.chain.push_back(n);
      return true;
    }
    return false;
  }
  if (kind == c10::aten::masked_fill && n->inputs().size() == 3 && only_user(n->input(0)) == n &&
      match_scaled(n->input(0), m)) {
    m.mask_kind = Match::MaskKind::kFillWhere;
    m.mask = n->input(1);
    m.fill = n->input(2);
    m.chain.push_back(n);
    return true;
  }
  if (kind == c10::aten::where && n->inputs().size() == 3 && is_tensor_value(n->input(1)) &&
      only_user(n->input(1)) == n && match_scaled(n->input(1), m)) {
    m.mask_kind = Match::MaskKind::kKeepWhere;
    m.mask = n->input(0);
    m.fill = n->input(2);
    m.chain.push_back(n);
    return true;
  }
  return match_scaled(s, m);
}

// From a softmax forward to the product with v; fills everything or returns false.
bool match(Node* softmax, Match& m) {
  const auto sm = softmax_of(softmax);
  if (!sm) return false;
  auto dim = constant_int(sm->dim);
  if (!dim) return false;
  if (!(*dim == -1 || (*dim == 3 && rank_of(sm->x) == 4))) return false;
  if (!is_none(sm->dtype) && constant_int(sm->dtype) != kFloat32) return false;
  // Backwards: an fp32 cast, then the logits.
  Value* logits = sm->x;
  if (only_user(logits) != softmax) return false;
  Node* cast_in = nullptr;
  if (Value* x = through_to_fp32(logits->node())) {
    if (only_user(x) != logits->node()) return false;
    cast_in = logits->node();
    logits = x;
  }
  if (!match_logits(logits, m)) return false;
  if (cast_in) m.chain.push_back(cast_in);
  m.chain.push_back(softmax);
  // Forwards: casts, dropout, casts, then matmul(P, v).
  Value* p = softmax->output();  // (the call's, for F.softmax)
  for (;;) {
    Node* next = only_user(p);
    if (!next || next->outputs().size() != 1) return false;
    const bool call = next->kind() == c10::prim::CallFunction || next->kind() == c10::prim::CallMethod;
    if (next->input(call ? 1 : 0) != p) return false;
    m.chain.push_back(next);
    if (next->kind() == c10::aten::matmul && next->inputs().size() == 2) {
      m.v = next->input(1);
      break;
    }
    // (a called function or method reads p as its first argument, after the callee)
    const auto dropout = dropout_of(next);
    if (dropout && !m.dropout) {
      m.dropout = dropout;
    } else if (dropout || (!through_to_fp32(next) && !dtype_of(next))) {
      return false;
    }
    p = next->output();
  }
  // Casts to the dtype of q, k or v (attention's three share one): the product's dtype as it is.
  for (Node* n : m.chain)
    if (Value* like = dtype_of(n); like && like != m.q && like != m.k && like != m.v) return false;
  return true;
}

// Rewrites one matched attention.
void replace_eager_attention(const Match& m) {
  Node* last = m.chain.back();
  torch::jit::Graph& g = *last->owningGraph();
  Value *k = m.k, *v = m.v;
  Value *mask = nullptr, *scale = nullptr, *dropout_p = nullptr, *gqa = nullptr, *no = nullptr;
  {
    torch::jit::WithInsertPoint guard(last);
    no = g.insertConstant(false);  // is_causal: the mask says it
    gqa = g.insertConstant(take_unrepeated(g, k, v));
    switch (m.mask_kind) {
      case Match::MaskKind::kNone:
        mask = g.insertConstant(c10::IValue());
        break;
      case Match::MaskKind::kAdditive:  // in fp32, as SDPA adds it (a no-op for an fp32 mask; a bool one adds 0/1 as before)
        mask = g.insert(c10::aten::to, {m.mask, kFloat32, false, false});
        break;
      case Match::MaskKind::kFillWhere:  // masked_fill(S, C, f): f where C
        mask = g.insert(c10::aten::where, {m.mask, m.fill, 0.0});
        break;
      case Match::MaskKind::kKeepWhere:  // where(C, S, f): S where C, f elsewhere
        mask = g.insert(c10::aten::where, {m.mask, 0.0, m.fill});
        break;
    }
    if (!m.scale) {
      scale = g.insertConstant(1.0);
    } else if (m.scale_constant) {
      scale = g.insertConstant(m.divide ? 1.0 / *m.scale_constant : *m.scale_constant);
    } else {
      Value* c = m.scale->type()->kind() == c10::TypeKind::IntType ? g.insert(c10::aten::Float, {m.scale}) : m.scale;
      scale = m.divide ? g.insert(c10::aten::div, {1.0, c}) : c;
    }
    // p * float(train): SDPA's dropout_p is p when training, 0 otherwise.
    if (!m.dropout || (m.dropout->train && constant_bool(m.dropout->train, false))) {
      dropout_p = g.insertConstant(0.0);
    } else {
      Value* p = m.dropout->p ? m.dropout->p : g.insertConstant(*m.dropout->p_constant);
      Value* train = m.dropout->train ? m.dropout->train : g.insertGetAttr(m.dropout->module, "training");
      if (constant_bool(train, true)) {
        dropout_p = p;
      } else {
        Value* on = g.insert(c10::aten::Float, {train});
        dropout_p = g.insert(c10::aten::mul, {p, on});
      }
    }
  }
  Value* v_repeated = v != m.v ? m.v : nullptr;
  replace_node_by(last, "mfsdp::sdpa", {m.q, k, v, mask, dropout_p, no, scale, gqa});
  // The rest of the chain, last first: each output is unused once its reader is gone. Then the
  // repeat of v, then the transpose of k (and k's repeat behind it): v's first, so that a node the
  // two share (an unpack of both) goes with the second, never twice.
  for (auto it = m.chain.rbegin() + 1; it != m.chain.rend(); ++it) (*it)->destroy();
  if (v_repeated) drop_dead(v_repeated->node());
  drop_dead(m.transpose);
}

// mfsdp::attention(q, k, v, mask, scale, softcap) with no soft cap (a constant None): HF's eager
// attention behind scripts/export_hf.py's operator, which is SDPA with enable_gqa.
bool replace_attention_op(Node* node) {
  if (node->inputs().size() != 6 || node->outputs().size() != 1 || !is_none(node->input(5))) return false;
  torch::jit::Graph& g = *node->owningGraph();
  Value *zero = nullptr, *no = nullptr, *yes = nullptr;
  {
    torch::jit::WithInsertPoint guard(node);
    zero = g.insertConstant(0.0);
    no = g.insertConstant(false);
    yes = g.insertConstant(true);
  }
  return replace_node_by(node, "mfsdp::sdpa",
                         {node->input(0), node->input(1), node->input(2), node->input(3), zero, no, node->input(4), yes});
}

}  // namespace

// mfsdp::attention(q, k, v, mask, scale, softcap): Hugging Face's eager attention as one operator
// (scripts/mfsdp_ops.py declares the same schema for the exporter's traces: families with eager
// attention only, Gemma 2's soft-capped logits). Composite: the same aten calls as transformers'
// eager_attention_forward (shared key/value heads expanded to their query heads, scores scaled
// after the product, capped by divide-tanh-multiply, the additive mask, softmax in fp32, cast back),
// so without CP a file calling it trains as PyTorch trains the eager model. Where no soft cap is
// given, use_fast_eager_attention (below) replaces the call by mfsdp::sdpa on the CPU.
at::Tensor eager_attention_op(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                              const std::optional<at::Tensor>& mask, double scale, std::optional<double> softcap) {
  at::Tensor k = k_in, v = v_in;
  if (k.size(1) != q.size(1)) {
    const int64_t b = k.size(0), kvh = k.size(1), s = k.size(2), g = q.size(1) / kvh;
    k = k.unsqueeze(2).expand({b, kvh, g, s, k.size(3)}).reshape({b, kvh * g, s, k.size(3)});
    v = v.unsqueeze(2).expand({b, kvh, g, s, v.size(3)}).reshape({b, kvh * g, s, v.size(3)});
  }
  at::Tensor w = at::matmul(q, k.transpose(2, 3)) * scale;
  if (softcap) w = at::tanh(w / *softcap) * *softcap;
  if (mask && mask->defined()) w = w + *mask;
  w = at::softmax(w, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(w, v);
}

int use_fast_eager_attention(torch::jit::Module& root) {
  static const c10::Symbol op = c10::Symbol::fromQualString("mfsdp::attention");
  // Matched first, all of them, then replaced: a replacement destroys calls (F.dropout's) that are
  // among the nodes rewrite_nodes collected.
  std::vector<Match> found;
  const int ops = rewrite_nodes(
      root, {c10::aten::softmax, c10::prim::CallFunction, op},
      [&](Node* n) {
        if (n->kind() == op) return replace_attention_op(n);
        Match m;
        if (match(n, m)) found.push_back(std::move(m));
        return false;
      },
      /*into_functions=*/true);
  for (const Match& m : found) replace_eager_attention(m);
  return ops + int(found.size());
}

}  // namespace mfsdp

TORCH_LIBRARY_FRAGMENT(mfsdp, m) {
  // The schema scripts/mfsdp_ops.py declares (a trace calling it loads here): pure, so FROM_SCHEMA.
  m.def(torch::schema("mfsdp::attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float? softcap) -> Tensor",
                      c10::AliasAnalysisKind::FROM_SCHEMA));
}

TORCH_LIBRARY_IMPL(mfsdp, CompositeImplicitAutograd, m) { m.impl("attention", mfsdp::eager_attention_op); }
