#!/usr/bin/env python3
"""Export a Hugging Face transformers causal LM, unchanged, as a TorchScript file that mfsdp trains.

Run with the project's python (.venv, made by scripts/setup.sh, which installs transformers):
    # a local model directory (config.json, and model.safetensors or its sharded index): its weights
    .venv/bin/python scripts/export_hf.py --model-dir ~/models/Qwen2.5-0.5B --out qwen.pt
    # the same architecture, random initialisation (the directory's weights are not read)
    .venv/bin/python scripts/export_hf.py --model-dir ~/models/Qwen2.5-0.5B --random-init --out qwen.pt
    # a small config given on the command line: a model type and config keys
    .venv/bin/python scripts/export_hf.py --family llama --set hidden_size=256 num_hidden_layers=4 \\
        num_attention_heads=4 num_key_value_heads=2 intermediate_size=688 vocab_size=32000 --out llama.pt
    # LoRA (PEFT): the model wrapped by peft.get_peft_model; mfsdp then trains the adapters only
    .venv/bin/python scripts/export_hf.py --model-dir ~/models/Qwen2.5-0.5B --lora-r 16 --lora-alpha 32 \
        --lora-targets q_proj k_proj v_proj o_proj --out qwen_lora.pt
    # an existing PEFT adapter directory (adapter_config.json, adapter_model.safetensors), trained on
    .venv/bin/python scripts/export_hf.py --model-dir ~/models/Qwen2.5-0.5B --adapter-dir ./my_adapter --out q.pt
Nothing is downloaded: a model directory must be on disk (transformers runs with local_files_only).

What the file holds:
  - the transformers model itself (its own classes and parameter names, model.layers.N.self_attn...),
    traced with torch.jit.trace; its forward is the model contract (README "Model contract"):
    forward(tokens int64 [B, T], position_ids int64 [B, T]) -> logits [B, T, V], calling the HF
    model's own forward (use_cache off) and returning its logits, so softcapping, embedding scales
    and tied heads are the family's own code;
  - mfsdp/hf_config.json: the config.json the model was built from (as used: dropouts set to 0,
    special token ids outside the vocabulary cleared), for `mfsdp export --format hf` and the
    PyTorch oracle (tests/oracle/reference_trainer.py trains the HF model from it);
  - mfsdp/tp_plan.json: the tensor-parallel plan derived from the config's base_model_tp_plan (its
    module globs under the base model's prefix; colwise, rowwise and replicated_with_grad_allreduce
    kept, colwise_gather_output and rowwise_split_input as colwise_rep and rowwise_rep, an MoE experts
    module's moe_tp_experts (with its packed_colwise / rowwise 3-D weights) as moe_experts; GPT-2, whose
    config has none, gets BUILTIN_TP_PLANS), plus a vocab-parallel embedding and a colwise output
    head; styles mfsdp cannot apply drop the plan, with a note. For sequence parallelism: blocks
    with split layers are sequence_gathered, norms sequence_parallel, and the layer modules the
    plan leaves unsplit sequence_parallel where a probe finds them token-wise (an MLP) and
    sequence_whole where they mix positions (an attention, a convolution: token_wise);
  - mfsdp/hf_export.json: the family, the class, the transformers and torch versions, and the
    config's attention window (sliding window, attention chunk, or a layer kind that is no softmax
    attention; attention_window), which mfsdp's context parallelism refuses when it is shorter than
    the sequence;
  - with LoRA: the PeftModel itself (PEFT's names, base_model.model.model.layers.N...q_proj.lora_A.default
    .weight), mfsdp/trainable.json (the parameters PEFT leaves trainable: mfsdp's default
    model.trainable) and mfsdp/adapter_config.json (PEFT's, for `mfsdp export --only-trainable`).
    The tensor-parallel plan is moved onto PEFT's names: base layers split as before, lora_B split
    with a colwise base layer (lora_A replicated, its gradient summed), lora_A split with a rowwise
    one (peft_tp_plan).
The trace is checked: the traced model and the HF model give the same logits on a batch of another
shape than the one traced (a shape baked into the trace fails the export).

Custom autograd Functions (BLOOM's GeLUFunction: a hand-written backward of its tanh GELU) cannot be
saved in TorchScript (the tracer records them as a Python call). They are traced through their
forward (inline_autograd_functions), so mfsdp differentiates the forward's own operations; that is
the same training only if the Function's backward is its forward's derivative, so the export then
compares every parameter's gradient of the traced model with the HF model's (its own backward) on
the trace batch and fails, naming the Functions, where they differ.

Dropout: a trace fixes the train/eval mode of dropout. By default (--dropout zero) every dropout
probability in the config, and PEFT's lora_dropout, is set to 0 (printed); the oracle and
`export --format hf` see the same zeros. With --dropout config they are kept and the model is traced
in training mode, so the file drops activations with the config's probabilities (aten::dropout
with train=True, sdpa's dropout_p); mfsdp makes those calls follow train()/eval() when it loads the
file (off in validation) and seeds the random generator per data-parallel rank (README "Dropout").
The trace check then runs the HF model and the trace from the same generator state: equal masks.
--lora-dropout P sets a new adapter's lora_dropout (kept whatever --dropout says).
"""
import argparse
import contextlib
import json
import os
import re
import sys
import types
import warnings


def parse_value(text):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if text[:1] in "[{":
        return json.loads(text)
    return text


# HF styles mfsdp applies as they are, and the ones it does not (the plan is then left out).
# HF's plan styles and mfsdp's: colwise_gather_output (Phi-3's fused qkv_proj and gate_up_proj:
# the output gathered, since the caller splits it by fixed widths) is colwise_rep, and the
# rowwise_split_input after it (the input replicated, each rank taking its slice) rowwise_rep.
KEPT_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "replicated_with_grad_allreduce",
               "colwise_gather_output": "colwise_rep", "rowwise_split_input": "rowwise_rep",
               "embedding_rowwise": "vocab_parallel",  # GPT-NeoX's embed_in: its rows (the vocabulary) split
               # MLA's kv_a_proj_with_mqa (DeepSeek V2): replicated; its output feeds the heads'
               # colwise kv_b_proj and, unprojected, their shared rope keys, so its gradient is partial.
               "mla_kv_a_proj": "replicated_with_grad_allreduce"}


# The expert weights under an HF moe_tp_experts module, with the styles HF gives them, that mfsdp's
# moe_experts splits the same way (every expert's intermediate dimension; gate_up in its two parts).
MOE_EXPERT_WEIGHTS = (("gate_up_proj", "packed_colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))


# Plans for families whose config has no base_model_tp_plan, in mfsdp's styles, keyed like one
# (under the base model's prefix). GPT-2: Conv1D projections (mfsdp splits their [in, out] weights
# along out for colwise, along in for rowwise); c_attn packs q, k and v, so each of the three parts
# is split (colwise:3) and the caller's split(n_embd) becomes split(n_embd / tp).
BUILTIN_TP_PLANS = {
    "gpt2": {"h.*.attn.c_attn": "colwise:3", "h.*.attn.c_proj": "rowwise",
             "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise",
             # GPT2Model views the final norm's output to the input's shape (the whole sequence):
             # under sequence parallelism that output is gathered (sequence_parallel_gather).
             "ln_f": "sequence_parallel_gather"},
    # StableLM: Llama's layout (its attention views q, k and v by constant head counts, which
    # mfsdp makes local). Not with qk_layernorm: its per-head norms are a list over all heads.
    "stablelm": {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                 "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                 "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
                 "layers.*.mlp.down_proj": "rowwise"},
    # OPT: fc1 and fc2 sit in the decoder layer itself, on the tokens flattened to [B x T, H]
    # (sequence parallelism gathers and scatters those along dim 0); only the attention is a block.
    "opt": {"decoder.layers.*.self_attn.q_proj": "colwise", "decoder.layers.*.self_attn.k_proj": "colwise",
            "decoder.layers.*.self_attn.v_proj": "colwise", "decoder.layers.*.self_attn.out_proj": "rowwise",
            "decoder.layers.*.fc1": "colwise", "decoder.layers.*.fc2": "rowwise"},
    # GPT-Neo: separate q/k/v projections viewed by the constant head count (made local), the MLP's
    # c_fc/c_proj plain Linears; GPTNeoModel views ln_f's output to the input's whole-sequence shape,
    # as GPT-2 does (sequence_parallel_gather).
    "gpt_neo": {"h.*.attn.attention.q_proj": "colwise", "h.*.attn.attention.k_proj": "colwise",
                "h.*.attn.attention.v_proj": "colwise", "h.*.attn.attention.out_proj": "rowwise",
                "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise", "ln_f": "sequence_parallel_gather"},
}


# Entries a family's config plan lacks, added when it has none for that module: DeepSeek V3's
# config plans its MLP and experts but leaves the MLA attention replicated (each TP rank would run
# every head, and under sequence parallelism the attention would see a part of the sequence);
# DeepSeek V2's config plans the same attention this way.
PLAN_SUPPLEMENTS = {
    "deepseek_v3": {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.q_b_proj": "colwise",
                    "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
                    "layers.*.self_attn.kv_b_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"},
}


def hooked_forward(model, hooks, T=4):
    """One forward of T tokens through the class's forward (the instance's may be the contract's),
    without gradients and with the generator left as it was; removes `hooks` (handles) after."""
    import torch
    try:
        with torch.no_grad(), torch.random.fork_rng():
            ids = torch.arange(T).unsqueeze(0) % model.config.vocab_size
            type(model).forward(model, input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()


def call_order(model, globs):
    """The order in which one forward (4 tokens) first calls the modules inside `globs` (module-path
    globs, layer indices as *), as {glob of the module: position}."""
    order, hooks = {}, []
    for name, mod in model.named_modules():
        glob = re.sub(r"\.\d+\.", ".*.", name)
        if any(glob.startswith(b + ".") for b in globs):
            def first_call(m, args, glob=glob):  # returns None: the call's arguments unchanged
                order.setdefault(glob, len(order))
            hooks.append(mod.register_forward_pre_hook(first_call))
    hooked_forward(model, hooks)
    return order


def unplanned_layer_modules(model, plan, prefix):
    """Globs (layer indices as *) of the modules directly inside the model's layers (the elements of
    its ModuleLists), and the base model's other children, that hold trained parameters and that no
    plan entry covers (at, above or below them), norms and the embedding aside (their own rules
    mark them)."""
    import torch
    names = [n for n, _ in model.named_modules()]
    keys = [glob_re(k) for k in plan]
    planned = [m for m in names if any(r.fullmatch(m) for r in keys)]

    def covered(n):  # a plan entry at n, above it or below it
        return any(m == n or m.startswith(n + ".") or n.startswith(m + ".") for m in planned)
    found, seen = [], set()
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or not name.startswith(prefix + "."):
            continue
        for layer_name, layer in mod.named_children():
            for child_name, child in layer.named_children():
                glob = f"{name}.*.{child_name}"
                full = f"{name}.{layer_name}.{child_name}"
                if glob in seen or (is_norm(child) and not any(True for c in child.children() for _ in c.parameters())):
                    continue  # a plain norm: the norms' rule marks it
                if not any(p.requires_grad for p in child.parameters()) or covered(full):
                    continue
                if any(covered(m) for m in names if glob_re(glob).fullmatch(m)):
                    continue  # planned in other layers: the glob would not say one thing for all
                seen.add(glob)
                found.append(glob)
    # And beside the layers, called after them on their output (DeepSeek V4's hyper-connection head
    # hc_head). One called before them sees the whole sequence anyway (the split comes at the
    # first layer) and is plain replicated.
    # A ModuleList beside the layers (Gemma 3n's altup_unembed_projections, applied to the layers'
    # output) counts by its elements, one glob for all of them; the layers are the list holding the
    # most parameters.
    base, emb = getattr(model, prefix, None), model.get_input_embeddings()
    children = list(base.named_children()) if base is not None else []
    lists = [(n, c) for n, c in children if isinstance(c, torch.nn.ModuleList)]
    layers = max(lists, key=lambda nc: sum(p.numel() for p in nc[1].parameters()), default=(None, None))[0]
    layer_globs = [f"{prefix}.{layers}.*"] if layers is not None else []
    after = [(f"{prefix}.{n}.*" if isinstance(c, torch.nn.ModuleList) else f"{prefix}.{n}",
              [f"{prefix}.{n}.{i}" for i in range(len(c))] if isinstance(c, torch.nn.ModuleList) else [f"{prefix}.{n}"])
             for n, c in children
             if n != layers and c is not emb and not is_norm(c)
             and any(p.requires_grad for p in c.parameters()) and not covered(f"{prefix}.{n}")]
    if after and layer_globs:
        order = call_order(model, [prefix])
        first_layer = min((order[g] for g in order if any(glob_re(l).fullmatch(g) for l in layer_globs)), default=None)
        found += [glob for glob, members in after
                  if first_layer is not None and any(order.get(m, -1) > first_layer for m in members)]
    return found


def is_norm(module):
    return "norm" in type(module).__name__.lower()


def first_tensor(v):
    """A module call's main output: the tensor itself, a tuple's first tensor (HF attention returns
    (output, weights)), or a model output's last_hidden_state."""
    import torch
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (tuple, list)):
        return next((t for t in v if isinstance(t, torch.Tensor)), None)
    return getattr(v, "last_hidden_state", None)


def token_wise(model, globs):
    """{glob: whether the first module matching it works token by token}: called again on its
    recorded input with the first position changed, a token-wise module's output changes there
    alone; attention (causal: every later position) and convolutions change more. A module whose
    call has no [batch, sequence, ...] tensor counts as mixing."""
    import torch
    first, hooks, calls = {}, [], {}
    for name, mod in model.named_modules():
        glob = next((g for g in globs if glob_re(g).fullmatch(name)), None)
        if glob and glob not in first:
            first[glob] = mod

            def record(m, args, kwargs, out, glob=glob):
                calls.setdefault(glob, (args, kwargs, out))
            hooks.append(mod.register_forward_hook(record, with_kwargs=True))
    T = 8
    hooked_forward(model, hooks, T)
    result = {}
    for glob, (args, kwargs, out) in calls.items():
        args, kwargs = list(args), dict(kwargs)
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            where, x = ("kw", "hidden_states"), kwargs["hidden_states"]
        else:
            i = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            where, x = ("arg", i), (args[i] if i is not None else None)
        y = first_tensor(out)
        if x is None or y is None or x.dim() < 3 or x.shape[1] != T or y.dim() < 2 or y.shape[1] != T:
            result[glob] = False
            continue
        x2 = x.clone()
        x2[:, 0] += torch.randn_like(x2[:, 0]) * (x.abs().mean() + 1)
        if where[0] == "kw":
            kwargs[where[1]] = x2
        else:
            args[where[1]] = x2
        with torch.no_grad(), torch.random.fork_rng():
            y2 = first_tensor(first[glob](*args, **kwargs))
        result[glob] = bool(y2 is not None and y2.shape == y.shape and torch.equal(y2[:, 1:], y[:, 1:])
                            and not torch.equal(y2[:, 0], y[:, 0]))
    return result


def split_changes_output(model, plan, blocks):
    """{block glob: relative difference} for the blocks (module globs holding colwise and rowwise
    layers) whose output the plan's split changes: each module matching a glob is called again on
    its recorded input as two TP ranks would run it (colwise layers keeping half their output
    rows, rowwise layers half their input columns and rank 0 the bias; colwise_rep and rowwise_rep
    layers whole, as their gathers make them) and the two partial outputs are summed. A block whose
    code between the split layers reduces over the split features (Gemma 3n's MLP: a Gaussian
    top-k over the whole intermediate width, its mean and deviation taken per rank under TP) gives
    another output: split, it would train another model, silently (measured 1.2e-2 off PyTorch).
    A block this cannot run (a split layer that is no Linear, a call that fails on half the heads)
    is left as planned: mfsdp's own checks apply at run time."""
    import copy
    import torch
    calls, hooks = {}, []
    for name, mod in model.named_modules():
        glob = next((b for b in blocks if glob_re(b).fullmatch(name)), None)
        if glob:
            def record(m, args, kwargs, out, name=name, glob=glob):
                calls.setdefault(name, (glob, m, args, kwargs, out))
            hooks.append(mod.register_forward_hook(record, with_kwargs=True))
    hooked_forward(model, hooks, 8)

    def fp32(v):  # a bf16 model's blocks are compared in fp32: its rounding is not the question
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.float()
        if isinstance(v, (tuple, list)):
            return type(v)(fp32(x) for x in v)
        return v
    changed = {}
    for name, (glob, mod, args, kwargs, out) in calls.items():
        if first_tensor(out) is None or not first_tensor(out).is_floating_point():
            continue
        args, kwargs = fp32(args), {k: fp32(v) for k, v in kwargs.items()}
        styles = {}
        for sub_name, sub in mod.named_modules():
            path = f"{name}.{sub_name}" if sub_name else name
            style = next((st.split(":")[0] for k, st in plan.items() if glob_re(k).fullmatch(path)), None)
            if style in ("colwise", "rowwise"):
                styles[sub_name] = style
        if not styles or any(not isinstance(mod.get_submodule(n), torch.nn.Linear) for n in styles):
            continue
        with torch.no_grad(), torch.random.fork_rng():
            try:
                full = first_tensor(copy.deepcopy(mod).float().eval()(*args, **kwargs))  # no dropout
            except Exception:
                continue
        if full is None:
            continue
        # Two ways a rank may run its half: as the code stands, and with its head counts halved
        # (mfsdp rewrites the head counts a graph reshapes by: OPT's view(b, -1, num_heads, d)
        # would otherwise fold half the features into the sequence). The split keeps the output
        # when either way gives it back; a block neither runs is left as planned.
        diffs = []
        for halve_heads in (False, True):
            try:
                parts = [first_tensor(run_shard(mod, styles, r, halve_heads, args, kwargs)) for r in range(2)]
            except Exception:  # half the heads do not fit this module's code
                continue
            if all(p is not None and p.shape == full.shape for p in parts):
                diffs.append(((parts[0] + parts[1]) - full).abs().max().item() / (full.abs().max().item() + 1e-30))
        if diffs and min(diffs) > 1e-4:
            changed[glob] = max(min(diffs), changed.get(glob, 0.0))
    return changed


HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_head",
               "n_kv_heads", "kv_n_heads")


def run_shard(mod, styles, r, halve_heads, args, kwargs):
    """mod's output as TP rank r of 2 computes it (split_changes_output): colwise layers keep half
    their output rows, rowwise ones half their input columns (rank 0 the bias); with halve_heads,
    the module's and its config's head counts halved as well."""
    import copy
    import torch
    shard = copy.deepcopy(mod).float().eval()
    for sub_name, style in styles.items():
        lin = shard.get_submodule(sub_name)
        w = lin.weight.detach()
        if w.shape[0 if style == "colwise" else 1] % 2:
            raise ValueError("odd size")
        lin.weight = torch.nn.Parameter(w.chunk(2, 0 if style == "colwise" else 1)[r].clone())
        if lin.bias is not None:
            b = lin.bias.detach()
            lin.bias = (torch.nn.Parameter(b.chunk(2)[r].clone()) if style == "colwise"
                        else (lin.bias if r == 0 else None))
    if halve_heads:
        for m in shard.modules():
            for owner in (m, getattr(m, "config", None)):
                for k in HEAD_COUNTS:
                    v = getattr(owner, k, None) if owner is not None else None
                    if isinstance(v, int) and not isinstance(v, bool) and v % 2 == 0:
                        setattr(owner, k, v // 2)
    with torch.no_grad(), torch.random.fork_rng():
        return shard(*args, **kwargs)


def load_leniency(model):
    """transformers' from_pretrained adds or strips the base_model_prefix of a key that the model
    holds under the other form, and leaves out of its unexpected keys those matching the model's
    _keys_to_ignore_on_load_unexpected (and, where the model has such buffers, old per-layer
    rotary_emb.inv_freq and position_ids): {"base_model_prefix": str, "ignore_unexpected": [regex]}
    for mfsdp's model.init_from, which does the same."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix or not isinstance(getattr(model, prefix, None), __import__("torch").nn.Module):
        prefix = ""  # the model is its base model: nothing to add or strip
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    buffers = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return {"base_model_prefix": prefix, "ignore_unexpected": sorted(patterns)}


def checkpoint_layout(model):
    """How this family's HF checkpoints store what the model holds otherwise (transformers' own
    conversion mapping for the model type, applied by from_pretrained and reversed by
    save_pretrained): MoE experts saved one tensor per expert and projection
    (`mlp.experts.3.gate_proj.weight`) but held stacked (`mlp.experts.gate_up_proj`, [E, 2I, H]),
    and renamed modules (Mixtral's `block_sparse_moe` for `mlp`). Returns ({"renames": [[file regex,
    model name]], "save_renames": [[model regex, file name]], "stacks": {parameter: [its pieces'
    names, in the order of their elements]}}, note) for mfsdp's model.init_from, and export --format
    hf, which writes the files save_pretrained writes; or (None, note) when the
    mapping uses an operation mfsdp does not mirror. Only stacking along a new first dimension and
    concatenating along the next (transformers' MergeModulelist(dim=0) + Concatenate(dim=1)) is
    mirrored: each piece is then one contiguous run of the parameter's elements."""
    try:
        from transformers import conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
        # What from_pretrained and save_pretrained apply: the mapping of every PreTrainedModel inside
        # (dots3's text model finds its experts' layout under its inner model's type), not only the
        # root class's; legacy renames (old checkpoints' names, never written back) left out.
        if hasattr(conversion_mapping, "get_model_conversion_mapping"):
            transforms = conversion_mapping.get_model_conversion_mapping(model, add_legacy=False) or []
        else:
            transforms = conversion_mapping.extract_weight_conversions_for_model(model) or []
    except Exception as e:  # another transformers: none of it is used then
        return None, f"transformers' checkpoint conversion mapping not read ({type(e).__name__}: {e})"
    if not transforms:
        return None, None
    renames, save_renames, converters, concats = [], [], [], []
    for t in transforms:
        if getattr(t, "scope_prefix", None):
            return None, (f"the HF checkpoint layout of {model.config.model_type} converts names under "
                          f"{t.scope_prefix!r} only, which mfsdp does not mirror: model.init_from reads directories "
                          "saved in the model's own names only")
        src, dst = list(t._original_source_patterns), list(t._original_target_patterns)
        if type(t) is WeightRenaming and len(dst) == 1:
            for pat in src:
                literal = pat.replace("\\.", ".")
                if not re.fullmatch(r"[A-Za-z0-9_.]+", literal) or not re.fullmatch(r"[A-Za-z0-9_.]+", dst[0]):
                    return None, (f"the HF checkpoint layout of {model.config.model_type} renames by the pattern {pat!r}, "
                                  "which mfsdp does not mirror: model.init_from reads directories saved in the "
                                  "model's own names only")
                renames.append([pat, dst[0]])
                save_renames.append([re.escape(dst[0]), literal])  # back to the files' names, for export
            continue
        ops = list(getattr(t, "operations", []))
        kinds = [(type(o), getattr(o, "dim", None)) for o in ops]
        if (type(t) is WeightConverter and len(dst) == 1 and all(p.count("*") == 1 for p in src)
                and kinds in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)])
                and (len(src) == 1) == (len(kinds) == 1)):
            converters.append((src, dst[0]))
            continue
        # Literally named pieces concatenated along the first dimension (OLMo-Hybrid's q/k/v
        # convolutions saved apart, held as one conv1d). transformers saves them back as torch.chunk
        # cuts them (Concatenate's reverse is Chunk): contiguous runs, all but the last of equal size.
        if (type(t) is WeightConverter and len(dst) == 1 and kinds == [(Concatenate, 0)] and len(src) > 1
                and all(re.fullmatch(r"[A-Za-z0-9_.]+", p.replace("\\.", ".")) for p in src + dst)):
            concats.append(([p.replace("\\.", ".") for p in src], dst[0].replace("\\.", ".")))
            continue
        return None, (f"the HF checkpoint layout of {model.config.model_type} ({type(t).__name__} "
                      f"{src} -> {dst}: {', '.join(type(o).__name__ for o in ops) or 'no operations'}) is not "
                      "mirrored by mfsdp: model.init_from reads directories saved in the model's own names only")
    stacks, concat_dim0 = {}, []
    for name, p in model.named_parameters():
        for src, dst in converters:
            if name.endswith(dst):
                prefix = name[: len(name) - len(dst)]
                stacks[name] = [prefix + pat.replace("*", str(e)) for e in range(p.shape[0]) for pat in src]
        for src, dst in concats:
            rows = -(-p.shape[0] // len(src))  # torch.chunk's cut, which transformers saves by
            if name.endswith("." + dst) and p.shape[0] - rows * (len(src) - 1) > 0:
                prefix = name[: len(name) - len(dst)]
                stacks[name] = [prefix + pat for pat in src]
                concat_dim0.append(name)
    if not stacks and not renames:
        return None, None
    layout = {"renames": renames, "save_renames": save_renames, "stacks": stacks}
    if concat_dim0:
        layout["concat_dim0"] = concat_dim0
    return (layout,
            f"checkpoint layout from transformers' conversion mapping: {len(renames)} rename(s), {len(stacks)} "
            "stacked parameter(s) read from per-expert tensors by model.init_from")


class _TraceCtx:
    """A stand-in for an autograd Function's ctx while its forward is traced: what the forward saves
    for its backward is dropped (the trace's autograd differentiates the forward's own ops)."""
    needs_input_grad = ()

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


@contextlib.contextmanager
def inline_autograd_functions(used):
    """Within the block, Function.apply runs the Function's forward directly (recording its
    operations in a trace) and adds the Function's name to `used`."""
    from torch.autograd.function import Function, _SingleLevelFunction
    saved = Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        used.add(cls.__qualname__)
        if cls.setup_context is not _SingleLevelFunction.setup_context:  # forward without ctx
            return cls.forward(*args, **kwargs)
        return cls.forward(_TraceCtx(), *args, **kwargs)

    Function.apply = classmethod(apply)
    try:
        yield
    finally:
        Function.apply = saved


@contextlib.contextmanager
def traceable_scatter():
    """Within the block, Tensor.scatter with a Python bool value (DeepSeek V3.2's sparse-attention
    index mask: ones.scatter(-1, topk, False)), which torch.jit.trace cannot record (no aten::scatter
    overload takes a bool Scalar), scatters a tensor of that value shaped like the index instead:
    the same result, recorded as aten::scatter.src."""
    import torch
    saved = torch.Tensor.scatter

    def scatter(self, dim, index, src=None, **kwargs):
        if isinstance(src, bool) and not kwargs:
            src = (torch.ones_like if src else torch.zeros_like)(index, dtype=self.dtype)
        return saved(self, dim, index, src, **kwargs) if src is not None else saved(self, dim, index, **kwargs)

    torch.Tensor.scatter = scatter
    try:
        yield
    finally:
        torch.Tensor.scatter = saved


class _SizesFromTensor(list):
    """A list of ints that Tensor.tolist returned within traceable_split_sizes, with the tensor."""


@contextlib.contextmanager
def traceable_split_sizes():
    """Within the block, splitting a tensor by sizes that came from a 1-D integer tensor's tolist()
    (JetMoE's tokens per expert: gates.sum(0).tolist(), then inputs.split(expert_size)), which the
    trace would record as constants (the trace batch's counts, wrong for any other batch), splits
    at that tensor's running sums instead: aten::tensor_split with the indices as a traced value
    (moved to the CPU, where tensor_split reads them): the same pieces for every batch."""
    import torch
    saved_tolist, saved_split = torch.Tensor.tolist, torch.Tensor.split

    def tolist(self):
        out = saved_tolist(self)
        if isinstance(out, list) and self.dim() == 1 and not self.is_floating_point() and not self.is_complex():
            out = _SizesFromTensor(out)
            out.tensor = self
        return out

    def split(self, split_size, dim=0):
        if isinstance(split_size, _SizesFromTensor):
            return self.tensor_split(split_size.tensor.cumsum(0)[:-1].cpu(), dim)
        return saved_split(self, split_size, dim)

    torch.Tensor.tolist, torch.Tensor.split = tolist, split
    try:
        yield
    finally:
        torch.Tensor.tolist, torch.Tensor.split = saved_tolist, saved_split


@contextlib.contextmanager
def every_expert_loops(model):
    """Within the block, the experts modules that loop over the experts their tokens hit
    (`expert_hit = greater(expert_mask.sum(...), 0).nonzero()`, then `for expert_idx in expert_hit`:
    DBRX, LongCat-Flash; transformers' other families dispatch to grouped_mm, a trace of which
    holds no loop) see every expert as hit: a trace unrolls that loop once per expert the tracing
    batch happened to reach, and another batch reaching fewer fails (DBRX: "Expected 4 elements in a
    list but found 1") or reaching others loses them. The first num_experts entries of that
    comparison are true; the routing itself (which tokens each expert takes) stays traced, and an
    expert without tokens computes on none. A sentinel class past num_experts keeps its own test."""
    import inspect
    import torch
    saved, patched = torch.greater, []

    def looping(m):
        try:
            src = inspect.getsource(type(m).forward)
        except (OSError, TypeError):
            return False
        return "expert_hit" in src and ".nonzero(" in src and not hasattr(type(m), "_apply_gate")

    for m in model.modules():
        if not looping(m):
            continue
        n = getattr(m, "total_experts", None) or getattr(m, "num_experts", None)
        if not isinstance(n, int):
            continue
        original = m.forward

        def forward(*args, _n=n, _original=original, **kwargs):
            def greater(a, b, *rest, **kw):
                if isinstance(b, (int, float)) and b == 0 and not rest and not kw and a.dim() == 1 \
                        and not a.is_floating_point() and a.shape[0] >= _n:
                    return torch.cat([torch.ones_like(a[:_n], dtype=torch.bool), saved(a[_n:], b)])
                return saved(a, b, *rest, **kw)
            torch.greater = greater
            try:
                return _original(*args, **kwargs)
            finally:
                torch.greater = saved
        m.forward = forward
        patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


def check_inlined_gradients(model, traced, tokens, pos, used):
    """The traced model's parameter gradients (autograd through the inlined forwards) against the
    HF model's (the Functions' own backwards), on the trace batch; exits naming the Functions."""
    import torch
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(fn):
        for p in params:
            p.grad = None
        torch.manual_seed(11)  # dropout traced in training: the same masks for both
        fn(tokens, pos).float().square().mean().backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    ref = grads(model)
    got = grads(traced)
    worst = max(((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for g, r in zip(got, ref))
    for p in params:
        p.grad = None
    if worst > 1e-4:
        sys.exit(f"export_hf: {', '.join(sorted(used))}: custom autograd Function(s) whose backward is not "
                 f"their forward's derivative (traced gradients differ from the model's by {worst:.2e} "
                 "relative): TorchScript cannot hold them; export the model by hand (README \"Model contract\")")
    return worst


def attention_window(cfg):
    """What of the config restricts attention below the whole causal sequence, for mfsdp's context
    parallelism (which replaces each sdpa call by causal attention over the whole sequence): the
    shortest sliding window or attention chunk of any layer, or size 0 for layers whose sequence
    mixing is no softmax attention (Qwen3-Next's linear attention). None when every layer attends
    causally to the whole sequence."""
    types_ = getattr(cfg, "layer_types", None)
    found = []  # (size, layers, source)
    if types_:
        for kind in sorted(set(types_) - {"full_attention"}):
            idx = [i for i, t in enumerate(types_) if t == kind]
            layers = f"layers {', '.join(map(str, idx[:6]))}{', ...' if len(idx) > 6 else ''}"
            if kind == "sliding_attention" and getattr(cfg, "sliding_window", None):
                found.append((int(cfg.sliding_window), layers, f"layer_types {kind}, sliding_window {cfg.sliding_window}"))
            elif kind == "chunked_attention" and getattr(cfg, "attention_chunk_size", None):
                found.append((int(cfg.attention_chunk_size), layers,
                              f"layer_types {kind}, attention_chunk_size {cfg.attention_chunk_size}"))
            else:
                found.append((0, layers, f"layer_types {kind}"))
    else:
        sw = getattr(cfg, "sliding_window", None)
        if sw and getattr(cfg, "use_sliding_window", True) is not False:
            found.append((int(sw), "every layer", f"sliding_window {sw}"))
        chunk = getattr(cfg, "attention_chunk_size", None)
        if chunk:
            found.append((int(chunk), "every layer", f"attention_chunk_size {chunk}"))
        kinds = getattr(cfg, "attention_layers", None)  # GPT-Neo: global / local per layer
        if kinds and "local" in kinds and getattr(cfg, "window_size", None):
            idx = [i for i, t in enumerate(kinds) if t == "local"]
            found.append((int(cfg.window_size), f"layers {', '.join(map(str, idx))}", f"attention_types local, "
                          f"window_size {cfg.window_size}"))
    if not found:
        return None
    size, layers, source = min(found, key=lambda f: f[0])
    return {"size": size, "layers": layers, "source": source}


def builtin_plan_refused(config):
    """Why a BUILTIN_TP_PLANS plan does not fit this config, or None."""
    if config.model_type == "stablelm" and getattr(config, "qk_layernorm", False):
        return "StableLM with qk_layernorm (per-head norms over all heads)"
    if config.model_type == "opt" and getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
        return "OPT with word_embed_proj_dim != hidden_size (project_in / project_out around the layers)"
    return None


def derive_tp_plan(model):
    """mfsdp's plan from the config's base_model_tp_plan (or BUILTIN_TP_PLANS); (plan or None, note)."""
    base_plan = getattr(model.config, "base_model_tp_plan", None) or {}
    builtin = not base_plan and model.config.model_type in BUILTIN_TP_PLANS
    if builtin:
        refused = builtin_plan_refused(model.config)
        if refused:
            return None, f"mfsdp's plan for {model.config.model_type} does not fit {refused}: no tensor-parallel plan stored"
        base_plan = BUILTIN_TP_PLANS[model.config.model_type]
    if not base_plan:
        return None, f"{type(model.config).__name__} has no base_model_tp_plan: no tensor-parallel plan stored"
    prefix = model.base_model_prefix
    names = [n for n, _ in model.named_modules()]
    supplement = PLAN_SUPPLEMENTS.get(model.config.model_type, {}) if not builtin else {}
    planned = dict(base_plan)
    for key, style in supplement.items():
        parent = key.rsplit(".", 1)[0]
        if (not any(k == parent or k.startswith(parent + ".") for k in planned)
                and any(glob_re(f"{prefix}.{key}").fullmatch(n) for n in names)):
            base_plan = {**base_plan, key: style}
    plan = {}
    # Mixture-of-experts modules (HF's moe_tp_experts): the 3-D expert weights under it
    # (packed_colwise gate_up_proj, rowwise down_proj) are mfsdp's moe_experts on the module.
    experts = {key for key, style in base_plan.items() if style == "moe_tp_experts"}
    for key, style in base_plan.items():
        if builtin:
            plan[f"{prefix}.{key}"] = style
            continue
        if key in experts:
            plan[f"{prefix}.{key}"] = "moe_experts"
            continue
        parent = key.rsplit(".", 1)[0]
        if parent in experts:
            if (key.rsplit(".", 1)[1], style) not in MOE_EXPERT_WEIGHTS:
                return None, (f"base_model_tp_plan entry {key}: {style} inside the experts module {parent} is not "
                              f"one mfsdp's moe_experts applies ({', '.join(f'{n}: {s}' for n, s in MOE_EXPERT_WEIGHTS)}): "
                              "no tensor-parallel plan stored; give distributed.tp_plan")
            continue
        if style not in KEPT_STYLES:
            return None, (f"base_model_tp_plan entry {key}: {style} is not a style mfsdp applies (it keeps "
                          f"{', '.join(KEPT_STYLES)}): no tensor-parallel plan stored; give distributed.tp_plan")
        plan[f"{prefix}.{key}"] = KEPT_STYLES[style]
    # A config's plan may name modules this config does not build: an MoE plan names the dense
    # MLP's projections (Qwen2-MoE's gate_proj, for layers in mlp_only_layers), Doge's names its
    # MoE router and expert embeddings when the config is dense. Such entries are left out, as
    # transformers leaves them (mfsdp refuses a stored entry that matches nothing).
    for k in [k for k in plan if not any(glob_re(k).fullmatch(n) for n in names)]:
        del plan[k]
    # Sequence parallelism (distributed.sequence_parallel): HF attention reads the sequence length
    # from its input, so each block holding colwise/rowwise layers (attention, MLP) works on the
    # gathered sequence (sequence_gathered), and the norms between them on this rank's part of it
    # (sequence_parallel: their gradients summed over TP). Without sequence parallelism both are no-ops.
    blocks = {key.rsplit(".", 1)[0] for key, style in base_plan.items()
              if style.split(":")[0] in ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")
              and "." in key and key.rsplit(".", 1)[0] not in experts and (builtin or f"{prefix}.{key}" in plan)}
    # A block that holds another (OPT's decoder layer, parent of fc1 and fc2, holds its attention)
    # is not one: its input would be gathered twice and its middle rowwise layer would scatter it.
    blocks = {b for b in blocks if not any(o.startswith(b + ".") for o in blocks)}
    # Nor is one whose glob also matches a module holding experts (EXAONE-MoE's mlp.gate_proj
    # names the dense MLP of its first layers; the same layers.*.mlp is the MoE block further on,
    # whose experts' call gathers its own tokens): the dense MLPs work token by token, their
    # colwise layers copying their input themselves.
    blocks = {b for b in blocks if not any(e.startswith(b + ".") for e in experts)}
    for blk in sorted(blocks):
        plan.setdefault(f"{prefix}.{blk}", "sequence_gathered")
    # A block whose output the split changes keeps its layers whole (split_changes_output); it is
    # then an unplanned module of the layers, sequence_parallel or sequence_whole below.
    unfaithful = split_changes_output(model, plan, [f"{prefix}.{b}" for b in blocks]) if blocks else {}
    for glob in unfaithful:
        for k in [k for k in plan if k == glob or k.startswith(glob + ".")]:
            del plan[k]
        blocks.discard(glob[len(prefix) + 1:])
    # A block's glob may match a module of another kind in some layers (MiniMax's self_attn: softmax
    # attention with split q/k/v/o in some layers, linear attention with nothing split in others).
    # Gathered without a rowwise output, such a module would hand its whole output on, its input
    # gradient summed over TP once too often (measured: 1e-3 off PyTorch). Each gets an entry of its
    # own, ahead of the glob: sequence_whole, or sequence_parallel where it works token by token.
    splits = ("colwise", "colwise_rep", "rowwise", "rowwise_rep")
    split_names = [m for m in names if any(glob_re(k).fullmatch(m) for k, st in plan.items() if st.split(":")[0] in splits)]
    odd = [m for m in names for b in blocks
           if glob_re(f"{prefix}.{b}").fullmatch(m) and not any(x.startswith(m + ".") for x in split_names)]
    front = {}
    if odd:
        by_token = token_wise(model, odd)
        front = {m: "sequence_parallel" if by_token.get(m) else "sequence_whole" for m in odd}
    # A replicated module with parameters inside such a block may see only this rank's share of its
    # gradient: the block's colwise layers leave their input gradients partial (the block's input
    # takes the one reduction), and so do heads split by a colwise layer. mfsdp refuses an
    # unmarked one; the mark follows from the split layer the forward called last before it:
    #   none (it feeds the split layers: DeepSeek's q_a_proj and its norm), or colwise (it works on
    #   this rank's heads): replicated_with_grad_allreduce, summed over TP;
    #   colwise_rep (it works on a gathered, whole output: OLMoE's q/k norms over all heads, up to a
    #   rowwise_rep layer, whose split input's gradient is gathered whole): replicate, no sum;
    #   rowwise / rowwise_rep (after the block's output reduction): sequence_parallel, summed under
    #   sequence parallelism, where that output is split along the sequence.
    # A block with colwise_rep layers and no rowwise one returns a gathered output (Qwen3-Next's
    # linear attention: in_proj_qkvz, in_proj_ba and out_proj each colwise_gather_output, with a
    # convolution, decay parameters and a norm between them). HF all-reduces each such layer's input
    # gradient; mfsdp's one reduction per block leaves the code between them partial, and the
    # gather's backward (this rank's slice) would drop the other ranks' shares: measured 1.7e-3 off
    # PyTorch. Such a block stays replicated (its entries dropped): each TP rank runs it whole,
    # exact without SP; under SP mfsdp refuses it, naming its parameters.
    gathered = [f"{prefix}.{b}" for b in blocks]

    def unstyled(blocks_, itself):  # globs of modules with parameters of their own inside blocks_, no style
        found = []
        for name, mod in model.named_modules():
            glob = re.sub(r"\.\d+\.", ".*.", name)
            if (any(glob.startswith(b + ".") or (itself and glob == b) for b in blocks_)
                    and any(True for _ in mod.parameters(recurse=False))
                    and not any(glob == p or glob.startswith(p + ".") for p, st in plan.items()
                                if st != "sequence_gathered")
                    and glob not in found):
                found.append(glob)
        return found
    kept_whole = []
    for blk in list(gathered):
        inside = [p for p in plan if p.startswith(blk + ".")]
        kinds = {plan[p].split(":")[0] for p in inside}
        if "colwise_rep" in kinds and not kinds & {"rowwise", "rowwise_rep"} and unstyled([blk], itself=True):
            for p in inside:
                del plan[p]
            plan[blk] = "sequence_whole"
            gathered.remove(blk)
            kept_whole.append(blk)
    inner = unstyled(gathered, itself=False)
    if inner:
        order = call_order(model, gathered)
        for glob in inner:
            if glob not in order:
                continue  # never called (its parameters used otherwise): mfsdp asks, naming them
            blk = next(b for b in gathered if glob.startswith(b + "."))
            before = sorted((order[p], plan[p].split(":")[0]) for p in plan
                            if p.startswith(blk + ".") and p in order and order[p] < order[glob]
                            and plan[p].split(":")[0] in ("colwise", "colwise_rep", "rowwise", "rowwise_rep"))
            last = before[-1][1] if before else None
            plan[glob] = {None: "replicated_with_grad_allreduce", "colwise": "replicated_with_grad_allreduce",
                          "colwise_rep": "replicate"}.get(last, "sequence_parallel")
    # What the plan leaves unsplit in the layers (an attention the config does not plan: DiffLlama,
    # HunYuan, gpt-oss with its sinks; an MLP without entries) runs replicated on every TP rank.
    # Under sequence parallelism its input is this rank's part of the sequence: a module that works
    # token by token may keep it (sequence_parallel: its gradients summed over TP), one that mixes
    # positions (attention, a convolution) needs the whole sequence (sequence_whole: gathered at
    # its input, cut back at its output). Which is which is measured (token_wise).
    whole, unsplit = [], unplanned_layer_modules(model, plan, prefix)
    if unsplit:
        by_token = token_wise(model, unsplit)
        for glob in unsplit:
            plan[glob] = "sequence_parallel" if by_token.get(glob) else "sequence_whole"
            if plan[glob] == "sequence_whole":
                whole.append(glob)
    # The router beside an experts module (and a shared expert, and its gate, where the config's
    # plan leaves them replicated) runs on this rank's tokens: under sequence parallelism their
    # gradients are partial, summed over TP.
    moe_blocks = {f"{prefix}.{e.rsplit('.', 1)[0]}" for e in experts if "." in e}
    for name, mod in model.named_modules():
        glob = re.sub(r"\.\d+\.", ".*.", name)
        if (any(glob.startswith(b + ".") for b in moe_blocks)
                and any(True for _ in mod.parameters(recurse=False))
                and not any(glob == p or glob.startswith(p + ".") for p in plan)):
            plan[glob] = "sequence_parallel"
    for name, mod in model.named_modules():
        if not is_norm(mod) or not any(True for _ in mod.parameters(recurse=False)):
            continue
        glob = re.sub(r"\.\d+\.", ".*.", name)
        if glob in plan or any(glob.startswith(p + ".") for p in plan):
            continue  # inside a gathered block (Qwen3's q/k norms keep their own style)
        plan[glob] = "sequence_parallel"
    # A layer's own parameters beside its styled submodules (Dory's lambda_1 and lambda_2: per-channel
    # rates mixing the residual stream with the attention's and the MLP's outputs) work on the
    # residual stream, this rank's part of the sequence under SP: sequence_parallel, for the
    # parameter alone (a style on the layer would reach every parameter below it).
    keys = [glob_re(k) for k in plan]
    for name, p in model.named_parameters():
        if not p.requires_grad or not name.startswith(prefix + "."):
            continue
        parts = name.split(".")
        owners = [".".join(parts[:i]) for i in range(1, len(parts))]
        glob = re.sub(r"\.\d+\.", ".*.", name)
        if "*" in glob and glob not in plan and not any(r.fullmatch(o) for r in keys for o in owners):
            plan[glob] = "sequence_parallel"
    base = getattr(model, prefix)

    def trained_copy(m):  # PEFT's modules_to_save wrapper: the copy its forward calls
        return m.modules_to_save["default"] if hasattr(m, "modules_to_save") and hasattr(m, "original_module") else m
    emb = trained_copy(base.get_input_embeddings())
    emb_name = next(n for n, m in model.named_modules() if m is emb)
    plan[emb_name] = "vocab_parallel"
    head = trained_copy(model.get_output_embeddings())
    # A plain Linear head only: one that does more with its logits (Dory's learned per-token logit
    # scale, a parameter of the vocabulary's size) would meet them split over the vocabulary.
    linear = __import__("torch").nn.Linear
    if head is not None and isinstance(head, linear) and type(head).forward is linear.forward:
        head_name = next(n for n, m in model.named_modules() if m is head)
        plan[head_name] = "colwise"  # logits sharded over the vocabulary: vocab-parallel cross entropy
    elif head is not None and any(True for _ in head.parameters()):
        # Kept whole on every TP rank: under sequence parallelism its input is gathered and it
        # returns the whole sequence's logits (its gradients whole, no sum).
        plan[next(n for n, m in model.named_modules() if m is head)] = "sequence_whole"
    plan = {**front, **plan}  # first matching entry wins: the odd layers' own entries first
    origin = f"mfsdp's plan for {model.config.model_type}" if builtin else f"{type(model.config).__name__}.base_model_tp_plan"
    if len(base_plan) > len(planned):
        origin += f" and mfsdp's entries for its attention ({len(base_plan) - len(planned)}, PLAN_SUPPLEMENTS)"
    if kept_whole:
        origin += (f"; {', '.join(kept_whole)} kept whole on every TP rank (replicated code with parameters between "
                   "colwise_gather_output layers; sequence_whole)")
    if unfaithful:
        origin += "; " + ", ".join(f"{g} kept unsplit (its output under the split differs by {d:.1e}: it reduces over "
                                   "the split features)" for g, d in sorted(unfaithful.items()))
    whole += [m for m, st in front.items() if st == "sequence_whole"]
    if whole:
        origin += f"; {', '.join(whole)} unsplit, mixing positions: whole on every TP rank (sequence_whole)"
    return plan, f"tensor-parallel plan from {origin} ({len(plan)} entries)"


def wrap_lora(model, args):
    """The model wrapped by PEFT (a new LoRA adapter, or --adapter-dir's, trainable); returns it and
    the adapter_config.json PEFT would write (through save_pretrained: its own format)."""
    import tempfile
    import torch
    try:
        import peft
    except ImportError:
        sys.exit("export_hf: LoRA needs peft (scripts/setup.sh installs it into .venv)")
    if args.adapter_dir:
        if not os.path.exists(os.path.join(args.adapter_dir, "adapter_config.json")):
            sys.exit(f"export_hf: --adapter-dir {args.adapter_dir}: no adapter_config.json")
        wrapped = peft.PeftModel.from_pretrained(model, args.adapter_dir, is_trainable=True)
        pc = wrapped.peft_config["default"]
        if getattr(pc, "peft_type", None) != peft.PeftType.LORA:
            sys.exit(f"export_hf: --adapter-dir {args.adapter_dir}: a {pc.peft_type} adapter; only LoRA is supported")
    else:
        kw = {"r": args.lora_r, "lora_dropout": args.lora_dropout or 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
        if args.lora_dora:
            kw["use_dora"] = True
        if args.lora_alpha is not None:
            kw["lora_alpha"] = args.lora_alpha
        if args.lora_targets:
            kw["target_modules"] = args.lora_targets
        if args.lora_modules_to_save:
            kw["modules_to_save"] = args.lora_modules_to_save
        for opt, items, key, conv in (("--lora-rank-pattern", args.lora_rank_pattern, "rank_pattern", int),
                                      ("--lora-alpha-pattern", args.lora_alpha_pattern, "alpha_pattern", float)):
            if not items:
                continue
            pattern = {}
            for item in items:
                k, eq, v = item.rpartition("=")
                try:
                    pattern[k] = conv(v)
                    re.compile(k)
                except (ValueError, re.error):
                    sys.exit(f"export_hf: {opt} {item}: expected REGEX={'R (an integer)' if conv is int else 'ALPHA'}")
                if not eq or not k or pattern[k] <= 0:
                    sys.exit(f"export_hf: {opt} {item}: expected REGEX=VALUE with a positive value")
            kw[key] = pattern
        try:
            wrapped = peft.get_peft_model(model, peft.LoraConfig(**kw))
        except ValueError as e:
            sys.exit(f"export_hf: LoRA: {e}")
        pc = wrapped.peft_config["default"]
    if pc.lora_dropout and (args.dropout == "config" or args.lora_dropout):
        print(f"export_hf: lora_dropout {pc.lora_dropout} kept (active in training)", file=sys.stderr)
    elif pc.lora_dropout:
        print(f"export_hf: lora_dropout {pc.lora_dropout} -> 0 (--dropout config keeps it)", file=sys.stderr)
        pc.lora_dropout = 0.0
        for m in wrapped.modules():
            if isinstance(getattr(m, "lora_dropout", None), torch.nn.ModuleDict):
                for k in m.lora_dropout:
                    m.lora_dropout[k] = torch.nn.Identity()
    with tempfile.TemporaryDirectory() as d:
        wrapped.peft_config["default"].save_pretrained(d)
        with open(os.path.join(d, "adapter_config.json")) as f:
            adapter_config = json.load(f)
    return wrapped, adapter_config


def glob_re(glob):
    """mfsdp's plan globs: * any run of characters (dots too)."""
    return re.compile("".join(".*" if c == "*" else re.escape(c) for c in glob))


def peft_tp_plan(plan, wrapped):
    """The transformers model's plan on the PeftModel's names; (plan or None, note). An adapted
    colwise layer: base_layer colwise, lora_B colwise (its output split like the base's), lora_A
    replicated with its gradient summed over TP (each rank back-propagates through its slice of
    lora_B only); its input gradient is partial, like the base layer's, and both are summed by the
    sequence_gathered block's one reduction, so the layer must sit in such a block. An adapted
    rowwise layer: base_layer rowwise, lora_A rowwise (input features split, output reduced),
    lora_B replicated (sequence_parallel: with SP it sees this rank's part of the sequence)."""
    lora = {n for n, m in wrapped.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}
    saved = {n for n, m in wrapped.named_modules() if hasattr(m, "modules_to_save") and hasattr(m, "original_module")}
    names = [n for n, _ in wrapped.named_modules()]
    blocks = ["base_model.model." + k for k, v in plan.items() if v == "sequence_gathered"]
    out = {}
    for key, style in plan.items():
        pk = "base_model.model." + key
        rx = glob_re(pk)
        adapted = [n for n in lora if rx.fullmatch(n)]
        if any(rx.fullmatch(n) for n in saved):  # modules_to_save: the style goes to the trained copy
            out[pk + ".modules_to_save.default"] = style
            continue
        if not adapted:
            out[pk] = style
            continue
        if len(adapted) != sum(1 for n in names if rx.fullmatch(n)):
            return None, f"LoRA adapts some of the modules of plan entry {key}, not all: no tensor-parallel plan stored"
        if style == "colwise":
            if not all(any(glob_re(b + ".*").fullmatch(n) for b in blocks) for n in adapted):
                return None, f"LoRA on {key}, a colwise layer outside an attention or MLP block: no tensor-parallel plan stored"
            out[pk + ".base_layer"] = "colwise"
            out[pk + ".lora_A.*"] = "replicated_with_grad_allreduce"
            out[pk + ".lora_B.*"] = "colwise"
        elif style == "rowwise":
            out[pk + ".base_layer"] = "rowwise"
            out[pk + ".lora_A.*"] = "rowwise"
            out[pk + ".lora_B.*"] = "sequence_parallel"
        else:
            return None, f"LoRA on {key} ({style}): no tensor-parallel plan stored"
    return out, f"tensor-parallel plan of the transformers model on PEFT's names ({len(out)} entries)"


def build_config(args):
    """The config from --model-dir's config.json and --set, built in one go: derived defaults (head_dim
    from hidden_size / heads, ...) follow the given keys, as when transformers reads a config.json."""
    from transformers import AutoConfig, CONFIG_MAPPING

    keys = {}
    if args.model_dir:
        path = os.path.join(args.model_dir, "config.json")
        try:
            with open(path) as f:
                keys = json.load(f)
        except OSError as e:
            sys.exit(f"export_hf: --model-dir {args.model_dir}: cannot read config.json ({e.strerror})")
        except ValueError as e:
            sys.exit(f"export_hf: {path}: not valid JSON ({e})")
    family = args.family or keys.get("model_type")
    if not family:
        sys.exit("export_hf: give --model-dir DIR (its config.json names the model_type) or --family MODEL_TYPE")
    if family not in CONFIG_MAPPING:
        sys.exit(f"export_hf: model type '{family}' is not one transformers {__import__('transformers').__version__} "
                 f"knows (e.g. llama, qwen2, qwen3, mistral, gpt2, gemma, phi3)")
    known = CONFIG_MAPPING[family]().to_dict()
    for item in args.set or []:
        if "=" not in item:
            sys.exit(f"export_hf: --set {item}: expected key=value")
        k, v = item.split("=", 1)
        if k not in known and k not in keys and not args.allow_new_keys:
            sys.exit(f"export_hf: --set {k}: {CONFIG_MAPPING[family].__name__} has no key {k} (--allow-new-keys to add one)")
        keys[k] = parse_value(v)
    keys.pop("model_type", None)
    for k in ("transformers_version", "architectures", "_name_or_path"):
        keys.pop(k, None)
    cfg = AutoConfig.for_model(family, **keys)
    notes = []
    for k in dropout_keys(cfg):
        v = getattr(cfg, k)
        if args.dropout == "config":
            notes.append(f"{k} {v} kept (--dropout config: active in training)")
        else:
            setattr(cfg, k, 0.0)
            notes.append(f"{k} {v} -> 0 (--dropout config keeps it)")
    vocab = getattr(cfg, "vocab_size", None)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(cfg, k, None)
        if vocab and isinstance(v, int) and not 0 <= v < vocab:
            setattr(cfg, k, None)
            notes.append(f"{k} {v} outside the vocabulary ({vocab}) -> None")
    cfg.use_cache = False
    return cfg, notes


def samples_in_training(model):
    """What a training-mode forward draws random numbers with, once the dropouts are 0 (the
    generator's state moves): the modules whose own forward moves it, or '' if none."""
    import torch
    moved, hooks, state = [], [], {}
    for name, mod in model.named_modules():
        def pre(m, args, name=name):
            state[name] = torch.get_rng_state()

        def post(m, args, out, name=name):
            if name in state and not torch.equal(state.pop(name), torch.get_rng_state()):
                moved.append(name)
        hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    was = model.training
    try:
        model.train()
        hooked_forward(model, hooks, 8)
    finally:
        model.train(was)
    # the innermost modules that drew (a module whose child drew moved too)
    inner = [m for m in moved if m and not any(o.startswith(m + ".") for o in moved)]
    return ", ".join(sorted({re.sub(r"\.\d+\.", ".*.", m) for m in inner})[:4])


def dropout_keys(cfg):
    """The config's dropout probabilities that are not 0 (keys naming dropout, or GPT-2's *_pdrop)."""
    return sorted(k for k, v in cfg.to_dict().items() if ("dropout" in k or k.endswith("pdrop"))
                  and isinstance(v, (int, float)) and not isinstance(v, bool) and v)


ATTENTION_OP_NAME = "mfsdp_eager"


def use_attention_op(model, training=False):
    """Eager attention through one operator, mfsdp::attention (scripts/mfsdp_ops.py), so that the
    trace has a node mfsdp's context parallelism can replace (it replaces sdpa calls; eager
    attention is otherwise loose matmuls). transformers picks a layer's attention function by
    config._attn_implementation from its AttentionInterface: the exporter registers one that calls
    the operator, and the eager mask builder under the same name (the additive mask eager attention
    adds). GPT-Neo's attention is a method of its own (_attn: unscaled scores, its causal or local
    window buffer): each layer's _attn is replaced by one calling the operator with scale 1 and
    that window as an additive mask. Used only if the model's logits then equal its eager logits
    exactly on a test batch (a family whose attention is other code, BLOOM's ALiBi, never calls the
    operator; one whose eager attention computes more, say attention sinks, is refused by the
    function). `training`: the check runs in training mode (dropout kept), both calls from the same
    generator state. Returns the operator's name, or None with the model left as it was (printed)."""
    import torch
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mfsdp_ops
    calls = []

    def attention_fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
        if dropout:
            raise NotImplementedError(f"attention dropout {dropout}")
        ignored = {"sliding_window", "is_causal", "position_ids"}  # the mask carries the window
        extra = sorted(k for k, v in kwargs.items() if v is not None and k not in ignored)
        if extra:
            raise NotImplementedError(f"eager attention with {', '.join(extra)}")
        if scaling is None:
            scaling = module.head_dim ** -0.5
        if attention_mask is not None:
            attention_mask = attention_mask[:, :, :, : key.shape[-2]]
        calls.append(1)
        out = mfsdp_ops.attention(query, key, value, attention_mask, scaling, softcap)
        return out.transpose(1, 2).contiguous(), None

    def gpt_neo_attn(self, query, key, value, attention_mask=None):
        # GPTNeoSelfAttention._attn: q and k in fp32, no scale, the window buffer as min-valued
        # scores (here an additive mask of 0 and min: the same softmax), then the given mask.
        query, key = query.to(torch.float32), key.to(torch.float32)
        ql, kl = query.size(-2), key.size(-2)
        window = self.bias[:, :, kl - ql: kl, :kl]
        low = torch.finfo(torch.float32).min
        mask = torch.zeros(window.shape, dtype=torch.float32, device=query.device).masked_fill(~window, low)
        if attention_mask is not None:
            mask = mask + attention_mask
        if self.attn_dropout.p:
            raise NotImplementedError(f"attention dropout {self.attn_dropout.p}")
        calls.append(1)
        return mfsdp_ops.attention(query, key, value.to(torch.float32), mask, 1.0, None).to(value.dtype), None

    AttentionInterface.register(ATTENTION_OP_NAME, attention_fn)
    masking_utils.AttentionMaskInterface.register(ATTENTION_OP_NAME, masking_utils.eager_mask)
    patched = [m for m in model.modules() if type(m).__name__ == "GPTNeoSelfAttention" and hasattr(m, "_attn")]
    for m in patched:
        m._attn = types.MethodType(gpt_neo_attn, m)
    cfg = model.config
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    why = None
    model.train(training)
    with torch.no_grad():
        torch.manual_seed(3)
        want = model(input_ids=tokens, use_cache=False).logits
        cfg._attn_implementation = ATTENTION_OP_NAME
        try:
            torch.manual_seed(3)
            got = model(input_ids=tokens, use_cache=False).logits
            if not calls:
                why = "its attention does not go through transformers' attention functions"
            elif not torch.equal(want, got):
                why = f"its logits through the operator differ from eager's by {(want - got).abs().max().item():.1e}"
        except NotImplementedError as e:
            why = str(e)
    model.eval()
    if why is None:
        print("export_hf: eager attention as one operator, mfsdp::attention (scripts/mfsdp_ops.py; logits "
              "equal to eager's), which context parallelism can replace", file=sys.stderr)
        return "mfsdp::attention"
    cfg._attn_implementation = "eager"
    for m in patched:
        del m._attn
    print(f"export_hf: eager attention traced as it is ({why}): context parallelism, which replaces "
          "sdpa calls and mfsdp::attention, is unavailable for this file", file=sys.stderr)
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="a local HF model directory (config.json; weights unless --random-init)")
    ap.add_argument("--family", help="a transformers model_type (llama, qwen2, qwen3, mistral, gpt2, gemma, ...)")
    ap.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="config keys (over --model-dir's config.json)")
    ap.add_argument("--allow-new-keys", action="store_true", help="--set may add keys the config class lacks")
    ap.add_argument("--random-init", action="store_true", help="with --model-dir: the family's initialisation")
    ap.add_argument("--attention", choices=["auto", "sdpa", "eager", "eager_traced"], default="auto",
                    help="attention implementation (HF's attn_implementation); auto (default): sdpa where the "
                         "family supports it (context parallelism replaces its calls), else eager, printed; "
                         "eager_traced: eager attention traced as its ops, without the mfsdp::attention operator "
                         "(the file loads in PyTorch without scripts/mfsdp_ops.py; no context parallelism)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the weights in the file")
    ap.add_argument("--tp-plan", choices=["auto", "none"], default="auto",
                    help="auto: derived from the config's base_model_tp_plan; none: store no plan")
    ap.add_argument("--trace-len", type=int, default=16, help="sequence length of the tracing batch")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--state-dict", help="also torch.save the initial state_dict here")
    ap.add_argument("--lora-r", type=int, help="wrap the model with a PEFT LoRA adapter of this rank")
    ap.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: PEFT's, 8)")
    ap.add_argument("--lora-targets", nargs="+", metavar="MODULE",
                    help="module names to adapt (default: PEFT's choice for the family, e.g. q_proj v_proj)")
    ap.add_argument("--lora-rank-pattern", nargs="+", metavar="REGEX=R",
                    help="per-module ranks (PEFT's rank_pattern: the first regex matching the end of a module's name)")
    ap.add_argument("--lora-alpha-pattern", nargs="+", metavar="REGEX=ALPHA",
                    help="per-module alphas (PEFT's alpha_pattern)")
    ap.add_argument("--lora-modules-to-save", nargs="+", metavar="MODULE",
                    help="modules trained in full beside the adapters (PEFT's modules_to_save, e.g. lm_head)")
    ap.add_argument("--lora-dora", action="store_true",
                    help="DoRA (PEFT's use_dora): a trained magnitude per output row beside lora_A and lora_B")
    ap.add_argument("--lora-dropout", type=float, help="a new adapter's lora_dropout (PEFT's; active in training)")
    ap.add_argument("--adapter-dir", help="an existing PEFT adapter directory to train on (adapter_config.json)")
    ap.add_argument("--dropout", choices=["zero", "config"], default="zero",
                    help="zero (default): every dropout probability of the config (and an adapter's lora_dropout) "
                         "set to 0; config: kept, traced in training mode (mfsdp turns them off in evaluation)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.adapter_dir and args.lora_r:
        sys.exit("export_hf: --adapter-dir brings its own LoRA config; give it or --lora-r, not both")
    if (args.lora_alpha is not None or args.lora_targets or args.lora_rank_pattern or args.lora_alpha_pattern
            or args.lora_modules_to_save or args.lora_dora or args.lora_dropout is not None) and not args.lora_r:
        sys.exit("export_hf: --lora-alpha, --lora-targets, --lora-rank-pattern, --lora-alpha-pattern, "
                 "--lora-modules-to-save, --lora-dora and --lora-dropout need --lora-r")
    if args.lora_dropout is not None and not 0 <= args.lora_dropout < 1:
        sys.exit(f"export_hf: --lora-dropout {args.lora_dropout}: expected a probability in [0, 1)")
    if args.lora_r is not None and args.lora_r < 1:
        sys.exit(f"export_hf: --lora-r {args.lora_r}: expected a rank >= 1")

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    cfg, notes = build_config(args)
    for n in notes:
        print(f"export_hf: {n}", file=sys.stderr)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    if args.model_dir and not args.random_init:
        has_weights = any(os.path.exists(os.path.join(args.model_dir, f)) for f in
                          ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                           "pytorch_model.bin.index.json"))
        if not has_weights:
            sys.exit(f"export_hf: {args.model_dir}: no weights (model.safetensors or its index); --random-init to "
                     "export the architecture alone")

    def build(attention):
        torch.manual_seed(args.seed)
        if args.model_dir and not args.random_init:
            return AutoModelForCausalLM.from_pretrained(args.model_dir, config=cfg, local_files_only=True,
                                                        dtype=torch.float32, attn_implementation=attention)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=attention, dtype=torch.float32)

    attention = args.attention
    if attention == "auto":
        try:
            model, attention = build("sdpa"), "sdpa"
        except ValueError as e:  # the family has no sdpa path (Gemma 2's logit soft-capping)
            if "scaled_dot_product_attention" not in str(e):
                raise
            print(f"export_hf: {cfg.model_type} does not support sdpa attention: eager attention",
                  file=sys.stderr)
            model, attention = build("eager"), "eager"
    elif attention == "eager_traced":
        model, attention = build("eager"), "eager"
        print("export_hf: eager attention traced as it is (--attention eager_traced): context parallelism, which "
              "replaces sdpa calls and mfsdp::attention, is unavailable for this file", file=sys.stderr)
    else:
        model = build(attention)
    model = model.eval()
    # Dropout kept (--dropout config): the trace is taken in training mode, which records it.
    kept = dropout_keys(cfg)
    training = args.dropout == "config" and bool(kept)
    sampling = samples_in_training(model)
    if sampling and not training:
        # The trace records the branches of one mode: traced in eval mode, a family that samples in
        # training (PhiMoE's sparsemixer routes by random draws) would train as it evaluates.
        training = True
        print(f"export_hf: {type(model).__name__} draws random numbers in training with its dropouts at 0 "
              f"({sampling}): traced in training mode, so mfsdp trains it as transformers does (mfsdp turns "
              "training mode off in evaluation)", file=sys.stderr)
    attention_op = use_attention_op(model, training) if attention == "eager" and args.attention != "eager_traced" else None
    hf_model = model
    adapter_config = None
    if args.lora_r or args.adapter_dir:
        model, adapter_config = wrap_lora(model, args)
    if adapter_config is not None and adapter_config.get("lora_dropout"):
        training = True
    if dtype != torch.float32:
        model = model.to(dtype)
    model.train(training)
    drops = kept if args.dropout == "config" else []
    if adapter_config and adapter_config.get("lora_dropout"):
        drops = drops + ["lora_dropout"]
    if training and drops:
        print(f"export_hf: traced in training mode: dropout {', '.join(drops)} "
              "active in training (mfsdp turns it off in evaluation)", file=sys.stderr)

    # The contract's forward on the HF instance itself, so that parameter names stay HF's.
    hf_forward = type(model).forward

    def contract_forward(self, tokens, position_ids):
        return hf_forward(self, input_ids=tokens, position_ids=position_ids, use_cache=False).logits

    model.forward = types.MethodType(contract_forward, model)
    V = cfg.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    T = args.trace_len
    tokens = torch.randint(0, V, (2, T), generator=g)
    pos = torch.arange(T).unsqueeze(0).expand(2, T).contiguous()
    inlined = set()
    with torch.no_grad(), inline_autograd_functions(inlined), traceable_scatter(), traceable_split_sizes(), \
            every_expert_loops(model):
        traced = torch.jit.trace(model, (tokens, pos), check_trace=False)
        # Another batch size and length than traced: a size the trace baked in shows here. With
        # dropout (training mode) both start from one generator state: the same masks.
        T2 = T + 8
        t2 = torch.randint(0, V, (3, T2), generator=g)
        p2 = torch.arange(T2).unsqueeze(0).expand(3, T2).contiguous()
        torch.manual_seed(args.seed + 1)
        want = model(t2, p2)
        torch.manual_seed(args.seed + 1)
        try:
            got = traced(t2, p2)
        except RuntimeError as e:  # a size the trace holds (JetMoE's tokens per expert) does not fit
            reason = str(e).strip().splitlines()[-1]
            sys.exit(f"export_hf: the trace of {type(model).__name__} does not run on another batch shape "
                     f"([3, {T2}] after tracing [2, {T}]): {reason}. This family computes with a size traced as a "
                     "constant (data-dependent shapes, such as tokens per expert); export it by hand (README "
                     "\"Model contract\")")
    if want.shape != got.shape or not torch.allclose(want.float(), got.float(), rtol=1e-4, atol=1e-5):
        diff = (want.float() - got.float()).abs().max().item() if want.shape == got.shape else "shapes differ"
        sys.exit(f"export_hf: the trace of {type(model).__name__} does not generalise to another batch shape "
                 f"(max difference {diff}): this family computes with a traced constant; export it by hand "
                 "(README \"Model contract\")")
    if inlined:
        worst = check_inlined_gradients(model, traced, tokens, pos, inlined)
        print(f"export_hf: custom autograd Function(s) {', '.join(sorted(inlined))} traced through their "
              f"forward; gradients equal the model's own backward within {worst:.1e} relative", file=sys.stderr)

    if args.tp_plan == "none":
        plan, note = None, "no tensor-parallel plan (--tp-plan none)"
    else:
        plan, note = derive_tp_plan(hf_model)
        if plan and adapter_config is not None and adapter_config.get("use_dora"):
            # DoRA normalises each output row of W + s B A over the whole input dimension, which a
            # rowwise split divides among the TP ranks (and PEFT forms B A through lora_B's forward).
            plan, note = None, "DoRA adapters: no tensor-parallel plan stored (train DoRA without TP)"
        elif plan and adapter_config is not None:
            plan, note = peft_tp_plan(plan, model)
    print(f"export_hf: {note}", file=sys.stderr)
    layout, layout_note = checkpoint_layout(hf_model)
    if layout_note:
        print(f"export_hf: {layout_note}", file=sys.stderr)
    hf_config = cfg.to_dict()
    hf_config["architectures"] = [type(hf_model).__name__]
    hf_config["torch_dtype"] = "float32" if dtype == torch.float32 else "bfloat16"
    extra = {
        "mfsdp/hf_config.json": json.dumps(hf_config, indent=1, sort_keys=True, default=str),
        "mfsdp/hf_export.json": json.dumps({
            "family": cfg.model_type, "class": type(hf_model).__name__, "attention": attention,
            "attention_op": attention_op,
            # dropout probabilities kept (--dropout config) and traced in training mode
            "dropout": {"mode": args.dropout, "traced_in_training": training},
            "tp_plan_note": None if plan else note,  # why no plan was stored (mfsdp's tp_size error quotes it)
            "dtype": "fp32" if dtype == torch.float32 else "bf16",  # mfsdp's model.compute_dtype must match
            "peft": adapter_config is not None,
            "transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
            "source": os.path.abspath(args.model_dir) if args.model_dir else None,
            "weights": "random" if (args.random_init or not args.model_dir) else "model directory",
            "attention_window": attention_window(cfg),
            # the config's head counts: mfsdp names those tp_size does not divide when a TP run's
            # first forward fails on a head view
            "head_counts": {k: v for c in (cfg, getattr(cfg, "text_config", None)) if c is not None
                            for k in HEAD_COUNTS if isinstance(v := getattr(c, k, None), int) and not isinstance(v, bool)},
            # and its position limits (a learned position table has that many rows): named when a
            # longer training.seq_length makes the first forward fail
            "max_positions": {k: v for c in (cfg, getattr(cfg, "text_config", None)) if c is not None
                              for k in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
                              if isinstance(v := getattr(c, k, None), int) and not isinstance(v, bool)},
            # the family's HF checkpoint names, where they differ from the model's (checkpoint_layout)
            "checkpoint_layout": layout,
            # what from_pretrained forgives a directory: a base model's names without the prefix
            # of the model with a head (GPT-2's hub checkpoint: h.0.attn..., not transformer.h.0...),
            # and tensors it ignores (GPT-2's causal-mask buffers attn.bias)
            **load_leniency(hf_model)}, indent=1),
    }
    if plan:
        extra["mfsdp/tp_plan.json"] = json.dumps(plan, indent=1)
    # The parameters the model trains: PEFT's adapters, and where a family keeps a parameter out of
    # training (AFMoE's router expert_bias, requires_grad False), every other one.
    if adapter_config is not None or not all(p.requires_grad for p in model.parameters()):
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        extra["mfsdp/trainable.json"] = json.dumps(trainable, indent=1)
    if adapter_config is not None:
        extra["mfsdp/adapter_config.json"] = json.dumps(adapter_config, indent=1, sort_keys=True)
    tmp = args.out + ".tmp"
    traced.save(tmp, _extra_files=extra)
    os.replace(tmp, args.out)
    if args.state_dict:
        torch.save(model.state_dict(), args.state_dict)
    n = sum(p.numel() for p in model.parameters())
    lora = ""
    if adapter_config is not None:
        k = sum(p.numel() for p in model.parameters() if p.requires_grad)
        lora = f", LoRA r={adapter_config['r']} on {', '.join(sorted(adapter_config['target_modules']))}: {k} trainable"
    print(f"wrote {args.out}: {type(hf_model).__name__} ({cfg.model_type}), {n} parameters{lora}, traced, "
          f"{'tp plan stored' if plan else 'no tp plan'}")


if __name__ == "__main__":
    main()
