#!/usr/bin/env python3
"""Shrunk copies of real Hugging Face model configs, for scripts/hf_family_sweep.sh --real.

    hf_real_configs.py OUT      -> OUT/NAME/config.json for each NAME below

Each keeps the keys of the published config.json of a model users fine-tune (rope scaling of the
llama3, yarn and longrope kinds, sliding windows longer than the sequence or turned off, tied
heads, explicit head_dim, soft caps, multipliers, bos/eos ids outside the small vocabulary, MLA,
attention sinks) with the sizes cut to the sweep's (vocabulary 264, hidden 64, 2 layers, 4 heads),
so that an export and a 20-step run take seconds. The names say which model each follows.
"""
import json
import os
import sys

SIZES = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# The models followed: llama32 Llama-3.2-1B (llama3 rope scaling, tied head); qwen25 Qwen2.5-0.5B
# (sliding window present, use_sliding_window false); qwen3 Qwen3-0.6B; qwen3_yarn Qwen3 with YaRN
# as Qwen's model cards set it; mistral01 Mistral-7B-v0.1 (window 4096, longer than the sequence);
# gemma2 Gemma-2-2B (soft caps, windows); gemma3 Gemma-3-1B (linear rope scaling, local base);
# phi3_128k Phi-3-mini-128k (longrope, its factor lists cut to head_dim / 2); smollm2 SmolLM2-135M;
# deepseek_v3 DeepSeek-V3 (MLA, grouped routing); deepseek_v2 the same on DeepSeek-V2's classes;
# gpt_oss gpt-oss-20b (attention sinks, alternating windows, YaRN); glm4 GLM-4-9B-0414 (partial
# rotary, q/k/v biases); olmoe OLMoE-1B-7B; nemotron Nemotron-Mini-4B (relu2, partial rotary);
# ernie4_5 ERNIE-4.5-0.3B; granite Granite 3 (embedding, residual, attention and logit multipliers).
CONFIGS = {
 "llama32": dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, attention_dropout=0.0, bos_token_id=128000, eos_token_id=128001, head_dim=16, hidden_act="silu", initializer_range=0.02, max_position_embeddings=131072, mlp_bias=False, pretraining_tp=1, rms_norm_eps=1e-5, rope_scaling={"factor":32.0,"high_freq_factor":4.0,"low_freq_factor":1.0,"original_max_position_embeddings":8192,"rope_type":"llama3"}, rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True),
 "qwen25": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643, hidden_act="silu", initializer_range=0.02, max_position_embeddings=32768, max_window_layers=24, rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=32768, tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True, use_sliding_window=False),
 "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, attention_dropout=0.0, head_dim=16, hidden_act="silu", max_position_embeddings=40960, max_window_layers=28, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000, sliding_window=None, tie_word_embeddings=True, torch_dtype="bfloat16", use_sliding_window=False),
 "qwen3_yarn": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16, rope_scaling={"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}, rope_theta=1000000, max_position_embeddings=131072, tie_word_embeddings=False),
 "mistral01": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False, torch_dtype="bfloat16"),
 "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0, head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=4096, cache_implementation="hybrid", rope_theta=10000.0, max_position_embeddings=8192, rms_norm_eps=1e-6, torch_dtype="float32"),
 "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16, rope_local_base_freq=10000.0, rope_scaling={"factor":8.0,"rope_type":"linear"}, rope_theta=1000000.0, sliding_window=512, sliding_window_pattern=6, final_logit_softcapping=None, attn_logit_softcapping=None, max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh"),
 "phi3_128k": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", num_key_value_heads=4, hidden_act="silu", max_position_embeddings=131072, original_max_position_embeddings=4096, rope_scaling={"type":"longrope","long_factor":[1.0,1.1,1.3,1.6,2.0,3.0,5.0,8.0],"short_factor":[1.0,1.0,1.0,1.05,1.1,1.2,1.3,1.5]}, rope_theta=10000.0, sliding_window=262144, pad_token_id=0, tie_word_embeddings=False),
 "smollm2": dict(architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=4, rope_theta=10000, tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5),
 "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_key_value_heads=4, routed_scaling_factor=2.5, rope_theta=10000, max_position_embeddings=4096, tie_word_embeddings=False),
 "gpt_oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8, layer_types=["sliding_attention","full_attention"], rope_scaling={"rope_type":"yarn","factor":32.0,"beta_fast":32.0,"beta_slow":1.0,"truncate":False,"original_max_position_embeddings":4096}, rope_theta=150000, max_position_embeddings=131072, intermediate_size=64),
 "glm4": dict(architectures=["Glm4ForCausalLM"], model_type="glm4", head_dim=16, partial_rotary_factor=0.5, attention_bias=True, rope_theta=10000, max_position_embeddings=4096),
 "olmoe": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", num_experts=4, num_experts_per_tok=2, intermediate_size=32, num_key_value_heads=4, rope_theta=10000),
 "nemotron": dict(architectures=["NemotronForCausalLM"], model_type="nemotron", num_key_value_heads=2, partial_rotary_factor=0.5, hidden_act="relu2", norm_eps=1e-5),
 "ernie4_5": dict(architectures=["Ernie4_5ForCausalLM"], model_type="ernie4_5", head_dim=16, use_bias=False, tie_word_embeddings=True),
 "granite": dict(architectures=["GraniteForCausalLM"], model_type="granite", embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0078125, tie_word_embeddings=True),
}
# More of the keys real configs set: biases everywhere (Llama with attention_bias and mlp_bias, as
# some fine-tunes ship), dynamic NTK rope scaling, Phi-4-mini's partial rotary factor (0.75), a
# Qwen2 with its sliding window on and longer than the sequence (max_window_layers 1: layer 1
# windowed), Mistral-Nemo's explicit head_dim (128 for 5120; here 32 for 64, 2 heads' worth wider
# than hidden / heads), and Cohere 2 (Command R7B: logit scale, sliding layers with a window).
CONFIGS |= {
    "llama_bias": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": True,
                   "mlp_bias": True, "rope_theta": 10000.0, "tie_word_embeddings": False},
    "llama_dynamic": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 10000.0,
                      "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 2048},
    "phi4_mini": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "num_key_value_heads": 2,
                  "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "tie_word_embeddings": True,
                  "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                  "rope_scaling": {"type": "longrope", "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
                                   "short_factor": [1.0, 1.0, 1.0, 1.0, 1.1, 1.2]}, "pad_token_id": 0},
    "qwen2_window": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
                     "sliding_window": 4096, "max_window_layers": 1, "tie_word_embeddings": False},
    "mistral_nemo": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "head_dim": 32,
                     "sliding_window": None, "rope_theta": 1000000.0},
    "cohere2": {"architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "logit_scale": 0.25,
                "sliding_window": 4096, "layer_types": ["sliding_attention", "full_attention"], "use_qk_norm": False,
                "rope_theta": 50000.0},
}
CONFIGS["deepseek_v2"] = {**CONFIGS["deepseek_v3"], "architectures": ["DeepseekV2ForCausalLM"],
                          "model_type": "deepseek_v2", "topk_method": "greedy"}
del CONFIGS["deepseek_v2"]["n_group"], CONFIGS["deepseek_v2"]["topk_group"]


def main():
    out = sys.argv[1]
    for name, keys in CONFIGS.items():
        os.makedirs(os.path.join(out, name), exist_ok=True)
        with open(os.path.join(out, name, "config.json"), "w") as f:
            json.dump({**SIZES, **keys}, f, indent=1)
        print(name)


if __name__ == "__main__":
    main()
