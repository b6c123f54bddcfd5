#!/usr/bin/env python3
"""Tiny copies of Hugging Face configs, for trying a family with mfsdp in seconds
(scripts/hf_family_sweep.sh --configs DIR, or scripts/export_hf.py --model-dir DIR/NAME --random-init).

    hf_shrink_config.py OUT FAMILY...          # transformers' default config of each model_type
    hf_shrink_config.py OUT --from DIR...      # a model directory's config.json (every key kept)

writes OUT/NAME/config.json. Every key of the config is kept; the sizes are cut to the sweep's
(vocabulary 264, hidden 64, 2 layers, 4 heads, 2 key/value heads, head_dim 16, 4 experts of 32,
2 per token), per-layer lists (layer_types, mlp_layer_types, ...) cut to the first two layers, and
multi-head latent attention's dimensions made consistent (qk_head_dim = nope + rope, as many
key/value heads as heads). A family whose config ties other sizes together may need a key by hand
(export_hf.py --set KEY=VALUE, or edit the file): the export names what does not fit.
"""
import json
import os
import sys

SIZES = dict(vocab_size=264, hidden_size=64, n_embd=64, d_model=64, intermediate_size=128, ffn_dim=128, n_inner=128,
             num_hidden_layers=2, n_layer=2, num_layers=2, num_attention_heads=4, n_head=4, num_heads=4,
             num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=64,
             expert_intermediate_size=32, num_experts=4, n_routed_experts=4, num_local_experts=4,
             moe_num_experts=4, num_experts_per_tok=2, moe_topk=2, moe_k=2, top_k=2, n_group=2, topk_group=1,
             n_shared_experts=1, num_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, kv_channels=16, n_positions=128,
             hidden_size_per_layer_input=16, vocab_size_per_layer_input=264,
             index_head_dim=16, index_n_heads=2, index_topk=16, n_heads=4, n_layers=2, kv_n_heads=2,
             ffn_hidden_size=32, moe_top_k=2, num_dense_layers=1, laurel_rank=8, num_kv_shared_layers=0,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             router_hidden_size=32, shared_experts_intermediate_size=64, zero_expert_num=2, expert_ffn_hidden_size=32)
# Never raised above the config's own value: a family may allow only one expert per token (ZAYA,
# DBRX's 1), or no layer sharing its key/value cache.
AT_MOST = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k", "moe_top_k", "num_kv_shared_layers",
           "num_dense_layers", "first_k_dense_replace")
TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "unk_token_id",
              "decoder_start_token_id")
LAYERS_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
DROPPED = ("transformers_version", "architectures", "_name_or_path", "sub_configs", "auto_map")


def kept_layers(d, layers):
    """The two layers the cut keeps: the first, and the first of another type where the config's
    layer_types has more than one (OLMo-Hybrid's linear attention before its first full attention;
    a config needs at least one of each kind it names)."""
    types = d.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        other = next((i for i, t in enumerate(types) if t != types[0]), None)
        if other is not None:
            return [0, other]
    return [0, 1]


def shrink(d, top=True):
    layers = next((d[k] for k in LAYERS_KEYS if isinstance(d.get(k), int)), None)
    keep = kept_layers(d, layers)
    out = dict(d)
    for k, v in d.items():
        if k in SIZES and isinstance(v, int) and not isinstance(v, bool):
            out[k] = min(v, SIZES[k]) if k in AT_MOST else SIZES[k]
        elif isinstance(v, dict) and ("model_type" in v or k.endswith("_config")) and k != "per_layer_config":
            out[k] = shrink(v, top=False)  # a nested sub-config (DBRX's attn_config and ffn_config)
        elif k == "head_dim" and v is None and top:
            out[k] = SIZES[k]  # left to the model, which may not derive it (HunYuan dense reads it as is)
        elif k in TOKEN_KEYS and top:
            # A special token id past the cut vocabulary would index out of the embedding (its
            # padding row); the ids are kept small and distinct instead.
            out[k] = token_id(v, TOKEN_KEYS.index(k))
        elif k in ("num_experts", "n_routed_experts", "num_experts_per_tok", "n_shared_experts") and v is None \
                and any(x in d for x in ("moe_intermediate_size", "n_routed_experts")):
            out[k] = SIZES[k]  # an MoE config that leaves its expert counts unset (dots1)
        elif isinstance(v, list) and layers and len(v) == layers:
            out[k] = [SIZES[k] if k in SIZES and isinstance(v[i], int) else v[i] for i in keep]
    if d.get("num_key_value_heads") is not None and d.get("num_key_value_heads") == d.get("num_attention_heads"):
        out["num_key_value_heads"] = out["num_attention_heads"]  # multi-head attention stays so
    if out.get("qk_rope_head_dim") and "qk_nope_head_dim" in out:  # multi-head latent attention
        out.update(head_dim=out["qk_rope_head_dim"], qk_head_dim=out["qk_nope_head_dim"] + out["qk_rope_head_dim"],
                   num_key_value_heads=out.get("num_attention_heads", 4))
    if isinstance(out.get("per_layer_config"), dict):  # per-layer overrides by layer index
        if out.get("model_type") == "gemma4_text":  # its one override, on a layer the cut keeps
            out["per_layer_config"] = {"1": {"head_dim": 32}}
        else:  # the kept layers' overrides, renumbered, their sizes cut like the config's
            plc = {int(i): c for i, c in out["per_layer_config"].items() if str(i).isdigit()}
            out["per_layer_config"] = {str(n): shrink(plc[i], top=False) for n, i in enumerate(keep) if i in plc}
            for c in out["per_layer_config"].values():
                if "qk_nope_head_dim" in c:  # an MLA override: its head size follows (dots3's SWA layers)
                    c["head_dim"] = c["qk_nope_head_dim"] + c.get("qk_rope_head_dim", out.get("qk_rope_head_dim", 0))
    parts = ("n_input_layers", "n_recurrent_layers", "n_output_layers")  # Dory: the parts sum to the layers
    if all(isinstance(out.get(k), int) for k in parts) and top:
        out.update(dict.fromkeys(parts, 1))
        out.update({k: 3 for k in LAYERS_KEYS if k in out})
        out["layer_types"] = None  # the config derives them for its 3 layers
    if isinstance(out.get("max_position_embeddings"), int):
        out["max_position_embeddings"] = min(out["max_position_embeddings"], 4096)
    for k in DROPPED:
        out.pop(k, None)
    return out


def token_id(v, i):
    if isinstance(v, list):
        return [token_id(x, i + j) for j, x in enumerate(v)]
    return v if not isinstance(v, int) or v < SIZES["vocab_size"] else i


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    out, rest = argv[0], argv[1:]
    items = []
    if rest[0] == "--from":
        for d in rest[1:]:
            path = os.path.join(d, "config.json")
            try:
                with open(path) as f:
                    items.append((os.path.basename(os.path.normpath(d)), json.load(f)))
            except (OSError, ValueError) as e:
                sys.exit(f"hf_shrink_config: {path}: {e}")
    else:
        from transformers import CONFIG_MAPPING
        for fam in rest:
            if fam not in CONFIG_MAPPING:
                sys.exit(f"hf_shrink_config: model type '{fam}' is not one transformers knows")
            items.append((fam, {**CONFIG_MAPPING[fam]().to_dict(), "model_type": fam}))
    for name, d in items:
        if "model_type" not in d:
            sys.exit(f"hf_shrink_config: {name}: config.json has no model_type")
        os.makedirs(os.path.join(out, name), exist_ok=True)
        with open(os.path.join(out, name, "config.json"), "w") as f:
            json.dump(shrink(d), f, indent=1, default=str)
        print(name)


if __name__ == "__main__":
    main(sys.argv[1:])
