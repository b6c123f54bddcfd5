#!/usr/bin/env python3
"""Weights for model.init_from (tests/hf/hf_tests.cmake), made the way users get them:

    make_init_weights.py HF_MODELS FIXTURE
    make_init_weights.py --one MODEL.pt OUT_DIR   # one such directory (scripts/hf_family_sweep.sh)

  HF_MODELS/llama_pretrained/   a Hugging Face directory as save_pretrained writes it (config.json,
                                model-0000K-of-0000N.safetensors and model.safetensors.index.json,
                                bf16), of the fixture's Llama config with other weights (seed 99);
  HF_MODELS/mixtral_pretrained/ the same of the fixture's Mixtral: transformers saves its experts in
                                the hub's layout (block_sparse_moe.experts.E.w1/w2/w3.weight, one
                                tensor per expert), which the model holds stacked under mlp.experts;
  HF_MODELS/deepseek_v3_pretrained/ the same of the fixture's DeepSeek V3, its routers'
                                e_score_correction_bias buffers (saved too) drawn from N(0, 1);
  HF_MODELS/olmo_hybrid_pretrained/ the same of the fixture's OLMo-Hybrid: renamed norms, and its
                                q/k/v convolutions saved apart (held as one conv1d, cut as
                                torch.chunk cuts it);
  HF_MODELS/gpt2_base_pretrained/ a GPT-2 directory as the hub's openai-community/gpt2 holds it: the
                                base model's weights (GPT2Model: h.0.attn.c_attn.weight, no
                                "transformer." prefix, no lm_head) and the old causal-mask buffers
                                h.N.attn.bias, which from_pretrained ignores;
  FIXTURE/llama_renamed.safetensors  the project's own Llama fixture (FIXTURE/llama.pt) with weights
                                drawn anew, every name under "backbone." and one extra tensor
                                (backbone.rotary.inv_freq) that a rename rule must drop.
"""
import json
import os
import sys

import torch


def hf_config_of(model_pt):
    """The (model_type, config keys) an export_hf.py file was built from (its mfsdp/hf_config.json)."""
    extra = {"mfsdp/hf_config.json": ""}
    torch.jit.load(model_pt, _extra_files=extra)
    keys = json.loads(extra["mfsdp/hf_config.json"])
    family = keys.pop("model_type")
    for k in ("transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype"):
        keys.pop(k, None)
    return family, keys


def save_base_model_of(model_pt, out):
    """The base model (AutoModel: no head, names without the base_model_prefix) of an export's
    config with other weights (seed 98), one fp32 file, and each attention's old causal-mask
    buffer attn.bias as the hub's GPT-2 file has them."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModel
    family, keys = hf_config_of(model_pt)
    torch.manual_seed(98)
    model = AutoModel.from_config(AutoConfig.for_model(family, **keys), dtype=torch.float32)
    model.save_pretrained(out)
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    n = model.config.n_positions
    for i in range(model.config.n_layer):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, n, n, dtype=torch.uint8)).bool().float()
    save_file(tensors, path, metadata={"format": "pt"})


def save_pretrained_of(model_pt, out, max_shard_size):
    """A Hugging Face directory of the transformers model an export_hf.py file was built from (its
    mfsdp/hf_config.json), with other weights (seed 99; DeepSeek V3's router bias, a buffer
    save_pretrained writes, moved off its zeros), in bf16 shards of max_shard_size."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
    import mfsdp_ops  # noqa: F401  (files that call mfsdp::attention load with it)
    transformers.logging.set_verbosity_error()
    family, keys = hf_config_of(model_pt)
    torch.manual_seed(99)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **keys), dtype=torch.float32)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 1.0)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=max_shard_size)


def main():
    if sys.argv[1] == "--one":  # make_init_weights.py --one MODEL.pt OUT_DIR (scripts/hf_family_sweep.sh)
        save_pretrained_of(sys.argv[2], sys.argv[3], "100KB")
        return
    hfx, fx = sys.argv[1], sys.argv[2]
    from safetensors.torch import save_file
    for fixture in ("llama", "mixtral", "deepseek_v3", "olmo_hybrid"):
        out = os.path.join(hfx, f"{fixture}_pretrained")
        save_pretrained_of(os.path.join(hfx, f"{fixture}.pt"), out, "200KB")
        shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
        print(f"wrote {out}: {len(shards)} shards, bf16, {len(index)} tensors (e.g. {sorted(index)[len(index) // 2]})")

    save_base_model_of(os.path.join(hfx, "gpt2.pt"), os.path.join(hfx, "gpt2_base_pretrained"))
    print(f"wrote {os.path.join(hfx, 'gpt2_base_pretrained')}: GPT2Model's names, attn.bias buffers")

    own = torch.jit.load(os.path.join(fx, "llama.pt"))
    g = torch.Generator().manual_seed(5)
    tensors = {f"backbone.{n}": (torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape, generator=g))
               for n, p in own.named_parameters()}
    tensors["backbone.rotary.inv_freq"] = torch.ones(8)
    save_file(tensors, os.path.join(fx, "llama_renamed.safetensors"))
    print(f"wrote {os.path.join(fx, 'llama_renamed.safetensors')}: {len(tensors)} tensors")


if __name__ == "__main__":
    main()
