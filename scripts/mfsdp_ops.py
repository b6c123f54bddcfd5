"""mfsdp's TorchScript operators for Python: import this module before torch.jit.load of a file
that calls them (scripts/export_hf.py writes such files for families with eager attention only).

mfsdp::attention(q, k, v, mask, scale, softcap) is Hugging Face's eager attention as one operator:
    softmax(cap * tanh(q k^T * scale / cap) + mask) v      (no cap: q k^T * scale + mask)
with fewer key/value heads than query heads repeated to them (grouped-query attention), the
softmax in fp32 and cast back to q's dtype, as transformers' eager_attention_forward computes it.
Why an operator: a trace records the matmuls of eager attention as loose nodes that mfsdp cannot
recognise as attention, so context parallelism could not replace them; one node can be (mfsdp's
C++ declares the same schema with the same composite implementation, lib/model/eager_attention.cpp;
CP swaps it for the blockwise causal attention with the soft cap, and without CP a call with no
soft cap runs mfsdp's CPU attention kernel).
The implementation below is composite (autograd differentiates its aten calls), so PyTorch trains a
model calling it exactly as it trains the eager original.
"""
import torch

SCHEMA = "attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float? softcap) -> Tensor"


def attention_math(q, k, v, mask, scale, softcap):
    """The eager computation, aten call for aten call as transformers' eager_attention_forward
    (repeat_kv: expand + reshape; scale after the product; cap by divide, tanh, multiply; the
    mask added after the cap; softmax in fp32)."""
    if k.size(1) != q.size(1):
        b, kvh, s, d = k.shape
        g = q.size(1) // kvh
        k = k[:, :, None, :, :].expand(b, kvh, g, s, d).reshape(b, kvh * g, s, d)
        v = v[:, :, None, :, :].expand(b, kvh, g, s, v.size(3)).reshape(b, kvh * g, s, v.size(3))
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        w = w / softcap
        w = torch.tanh(w)
        w = w * softcap
    if mask is not None:
        w = w + mask
    w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


def _defined():
    try:
        torch.ops.mfsdp.attention
        return True
    except (AttributeError, RuntimeError):
        return False


_LIB = None
if not _defined():
    _LIB = torch.library.Library("mfsdp", "FRAGMENT")
    _LIB.define(SCHEMA)
    _LIB.impl("attention", attention_math, "CompositeImplicitAutograd")


def attention(q, k, v, mask, scale, softcap):
    return torch.ops.mfsdp.attention(q, k, v, mask, float(scale), None if softcap is None else float(softcap))
