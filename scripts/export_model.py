#!/usr/bin/env python3
"""Export reference models as TorchScript files that mfsdp trains.

Run with the project's python (torch 2.11 in .venv, made by scripts/setup.sh):
    .venv/bin/python scripts/export_model.py --arch gpt --layers 4 --d-model 256 --heads 4 --vocab 264 --out gpt.pt
    .venv/bin/python scripts/export_model.py --arch llama --layers 4 --d-model 256 --heads 4 --kv-heads 2 --out llama.pt

The model contract (README "Model contract") that any TorchScript model must follow:
  forward(tokens: int64 [B, T], position_ids: int64 [B, T]) -> logits: float [B, T, V]
  - the loss is the trainer's (cross entropy over the logits);
  - the repeated blocks are sibling submodules (blocks.0, blocks.1, ... of one class): the FSDP units;
  - the attention core softmax(QK^T/sqrt(d))V with a causal mask is a submodule of its own
    (class CoreAttention, forward(q, k, v) on [B, heads, T, head_dim]);
  - head counts and the sequence length are computed from the shapes of the projections' outputs
    and a head_dim attribute, never stored nor taken from the module's input, so that a
    tensor-parallel rank holding a slice of the heads (and, with sequence parallelism, a slice of
    the input sequence) runs the same code.
"""
import argparse
import sys
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# --attention: "sdpa" (default) calls torch's scaled_dot_product_attention (flash attention on CPUs
# and GPUs: no [T, T] score matrix in memory; on this project's CPU 6-24% faster per training step
# than "math", measured in PyTorch and in mfsdp, seq 128-512); "math" spells softmax(QK^T/sqrt(d))V
# out op by op. Read when a CoreAttention is built.
ATTENTION = "sdpa"


class CoreAttention(nn.Module):
    """Causal scaled dot-product attention on [B, H, T, D]."""

    def __init__(self):
        super().__init__()
        self.use_sdpa = ATTENTION == "sdpa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.use_sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        scale = 1.0 / math.sqrt(float(q.size(-1)))
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        keep = torch.ones_like(scores, dtype=torch.bool).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return torch.matmul(probs, v)


# ----------------------------------------------------------------------------- GPT-2 style
class GptAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.c_attn = nn.Linear(d, 3 * d)  # q, k, v packed along the output dimension
        self.core_attention = CoreAttention()
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        # Sizes from the projection, not from x: with sequence parallelism x holds part of the
        # sequence and the projection all of it; with tensor parallelism q holds some of the heads.
        b, t, h = q.size(0), q.size(1), q.size(-1) // self.head_dim
        q = q.reshape(b, t, h, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, h, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, h, self.head_dim).transpose(1, 2)
        y = self.core_attention(q, k, v)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, h * self.head_dim))


class GptMlp(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout  # residual dropout (GPT-2's resid_pdrop), only in training
        self.ln_1 = nn.LayerNorm(d)
        self.attn = GptAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = GptMlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.ln_1(x))
        if self.dropout > 0.0:
            a = F.dropout(a, self.dropout, self.training)
        x = x + a
        m = self.mlp(self.ln_2(x))
        if self.dropout > 0.0:
            m = F.dropout(m, self.dropout, self.training)
        return x + m


class Stage(nn.Module):
    """A group of blocks (for --nested: units two levels below the root)."""

    def __init__(self, d: int, heads: int, n: int, dropout: float = 0.0):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, heads, dropout) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Gpt(nn.Module):
    def __init__(self, vocab: int, max_seq: int, d: int, layers: int, heads: int, tied: bool, nested: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        self.tied = tied
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_seq, d)
        if nested:  # trunk.stages.K.blocks.J
            half = max(1, layers // 2)
            self.blocks = nn.ModuleList([Stage(d, heads, half, dropout), Stage(d, heads, layers - half, dropout)])
        else:
            self.blocks = nn.ModuleList([Block(d, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ----------------------------------------------------------------------------- Llama style
class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, rope_theta: float, rope_buffer: bool = False):
        super().__init__()
        self.head_dim = d // heads
        self.rope_theta = rope_theta
        self.rope_buffer = rope_buffer
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.core_attention = CoreAttention()
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)
        # Rotary frequencies are computed in forward (no buffer), so that the model can be loaded on
        # the meta device (init_fsdp_with_meta_device); --rope-buffer keeps one, as HF models do.
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq if rope_buffer else torch.zeros(0), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, t = q.size(0), q.size(1)  # from the projection (see GptAttention)
        h, hkv = q.size(-1) // self.head_dim, k.size(-1) // self.head_dim
        q = q.reshape(b, t, h, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, hkv, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, hkv, self.head_dim).transpose(1, 2)
        # Rotary embedding from the (global) position ids.
        if self.rope_buffer:
            inv_freq = self.inv_freq
        else:
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=x.device) / float(self.head_dim)
            inv_freq = 1.0 / torch.pow(torch.full_like(exponent, self.rope_theta), exponent)
        freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, T, D]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if hkv != h:  # grouped-query attention
            k = k.repeat_interleave(h // hkv, dim=1)
            v = v.repeat_interleave(h // hkv, dim=1)
        y = self.core_attention(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h * self.head_dim))


class LlamaMlp(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, hidden: int, rope_theta: float, rope_buffer: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attn = LlamaAttention(d, heads, kv_heads, rope_theta, rope_buffer)
        self.post_attention_layernorm = RMSNorm(d)
        self.mlp = LlamaMlp(d, hidden)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), position_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, hidden: int,
                 rope_theta: float, tied: bool, rope_buffer: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([DecoderLayer(d, heads, kv_heads, hidden, rope_theta, rope_buffer)
                                     for _ in range(layers)])
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, position_ids)
        return self.lm_head(self.norm(x))


# Default tensor-parallel plans (Megatron-LM layout), stored in the exported file as the extra file
# mfsdp/tp_plan.json; distributed.tp_plan in the YAML replaces them. Keys are globs over module paths.
GPT_TP_PLAN = {
    "wte": "vocab_parallel",
    "*.attn.c_attn": "colwise:3",  # q, k, v packed: each part sharded by heads
    "*.attn.c_proj": "rowwise",
    "*.mlp.c_fc": "colwise",
    "*.mlp.c_proj": "rowwise",
    "*.ln_1": "sequence_parallel",
    "*.ln_2": "sequence_parallel",
    "ln_f": "sequence_parallel",
    "lm_head": "colwise",  # logits stay sharded over the vocabulary: vocab-parallel cross entropy
}
LLAMA_TP_PLAN = {
    "embed_tokens": "vocab_parallel",
    "*.self_attn.q_proj": "colwise",
    "*.self_attn.k_proj": "colwise",
    "*.self_attn.v_proj": "colwise",
    "*.self_attn.o_proj": "rowwise",
    "*.mlp.gate_proj": "colwise",
    "*.mlp.up_proj": "colwise",
    "*.mlp.down_proj": "rowwise",
    "*.input_layernorm": "sequence_parallel",
    "*.post_attention_layernorm": "sequence_parallel",
    "norm": "sequence_parallel",
    "lm_head": "colwise",
}


def init_weights(model: nn.Module, layers: int, std: float = 0.02) -> None:
    """GPT-2 initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2 L)."""
    for name, p in model.named_parameters():
        if p.dim() == 1:
            if name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)
        elif name.endswith(("c_proj.weight", "o_proj.weight", "down_proj.weight")):
            nn.init.normal_(p, 0.0, std / math.sqrt(2 * layers))
        else:
            nn.init.normal_(p, 0.0, std)


def build(args) -> nn.Module:
    if args.d_model % args.heads:
        raise SystemExit(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if args.arch == "gpt":
        model = Gpt(args.vocab, args.max_seq, args.d_model, args.layers, args.heads, not args.untied, args.nested,
                    getattr(args, "dropout", 0.0))
    else:
        kv = args.kv_heads or args.heads
        if args.heads % kv:
            raise SystemExit(f"--heads {args.heads} is not divisible by --kv-heads {kv}")
        hidden = args.ffn_hidden or int(8 * args.d_model / 3 + 63) // 64 * 64
        model = Llama(args.vocab, args.d_model, args.layers, args.heads, kv, hidden, args.rope_theta, args.tied,
                      args.rope_buffer)
    init_weights(model, args.layers)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (default: --heads)")
    ap.add_argument("--ffn-hidden", type=int, default=0, help="llama: MLP width (default: 8/3 d rounded to 64)")
    ap.add_argument("--vocab", type=int, default=264, help="vocabulary size (byte-level data needs >= 257)")
    ap.add_argument("--vocab-from", metavar="PREFIX.meta.json",
                    help="take the vocabulary size from what prepare-data wrote beside a dataset, rounded up to "
                         "--vocab-multiple (overrides --vocab)")
    ap.add_argument("--vocab-multiple", type=int, default=128,
                    help="with --vocab-from: pad the vocabulary to a multiple of this (Megatron's "
                         "--make-vocab-size-divisible-by; keeps TP shards equal)")
    ap.add_argument("--max-seq", type=int, default=1024, help="gpt: learned positions")
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--rope-buffer", action="store_true", help="llama: keep rotary frequencies in a buffer")
    ap.add_argument("--untied", action="store_true", help="gpt: separate output head (default: tied to wte)")
    ap.add_argument("--tied", action="store_true", help="llama: tie the output head to the embedding")
    ap.add_argument("--attention", choices=["math", "sdpa"], default="sdpa",
                    help="attention core: torch's scaled_dot_product_attention (default) or an explicit softmax")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the weights in the file")
    ap.add_argument("--trace", action="store_true", help="torch.jit.trace instead of torch.jit.script")
    ap.add_argument("--nested", action="store_true", help="gpt: blocks grouped in two stages (blocks.K.blocks.J)")
    ap.add_argument("--no-tp-plan", action="store_true", help="do not store the default tensor-parallel plan")
    ap.add_argument("--dropout", type=float, default=0.0, help="gpt: residual dropout probability in training")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--state-dict", help="also save the initial state_dict (torch.save) here, for parity checks")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.vocab_from:
        try:
            meta = json.load(open(args.vocab_from))
            n = int(meta["vocab_size"])
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--vocab-from {args.vocab_from}: expected prepare-data's PREFIX.meta.json with vocab_size ({e})")
        m = max(1, args.vocab_multiple)
        args.vocab = (n + m - 1) // m * m
        print(f"export_model: vocabulary {n} ({meta.get('tokenizer')}) padded to {args.vocab}", file=sys.stderr)

    torch.manual_seed(args.seed)
    global ATTENTION
    ATTENTION = args.attention
    model = build(args).eval()
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    if args.trace:
        tokens = torch.zeros(2, 16, dtype=torch.long)
        pos = torch.arange(16).unsqueeze(0).expand(2, 16).contiguous()
        exported = torch.jit.trace(model, (tokens, pos), check_trace=False)
    else:
        exported = torch.jit.script(model)
    plan = GPT_TP_PLAN if args.arch == "gpt" else LLAMA_TP_PLAN
    if args.no_tp_plan:
        exported.save(args.out)
    else:
        exported.save(args.out, _extra_files={"mfsdp/tp_plan.json": json.dumps(plan, indent=1)})
    if args.state_dict:
        torch.save(model.state_dict(), args.state_dict)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {args.arch}, {n} parameters, {'traced' if args.trace else 'scripted'}")


if __name__ == "__main__":
    main()
