#!/usr/bin/env python3
"""The Hugging Face fixture models (tests/hf/hf_tests.cmake): small configs of ten transformers
families, exported with scripts/export_hf.py (its main, in one process) as a user would:

    make_models.py SRC OUT      -> OUT/FAMILY.pt, OUT/FAMILY.log

Llama with grouped-query attention; Mistral, and one with a sliding window of 8 tokens; Qwen2 (q/k/v biases, tied head); Qwen3 (q/k norms,
an explicit head_dim); Gemma (tied, scaled embeddings, GeGLU, head_dim 16: 4 heads x 16 over 64);
GPT-2 (Conv1D layers, learned positions, tied head, its dropouts zeroed; gpt2_v267 with a vocabulary
that no TP size divides); Phi-3 (packed qkv and
gate_up: colwise_gather_output and rowwise_split_input, kept as colwise_rep and rowwise_rep); GPT-NeoX, Phi,
Gemma 2, StableLM and OPT, BLOOM, Falcon, Mixtral, Llama 4 text, OLMo 2, DeepSeek V3 and GPT-Neo (below); and
three LoRA models wrapped by PEFT (llama_lora, qwen2_lora, gpt2_lora).
"""
import contextlib
import io
import os
import sys

COMMON = ["vocab_size=264", "hidden_size=64", "intermediate_size=128", "num_hidden_layers=2", "num_attention_heads=4"]
MODELS = {
    "llama": ["--family", "llama", "--set", *COMMON, "num_key_value_heads=2"],
    "mistral": ["--family", "mistral", "--set", *COMMON, "num_key_value_heads=2"],
    "mistral_sw": ["--family", "mistral", "--set", *COMMON, "num_key_value_heads=2", "sliding_window=8"],
    "qwen2": ["--family", "qwen2", "--set", *COMMON, "num_key_value_heads=2", "tie_word_embeddings=true"],
    "qwen3": ["--family", "qwen3", "--set", *COMMON, "num_key_value_heads=2", "head_dim=8"],
    "gemma": ["--family", "gemma", "--set", *COMMON, "num_key_value_heads=2", "head_dim=16"],
    "gpt2": ["--family", "gpt2", "--set", "vocab_size=264", "n_embd=64", "n_layer=2", "n_head=4", "n_positions=128"],
    # A vocabulary no TP size divides (267 = 3 x 89; GPT-2's own is 50257): padded over the ranks.
    "gpt2_v267": ["--family", "gpt2", "--set", "vocab_size=267", "n_embd=64", "n_layer=2", "n_head=4", "n_positions=128"],
    "phi3": ["--family", "phi3", "--set", *COMMON, "num_key_value_heads=4", "pad_token_id=0"],
    # GPT-NeoX: q/k/v packed per head in one query_key_value, parallel residual, and its plan's
    # embed_in style embedding_rowwise; Phi (1/2): a head with a bias; Gemma 2: no sdpa path (logit
    # soft-capping), so --attention auto exports it with eager attention.
    "gpt_neox": ["--family", "gpt_neox", "--set", *COMMON],
    "phi": ["--family", "phi", "--set", *COMMON],
    # A strong attention soft cap (0.1 on scores scaled by 1/sqrt(1)): a CP path that ignored it
    # would be 2e-3 off PyTorch (measured), not 1e-7.
    "gemma2": ["--family", "gemma2", "--set", *COMMON, "num_key_value_heads=2", "head_dim=16",
               "attn_logit_softcapping=0.1", "query_pre_attn_scalar=1"],
    # No base_model_tp_plan in their configs (mfsdp's own plans, scripts/export_hf.py): StableLM
    # (LayerNorm, partial rotary, constant head counts in its views); OPT (learned positions with an
    # offset, a tied head, fc1/fc2 in the layer on flattened tokens, constant head counts).
    "stablelm": ["--family", "stablelm", "--set", *COMMON, "num_key_value_heads=2"],
    "opt": ["--family", "opt", "--set", "vocab_size=264", "hidden_size=64", "ffn_dim=128", "num_hidden_layers=2",
            "num_attention_heads=4", "max_position_embeddings=128"],
    # Families added from a sweep of held-out ones (README "Hugging Face models"): BLOOM (ALiBi, eager
    # attention, a custom autograd GELU traced through its forward), Falcon (multi-query attention:
    # one key/value head, repeated for CP), Mixtral (a sparse MoE block; under TP its experts split by moe_experts), Llama 4 text
    # (chunked attention and no-rope layers, MoE; CP refused by its recorded window), OLMo 2 (q/k
    # norms over all heads, post-norm blocks, a TP plan from its config).
    "bloom": ["--family", "bloom", "--set", "vocab_size=264", "hidden_size=64", "n_layer=2", "n_head=4"],
    "falcon": ["--family", "falcon", "--set", "vocab_size=264", "hidden_size=64", "num_hidden_layers=2",
               "num_attention_heads=4"],
    "mixtral": ["--family", "mixtral", "--set", *COMMON, "num_key_value_heads=2", "num_local_experts=4",
                "num_experts_per_tok=2"],
    "llama4_text": ["--family", "llama4_text", "--set", *COMMON, "intermediate_size_mlp=128", "num_key_value_heads=2",
                    "head_dim=16", "num_local_experts=2", "attention_chunk_size=8"],
    "olmo2": ["--family", "olmo2", "--set", *COMMON, "num_key_value_heads=2"],
    # DeepSeek V3: multi-head latent attention (q_a_proj -> norm -> q_b_proj; kv_a_proj_with_mqa
    # -> norm -> kv_b_proj, plus a rope key shared by the heads; values of 8 against q/k heads of
    # 16) and a sparse MoE after one dense layer. Its config plans the MLP only: export_hf.py adds
    # the attention (PLAN_SUPPLEMENTS) and marks the replicated projections and norms before the
    # heads replicated_with_grad_allreduce.
    "deepseek_v3": ["--family", "deepseek_v3", "--set", *COMMON, "num_key_value_heads=4", "moe_intermediate_size=32",
                    "n_routed_experts=4", "n_shared_experts=1", "num_experts_per_tok=2", "n_group=2", "topk_group=1",
                    "first_k_dense_replace=1", "kv_lora_rank=16", "q_lora_rank=24", "qk_nope_head_dim=8",
                    "qk_rope_head_dim=8", "v_head_dim=8"],
    # Configs whose plan leaves attention unsplit: DiffLlama plans none of its layers (its
    # differential attention runs whole on every TP rank: sequence_whole; its MLP measured token by
    # token: sequence_parallel); MiniMax alternates softmax attention (q/k/v/o split) with
    # lightning (linear) attention under the same layers.*.self_attn, which gets an entry of its
    # own per layer (sequence_whole), and has an MoE in every layer.
    "diffllama": ["--family", "diffllama", "--set", *COMMON, "num_key_value_heads=2"],
    "minimax": ["--family", "minimax", "--set", *COMMON, "num_key_value_heads=2", "head_dim=16", "num_local_experts=4",
                "num_experts_per_tok=2", 'layer_types=["full_attention","linear_attention"]'],
    "granite_swa": ["--family", "granite_swa", "--set", *COMMON, "num_key_value_heads=2"],
    # Gemma 4: per-layer inputs ([B, T, D] per layer, computed before the layers) that each layer
    # multiplies in token by token: under SP cut like the hidden state (split_unit_side_inputs).
    "gemma4_text": ["--family", "gemma4_text", "--set", *COMMON, "num_key_value_heads=2", "head_dim=16",
                    "hidden_size_per_layer_input=16", "vocab_size_per_layer_input=264",
                    'layer_types=["sliding_attention","full_attention"]', "per_layer_config={}"],
    # Gemma 3n: its MLP's Gaussian top-k (activation sparsity, layer 0 here) takes the mean and
    # deviation over the whole intermediate width: split by its colwise plan it would compute them
    # per TP rank (measured 1.2e-2 off PyTorch); export_hf.py finds that the split changes the
    # block's output and keeps the MLPs unsplit. Its layers take [altup inputs, B, T, H]: SP, which
    # cuts dim 1, refuses it.
    "gemma3n_text": ["--family", "gemma3n_text", "--set", *COMMON, "num_key_value_heads=2", "head_dim=16",
                     "hidden_size_per_layer_input=16", "vocab_size_per_layer_input=264", "laurel_rank=8",
                     "num_kv_shared_layers=0", 'layer_types=["sliding_attention","full_attention"]',
                     "activation_sparsity_pattern=[0.95,0.0]", "intermediate_size=[128,128]"],
    # OLMo-Hybrid: decoder layers of two classes (gated delta-net linear attention, then softmax
    # attention with q/k norms over all heads), all of them units (model.cpp, find_units).
    "olmo_hybrid": ["--family", "olmo_hybrid", "--set", *COMMON, "num_key_value_heads=2",
                    'layer_types=["linear_attention","full_attention"]', "linear_num_key_heads=2",
                    "linear_num_value_heads=4", "linear_key_head_dim=16", "linear_value_head_dim=16", "pad_token_id=0",
                    "eos_token_id=1"],
    # JetMoE: tokens per expert as a Python list (tolist) that splits the sorted tokens, traced as
    # the running sums of that tensor (export_hf.py, traceable_split_sizes).
    "jetmoe": ["--family", "jetmoe", "--set", "vocab_size=264", "hidden_size=64", "intermediate_size=128",
               "num_hidden_layers=2", "num_key_value_heads=2", "kv_channels=16", "num_local_experts=4",
               "num_experts_per_tok=2"],
    # Dory: its middle layer runs twice per forward (recurrent loops), which torch.jit.trace records
    # as the layer's forward and forward1: mfsdp points the repeated call at forward (model.cpp,
    # unify_traced_repeats), else strategy 3 ran it on freed weights and CP left its attention local.
    # Its output head scales the logits by a parameter of the vocabulary's size: no colwise head.
    "dory": ["--family", "dory", "--set", "vocab_size=264", "hidden_size=64", "intermediate_size=128",
             "num_hidden_layers=3", "num_attention_heads=4", "num_key_value_heads=2", "head_dim=16",
             "n_input_layers=1", "n_recurrent_layers=1", "n_output_layers=1", "n_recurrent_loops=2"],
    # DBRX: its experts loop over the experts the tokens hit (traced over every expert:
    # export_hf.py, every_expert_loops), two experts per token (with one, the router's gradient is
    # rounding noise, ~1e-12, through the normalised weight: any two implementations part there).
    "dbrx": ["--family", "dbrx", "--set", "d_model=64", "n_heads=4", "n_layers=2", "vocab_size=264", "max_seq_len=128",
             'attn_config={"kv_n_heads":2,"clip_qkv":8.0,"rope_theta":10000.0}',
             'ffn_config={"ffn_hidden_size":32,"moe_num_experts":4,"moe_top_k":2}'],
    # GPT-Neo: its own attention method (unscaled scores), global layers only so that CP applies.
    "gpt_neo": ["--family", "gpt_neo", "--set", "vocab_size=264", "hidden_size=64", "num_layers=2", "num_heads=4",
                'attention_types=[[["global"],2]]', "max_position_embeddings=128"],
}
# LoRA (PEFT) models: PEFT's default targets for Llama (q_proj, v_proj; v_proj of rank 2 and layer 1's
# q_proj with alpha 16 by rank_pattern and alpha_pattern, and the output head trained in full:
# modules_to_save); every linear layer of Qwen2
# (tied head, biases on q/k/v); GPT-2's packed c_attn, a Conv1D (fan_in_fan_out).
MODELS |= {
    "llama_lora": MODELS["llama"] + ["--lora-r", "4", "--lora-alpha", "8", "--lora-rank-pattern", "v_proj=2",
                                     "--lora-alpha-pattern", r"layers\.1\.self_attn\.q_proj=16",
                                     "--lora-modules-to-save", "lm_head"],
    "qwen2_lora": MODELS["qwen2"] + ["--lora-r", "8", "--lora-alpha", "16", "--lora-targets", "q_proj", "k_proj", "v_proj",
                                     "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2_lora": MODELS["gpt2"] + ["--lora-r", "4", "--lora-alpha", "16"],
    # LoRA on an MoE model (q_proj and v_proj adapted): its merged export writes the
    # experts as save_pretrained does (per expert, under block_sparse_moe).
    "mixtral_lora": MODELS["mixtral"] + ["--lora-r", "4", "--lora-alpha", "8", "--lora-targets", "q_proj", "v_proj"],
    # DoRA (PEFT's use_dora): a trained magnitude per output row of each adapted layer.
    "llama_dora": MODELS["llama"] + ["--lora-r", "4", "--lora-alpha", "8", "--lora-dora", "--lora-targets", "q_proj",
                                     "v_proj", "o_proj"],
    # Traced in bf16 (export_hf.py --dtype bf16): its weights stored and its casts recorded in bf16.
    "llama_bf16": MODELS["llama"] + ["--dtype", "bf16"],
    # Dropout kept (--dropout config), traced in training mode: GPT-2's embd/resid/attn_pdrop 0.1;
    # the same with attention dropout 0 (every dropout on a tensor TP leaves whole); LoRA dropout.
    "gpt2_dropout": MODELS["gpt2"] + ["--dropout", "config"],
    "gpt2_hdropout": MODELS["gpt2"] + ["attn_pdrop=0", "resid_pdrop=0.2", "--dropout", "config"],
    "qwen2_lora_dropout": MODELS["qwen2"] + ["--lora-r", "8", "--lora-alpha", "16", "--lora-dropout", "0.1"],
    # Eager attention traced as its ops (--attention eager_traced): softmax(q k^T) v written out, with
    # repeat_kv (Llama, 2 key/value heads) and attention dropout (GPT-2's attn_pdrop 0.1, traced in
    # training mode), taken by mfsdp's attention kernel (model/eager_attention.cpp).
    "llama_eager": MODELS["llama"] + ["--attention", "eager_traced"],
    "gpt2_eager_dropout": MODELS["gpt2"] + ["--attention", "eager_traced", "--dropout", "config"],
}


def main():
    src, out = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.join(src, "scripts"))
    import export_hf
    os.makedirs(out, exist_ok=True)
    for name, args in MODELS.items():
        log = io.StringIO()
        with contextlib.redirect_stderr(log):
            try:
                export_hf.main(args + ["--out", os.path.join(out, f"{name}.pt")])
            except SystemExit as e:
                if e.code not in (None, 0):
                    sys.stderr.write(log.getvalue())
                    sys.exit(f"make_models: {name}: export_hf failed: {e.code}")
        with open(os.path.join(out, f"{name}.log"), "w") as f:
            f.write(log.getvalue())
        print("".join(l + "\n" for l in log.getvalue().splitlines() if l.startswith("export_hf")), end="")


if __name__ == "__main__":
    main()
