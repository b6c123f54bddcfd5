// Matching pieces of TorchScript graphs that several rewrites share (DESIGN.md section 7, "CPU
// kernels of mfsdp's own"): constants, the size arithmetic traces record, repeats of attention's
// key/value heads, and dropping what a rewrite leaves unused.
#pragma once
#include <torch/csrc/jit/ir/ir.h>

#include <cstdint>
#include <memory>
#include <string>
#include <optional>
#include <utility>

namespace mfsdp {

// The value of an int constant, else nothing.
std::optional<int64_t> constant_int(torch::jit::Value* v);

// The graph of a prim::CallFunction's callee, or of a prim::CallMethod "forward"'s (with the
// function's qualified name: "torch.nn.functional.silu"), else nullptr.
std::shared_ptr<torch::jit::Graph> callee_graph(torch::jit::Node* call, std::string* qualname = nullptr);

// Destroys n, then the producers of its inputs that nothing uses any more (drop_dead).
void destroy_and_drop(torch::jit::Node* n);
// Pure nodes the matchers leave behind (slices, chunk, list plumbing, size arithmetic, the heads'
// repeats, transposes): destroyed when nothing uses them any more, with the producers of their
// inputs in turn. Other nodes are left as they are.
void drop_dead(torch::jit::Node* n);

// The value a full slice (start 0, end None or INT64_MAX, step 1: `x[:, :]` traced) was taken of,
// else nullptr.
torch::jit::Value* through_full_slice(torch::jit::Value* v);

// (t, d) when v is size(t, d) or size(t)[d] with a constant d, possibly through the int/tensor
// round trips a trace records (aten::Int(prim::NumToTensor(size(t, d)))).
std::optional<std::pair<torch::jit::Value*, int64_t>> size_of(torch::jit::Value* v);

// A repeat of the heads of a 4-D x along dimension `heads` (1: [B, H, T, D]; 2: [B, T, H, D]), each
// head n times in place: (x, n as a graph value), else nothing. HF's and torchtitan's repeat_kv as
// traced, and repeat_interleave (graph_match.cpp says which spellings).
std::optional<std::pair<torch::jit::Value*, torch::jit::Value*>> repeat_of(torch::jit::Value* v, int64_t heads);

// Keys and values before a head repeat both went through by the same count: repeated as attention
// takes them ([B, H, T, D]), or repeated as [B, T, H, D] and then transposed(1, 2) (torchtitan's
// layout; `transposed` says so: the caller transposes the unrepeated ones).
struct Unrepeated {
  torch::jit::Value *k, *v;
  bool transposed;
};
std::optional<Unrepeated> unrepeated(torch::jit::Value* k, torch::jit::Value* v);

// Attention's keys and values, when both are head repeats (unrepeated): k and v become the tensors
// before the repeat (transposed(1, 2) at the graph's insert point for torchtitan's layout), and
// true is returned (the caller sets enable_gqa); else they stay and false. The sizes read of the
// repeats other than the heads' (size(r, d), size(r)[d]) then read the unrepeated tensors', which are
// the same: Hugging Face's eager attention slices its mask to key_states.shape[-2] after repeat_kv,
// and without this the repeat's copy would be made for that size alone.
bool take_unrepeated(torch::jit::Graph& g, torch::jit::Value*& k, torch::jit::Value*& v);

}  // namespace mfsdp
