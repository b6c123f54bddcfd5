# Hugging Face models trained unchanged (scripts/export_hf.py; DESIGN.md section 13): seven
# transformers families exported as a user would (tests/hf/make_models.py), trained by mfsdp at 1,
# 2 and 4 ranks under every strategy and with tensor parallelism, each against PyTorch training the
# transformers model itself in Python (tests/oracle/reference_trainer.py builds it from the file's
# mfsdp/hf_config.json): losses within 1e-5 at every step. Included from tests/CMakeLists.txt.
set(HFX ${FX}/hf_models)
set(HF_CHECK ${CMAKE_CURRENT_SOURCE_DIR}/hf/check_hf_export.py)
add_test(NAME hf_models COMMAND ${MFSDP_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/hf/make_models.py ${PROJECT_SOURCE_DIR} ${HFX})
set_tests_properties(hf_models PROPERTIES FIXTURES_SETUP hf_models TIMEOUT 300)

# mfsdp_hf_run(NAME NP FAMILY OVERRIDES...)
function(mfsdp_hf_run name np family)
  mfsdp_train_run(${name} ${np} model.path=${HFX}/${family}.pt ${ARGN})
  set_tests_properties(run_${name} PROPERTIES FIXTURES_REQUIRED "train;hf_models")
endfunction()

set(hf_runs)
foreach(f llama mistral qwen2 qwen3 gemma gpt2 phi3)
  mfsdp_hf_run(hf_${f}_s3_n2 2 ${f} distributed.zero_dp_strategy=3)
  list(APPEND hf_runs hf_${f}_s3_n2)
endforeach()
mfsdp_hf_run(hf_llama_n1 1 llama)
mfsdp_hf_run(hf_llama_s0_n4 4 llama distributed.zero_dp_strategy=0)
mfsdp_hf_run(hf_llama_s1_n2 2 llama distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_llama_s2_n4 4 llama distributed.zero_dp_strategy=2)
# Tensor parallelism from the plan derived from each config's base_model_tp_plan: GQA heads split
# (llama), biases split with their weights (qwen2), q/k norms' gradients summed over TP (qwen3,
# replicated_with_grad_allreduce), a tied embedding and head split together (gemma, qwen2).
mfsdp_hf_run(hf_llama_tp2_s3_n4 4 llama distributed.tp_size=2 distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_qwen2_tp2_s1_n4 4 qwen2 distributed.tp_size=2 distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_qwen3_tp2_n2 2 qwen3 distributed.tp_size=2)
mfsdp_hf_run(hf_gemma_tp2_s3_n2 2 gemma distributed.tp_size=2 distributed.zero_dp_strategy=3)
# Context parallelism without a core-attention module: the scaled_dot_product_attention calls are
# replaced (the causal mask HF builds checked and dropped); all-gather and ring, with TP too.
mfsdp_hf_run(hf_llama_cp2_s3_n2 2 llama distributed.cp_size=2 distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_gemma_cp2_n2 2 gemma distributed.cp_size=2)
mfsdp_hf_run(hf_gpt2_cp2_s1_n2 2 gpt2 distributed.cp_size=2 distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_qwen3_cp2_tp2_p2p_s3_n4 4 qwen3 distributed.cp_size=2 distributed.tp_size=2 distributed.cp_comm_type=p2p
             distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_phi3_cp4_s2_n4 4 phi3 distributed.cp_size=4 distributed.zero_dp_strategy=2)
mfsdp_hf_run(hf_mistral_sw_s3_n2 2 mistral_sw distributed.zero_dp_strategy=3)
# Gemma 2 has eager attention only (soft-capped logits): the exporter routes it through one
# operator, mfsdp::attention, which CP replaces by the blockwise attention with the cap.
mfsdp_hf_run(hf_gemma2_cp2_s2_n2 2 gemma2 distributed.cp_size=2 distributed.zero_dp_strategy=2)
mfsdp_hf_run(hf_gemma2_tp2_cp2_p2p_s3_n4 4 gemma2 distributed.tp_size=2 distributed.cp_size=2 distributed.cp_comm_type=p2p
             distributed.zero_dp_strategy=3)
list(APPEND hf_runs hf_llama_cp2_s3_n2 hf_gemma_cp2_n2 hf_gpt2_cp2_s1_n2 hf_qwen3_cp2_tp2_p2p_s3_n4 hf_phi3_cp4_s2_n4
     hf_mistral_sw_s3_n2 hf_gemma2_cp2_s2_n2 hf_gemma2_tp2_cp2_p2p_s3_n4)
# GPT-2 under TP: Conv1D projections ([in, out] weights) rewritten at their call sites, c_attn's
# packed q/k/v split part by part (the caller's split width made local), a tied embedding and
# head; with CP too.
mfsdp_hf_run(hf_gpt2_tp2_s3_n4 4 gpt2 distributed.tp_size=2 distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_gpt2_tp2_cp2_s1_n4 4 gpt2 distributed.tp_size=2 distributed.cp_size=2 distributed.zero_dp_strategy=1)
# Phi-3 under TP: fused qkv_proj and gate_up_proj colwise with their output gathered (HF's
# colwise_gather_output: colwise_rep), o_proj and down_proj taking their slice of the replicated
# input (rowwise_split_input: rowwise_rep).
mfsdp_hf_run(hf_phi3_tp2_s3_n4 4 phi3 distributed.tp_size=2 distributed.zero_dp_strategy=3)
list(APPEND hf_runs hf_llama_n1 hf_llama_s0_n4 hf_llama_s1_n2 hf_llama_s2_n4 hf_llama_tp2_s3_n4 hf_qwen2_tp2_s1_n4
     hf_qwen3_tp2_n2 hf_gemma_tp2_s3_n2 hf_gpt2_tp2_s3_n4 hf_gpt2_tp2_cp2_s1_n4 hf_phi3_tp2_s3_n4)
# Families without a base_model_tp_plan, on mfsdp's own plans: StableLM and OPT (their traced
# attention views q, k and v by constant head counts, made local; OPT's fc1 and fc2 work on the
# tokens flattened to [B x T, H], which sequence parallelism gathers and scatters along dim 0).
mfsdp_hf_run(hf_stablelm_s2_n2 2 stablelm distributed.zero_dp_strategy=2)
mfsdp_hf_run(hf_stablelm_tp2_sp_s3_n4 4 stablelm distributed.tp_size=2 distributed.sequence_parallel=true distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_stablelm_cp2_n2 2 stablelm distributed.cp_size=2)
mfsdp_hf_run(hf_opt_s3_n2 2 opt distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_opt_tp2_s1_n2 2 opt distributed.tp_size=2 distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_opt_tp2_sp_s3_n4 4 opt distributed.tp_size=2 distributed.sequence_parallel=true distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_opt_cp2_n2 2 opt distributed.cp_size=2)
list(APPEND hf_runs hf_stablelm_s2_n2 hf_stablelm_tp2_sp_s3_n4 hf_stablelm_cp2_n2 hf_opt_s3_n2 hf_opt_tp2_s1_n2
     hf_opt_tp2_sp_s3_n4 hf_opt_cp2_n2)
# Families from the sweep of held-out ones (tests/hf/make_models.py): BLOOM's ALiBi and traced
# custom GELU, Falcon's multi-query attention under CP (its one key/value head repeated), Mixtral's
# sparse MoE, Llama 4's chunked attention and MoE, OLMo 2's q/k norms over all heads under TP
# (replicated_with_grad_allreduce is not enough there: its plan gathers them) with SP and CP.
mfsdp_hf_run(hf_bloom_s3_n2 2 bloom distributed.zero_dp_strategy=3)
# GPT-Neo's attention is a method of its own (unscaled): export_hf.py routes it through
# mfsdp::attention, which CP replaces.
mfsdp_hf_run(hf_gpt_neo_cp2_p2p_s3_n2 2 gpt_neo distributed.cp_size=2 distributed.cp_comm_type=p2p distributed.zero_dp_strategy=3)
# GPT-Neo under TP and SP on export_hf.py's own plan (its config has none).
mfsdp_hf_run(hf_gpt_neo_tp2_sp_s1_n4 4 gpt_neo distributed.tp_size=2 distributed.sequence_parallel=true distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_bloom_s1_n4 4 bloom distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_falcon_cp2_s3_n2 2 falcon distributed.cp_size=2 distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_falcon_cp2_p2p_s0_n4 4 falcon distributed.cp_size=2 distributed.cp_comm_type=p2p distributed.zero_dp_strategy=0)
mfsdp_hf_run(hf_mixtral_s3_n4 4 mixtral distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_mixtral_cp2_s2_n2 2 mixtral distributed.cp_size=2 distributed.zero_dp_strategy=2)
mfsdp_hf_run(hf_llama4_text_s2_n2 2 llama4_text distributed.zero_dp_strategy=2)
# Mixtral under TP: its experts module (3-D expert weights) split by moe_experts from the config's
# moe_tp_experts entry, with TP alone and with SP (tokens gathered at the experts' call, the router's
# gradients summed over TP).
mfsdp_hf_run(hf_mixtral_tp2_s1_n2 2 mixtral distributed.tp_size=2 distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_mixtral_tp2_sp_s3_n4 4 mixtral distributed.tp_size=2 distributed.sequence_parallel=true distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_olmo2_tp2_sp_s3_n4 4 olmo2 distributed.tp_size=2 distributed.sequence_parallel=true distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_olmo2_tp2_cp2_s1_n4 4 olmo2 distributed.tp_size=2 distributed.cp_size=2 distributed.zero_dp_strategy=1)
# DeepSeek V3's multi-head latent attention: split by heads under TP (q_b_proj, kv_b_proj colwise,
# o_proj rowwise) with the replicated q_a_proj, kv_a_proj_with_mqa and their norms summed over TP
# (their gradients there are this rank's heads' share), with SP; under CP its values (head size 8)
# padded to the queries' and keys' (16) inside the blockwise attention, both exchanges.
mfsdp_hf_run(hf_deepseek_v3_tp2_sp_s3_n4 4 deepseek_v3 distributed.tp_size=2 distributed.sequence_parallel=true
             distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_deepseek_v3_cp2_s2_n2 2 deepseek_v3 distributed.cp_size=2 distributed.zero_dp_strategy=2)
mfsdp_hf_run(hf_deepseek_v3_tp2_cp2_p2p_s1_n4 4 deepseek_v3 distributed.tp_size=2 distributed.cp_size=2
             distributed.cp_comm_type=p2p distributed.zero_dp_strategy=1)
list(APPEND hf_runs hf_deepseek_v3_tp2_sp_s3_n4 hf_deepseek_v3_cp2_s2_n2 hf_deepseek_v3_tp2_cp2_p2p_s1_n4)
# Attention a config's plan leaves unsplit runs whole on every TP rank (sequence_whole: under SP
# gathered whole at its input, cut back to this rank's part at its output): DiffLlama's, with its
# MLP measured token-wise (sequence_parallel); MiniMax's lightning-attention layer, matched by the
# glob whose softmax layer is split (gathered as that one was, it trained 1e-3 off PyTorch under
# plain TP). GraniteSWA: layers of two TorchScript classes beside a ModuleList of rotary tables
# (units were once the ModuleList, which has no forward).
mfsdp_hf_run(hf_diffllama_tp2_sp_s3_n4 4 diffllama distributed.tp_size=2 distributed.sequence_parallel=true
             distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_minimax_tp2_s1_n2 2 minimax distributed.tp_size=2 distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_minimax_tp2_sp_s3_n4 4 minimax distributed.tp_size=2 distributed.sequence_parallel=true
             distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_granite_swa_s3_n2 2 granite_swa distributed.zero_dp_strategy=3)
# Gemma 4's per-layer inputs, whole from before the layers, cut like the hidden state under SP.
mfsdp_hf_run(hf_gemma4_text_tp2_sp_s3_n4 4 gemma4_text distributed.tp_size=2 distributed.sequence_parallel=true
             distributed.zero_dp_strategy=3)
list(APPEND hf_runs hf_diffllama_tp2_sp_s3_n4 hf_minimax_tp2_s1_n2 hf_minimax_tp2_sp_s3_n4 hf_granite_swa_s3_n2
     hf_gemma4_text_tp2_sp_s3_n4)
# A block whose output the plan's split would change stays unsplit (Gemma 3n's MLP, its Gaussian
# top-k over the intermediate width); SP refuses layers whose input's dim 1 is not the sequence.
# OLMo-Hybrid's layers of two classes are all units (TP + SP splits each). JetMoE's experts split
# by a traced tensor of token counts.
mfsdp_hf_run(hf_gemma3n_text_tp2_s1_n2 2 gemma3n_text distributed.tp_size=2 distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_olmo_hybrid_tp2_sp_s3_n4 4 olmo_hybrid distributed.tp_size=2 distributed.sequence_parallel=true
             distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_jetmoe_s3_n2 2 jetmoe distributed.zero_dp_strategy=3)
# Dory's layer run twice per forward, under strategy 3 with CP, and under TP; with SP its layers'
# own rates marked alone (parameter entries) and its head, which scales its logits by a
# vocabulary-sized parameter, kept whole (sequence_whole: the whole sequence's logits on every TP
# rank); DBRX's expert loop.
mfsdp_hf_run(hf_dory_cp2_s3_n2 2 dory distributed.cp_size=2 distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_dory_tp2_s1_n2 2 dory distributed.tp_size=2 distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_dory_tp2_sp_s3_n4 4 dory distributed.tp_size=2 distributed.sequence_parallel=true
             distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_dbrx_s3_n2 2 dbrx distributed.zero_dp_strategy=3)
list(APPEND hf_runs hf_gemma3n_text_tp2_s1_n2 hf_olmo_hybrid_tp2_sp_s3_n4 hf_jetmoe_s3_n2 hf_dory_cp2_s3_n2
     hf_dory_tp2_s1_n2 hf_dory_tp2_sp_s3_n4 hf_dbrx_s3_n2)
add_test(NAME hf_gemma3n_sp_refused
         COMMAND ${EXPECT} 2 "whose dim 1 is not the sequence: sequence parallelism does not apply" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml run_dir=${FX}/hf_gemma3n_sp_refused
                 model.path=${HFX}/gemma3n_text.pt distributed.tp_size=2 distributed.sequence_parallel=true training.max_steps=1)
set_tests_properties(hf_gemma3n_sp_refused PROPERTIES FIXTURES_REQUIRED "train;hf_models" PROCESSORS 2)
# The run's log names the unit inputs cut like the hidden state under SP (Gemma 4's per-layer input).
add_test(NAME hf_gemma4_side_inputs_named
         COMMAND ${EXPECT} 0 "units' inputs cut like the hidden state where they span the sequence: Gemma4TextDecoderLayer input 5 \\(per_layer_input" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml run_dir=${FX}/hf_gemma4_side_inputs
                 model.path=${HFX}/gemma4_text.pt distributed.tp_size=2 distributed.sequence_parallel=true training.max_steps=1)
set_tests_properties(hf_gemma4_side_inputs_named PROPERTIES FIXTURES_REQUIRED "train;hf_models" PROCESSORS 2)
# scripts/hf_shrink_config.py: every key kept, sizes cut, MLA consistent, and the result exports.
add_test(NAME hf_shrink_config COMMAND ${MFSDP_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/hf/check_shrink_config.py
                                       ${PROJECT_SOURCE_DIR} ${FX}/hf_shrink_config)
set_tests_properties(hf_shrink_config PROPERTIES TIMEOUT 300)
# A split layer inside a sequence_whole block (which nothing reduces) is refused, naming it.
add_test(NAME hf_whole_block_split_inside
         COMMAND ${EXPECT} 2 "model.layers.0.self_attn.q_proj \\(colwise\\) lies inside a sequence_whole block" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml run_dir=${FX}/hf_whole_split_inside
                 model.path=${HFX}/diffllama.pt distributed.tp_size=2
                 "distributed.tp_plan={\"model.layers.*.self_attn\": sequence_whole, \"model.layers.*.self_attn.q_proj\": colwise}")
set_tests_properties(hf_whole_block_split_inside PROPERTIES FIXTURES_REQUIRED "train;hf_models" PROCESSORS 2)
list(APPEND hf_runs hf_bloom_s3_n2 hf_gpt_neo_cp2_p2p_s3_n2 hf_gpt_neo_tp2_sp_s1_n4 hf_bloom_s1_n4 hf_falcon_cp2_s3_n2 hf_falcon_cp2_p2p_s0_n4 hf_mixtral_s3_n4
     hf_mixtral_cp2_s2_n2 hf_llama4_text_s2_n2 hf_olmo2_tp2_sp_s3_n4 hf_olmo2_tp2_cp2_s1_n4 hf_mixtral_tp2_s1_n2
     hf_mixtral_tp2_sp_s3_n4)
mfsdp_oracle(hf_families RUNS ${hf_runs})
mfsdp_run_dirs(_dirs _fixtures ${hf_runs})
set_tests_properties(oracle_hf_families PROPERTIES FIXTURES_REQUIRED "${_fixtures}")

# moe_experts applies to experts modules only: on a Linear the plan is refused, naming the module.
add_test(NAME hf_moe_experts_on_a_linear
         COMMAND ${EXPECT} 2 "model.layers.0.self_attn.q_proj \\(class Linear\\) has no 3-D parameters gate_up_proj" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml run_dir=${FX}/hf_moe_on_linear
                 model.path=${HFX}/mixtral.pt distributed.tp_size=2
                 "distributed.tp_plan={\"model.layers.*.self_attn.q_proj\": moe_experts}")
set_tests_properties(hf_moe_experts_on_a_linear PROPERTIES FIXTURES_REQUIRED "train;hf_models" PROCESSORS 2)

# A replicated module inside a sequence_gathered block gets this rank's share of its gradient
# (the block's colwise layers leave the reduction to the block's input): a plan that does not say
# how to sum it is refused, with or without SP, naming the parameters. Left unmarked, DeepSeek V3
# trained 1.7e-4 off PyTorch in 11 steps (measured before the check).
set(_mla_unmarked "{\"model.layers.*.self_attn\": sequence_gathered, \"model.layers.*.self_attn.q_b_proj\": colwise, \"model.layers.*.self_attn.kv_b_proj\": colwise, \"model.layers.*.self_attn.o_proj\": rowwise, \"model.embed_tokens\": vocab_parallel, \"lm_head\": colwise}")
add_test(NAME hf_gathered_block_unmarked_replicated
         COMMAND ${EXPECT} 2 "replicated inside a sequence_gathered block.*model.layers.0.self_attn.q_a_proj.weight.*replicated_with_grad_allreduce" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml run_dir=${FX}/hf_mla_unmarked
                 model.path=${HFX}/deepseek_v3.pt distributed.tp_size=2 "distributed.tp_plan=${_mla_unmarked}")
set_tests_properties(hf_gathered_block_unmarked_replicated PROPERTIES FIXTURES_REQUIRED "train;hf_models" PROCESSORS 2
                     TIMEOUT 120)

# The check can fail: Qwen3's q/k norms see only this rank's heads under TP; with a plan that
# leaves them plain replicated (no gradient sum) the losses leave PyTorch's.
set(_qwen3_unsummed "{\"model.layers.*.self_attn.q_proj\": colwise, \"model.layers.*.self_attn.k_proj\": colwise, \"model.layers.*.self_attn.v_proj\": colwise, \"model.layers.*.self_attn.o_proj\": rowwise, \"model.layers.*.mlp.gate_proj\": colwise, \"model.layers.*.mlp.up_proj\": colwise, \"model.layers.*.mlp.down_proj\": rowwise, \"model.embed_tokens\": vocab_parallel, \"lm_head\": colwise}")
mfsdp_hf_run(hf_qwen3_tp2_norms_unsummed 2 qwen3 distributed.tp_size=2 "distributed.tp_plan=${_qwen3_unsummed}")
mfsdp_oracle(hf_catches_unsummed_norms RUNS hf_qwen3_tp2_norms_unsummed ARGS --expect-differ)

# Fine-tuning with frozen parameters (model.frozen / model.trainable; DESIGN.md section 13): no
# gradients, no optimizer state, no reduction, still sharded. PyTorch trains the same transformers
# model with requires_grad off on the same parameters; the final weights (frozen ones unchanged)
# are judged too. Activation checkpointing behind a frozen embedding and first layer (the unit's
# input needs no gradient); a tied embedding and head trained through the head's name under TP.
set(_frozen "model.frozen=[\"model.embed_tokens.weight\", \"model.layers.0.*\", \"*norm*\"]")
set(frozen_runs)
foreach(cfg "n1;1;0" "s0_n2;2;0" "s1_n4;4;1" "s2_n2;2;2")
  list(GET cfg 0 tag)
  list(GET cfg 1 np)
  list(GET cfg 2 s)
  mfsdp_hf_run(hf_llama_frozen_${tag} ${np} llama distributed.zero_dp_strategy=${s} "${_frozen}")
  list(APPEND frozen_runs hf_llama_frozen_${tag})
endforeach()
mfsdp_hf_run(hf_llama_frozen_ac_s3_n2 2 llama distributed.zero_dp_strategy=3 distributed.activation_checkpointing=true
             "${_frozen}")
mfsdp_hf_run(hf_qwen2_trainable_tp2_s3_n4 4 qwen2 distributed.tp_size=2 distributed.zero_dp_strategy=3
             "model.trainable=[\"*.self_attn.*\", \"lm_head.weight\"]")
list(APPEND frozen_runs hf_llama_frozen_ac_s3_n2 hf_qwen2_trainable_tp2_s3_n4)
mfsdp_exported_run(hf_llama_frozen_final_s3_n4 4 main final.safetensors model.path=${HFX}/llama.pt
                   distributed.zero_dp_strategy=3 "${_frozen}")
set_tests_properties(run_hf_llama_frozen_final_s3_n4 PROPERTIES FIXTURES_REQUIRED "train;hf_models")
mfsdp_exported_run(hf_gemma_frozen_final_hsdp_s3_n4 4 main final.safetensors model.path=${HFX}/gemma.pt
                   distributed.zero_dp_strategy=3 distributed.dp_replicate_size=2 distributed.disable_bucketing=true
                   "model.trainable=[\"model.layers.1.mlp.*\"]")
set_tests_properties(run_hf_gemma_frozen_final_hsdp_s3_n4 PROPERTIES FIXTURES_REQUIRED "train;hf_models")
list(APPEND frozen_runs hf_llama_frozen_final_s3_n4 hf_gemma_frozen_final_hsdp_s3_n4)
mfsdp_oracle(hf_frozen RUNS ${frozen_runs})
add_test(NAME frozen_glob_matches_nothing
         COMMAND ${EXPECT} 2 "model.frozen=.*'*.layer.0.*' matches no parameter of .*llama.pt \\(parameters are named like model.embed_tokens.weight" --
                 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama.pt run_dir=${FX}/frozen_bad1
                 "model.frozen=[\"*.layer.0.*\"]")
add_test(NAME frozen_everything
         COMMAND ${EXPECT} 2 "no parameter of .*llama.pt is left to train" --
                 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama.pt run_dir=${FX}/frozen_bad2
                 "model.frozen=[\"*\"]")
set_tests_properties(frozen_glob_matches_nothing frozen_everything PROPERTIES FIXTURES_REQUIRED "train;hf_models")

# LoRA (PEFT): scripts/export_hf.py --lora-r wraps the transformers model with peft; mfsdp trains
# the adapters only (the file's mfsdp/trainable.json, PEFT's choice), against PEFT training the same
# model in PyTorch (the oracle rebuilds it with peft from the stored adapter config). Every strategy,
# 1-4 ranks, CP; GPT-2's Conv1D (fan_in_fan_out) and Qwen2's tied head with every linear adapted.
set(lora_runs)
foreach(cfg "llama_lora;n1;1;0" "llama_lora;s0_n4;4;0" "qwen2_lora;s1_n2;2;1" "gpt2_lora;s2_n2;2;2" "llama_lora;s3_n4;4;3")
  list(GET cfg 0 m)
  list(GET cfg 1 tag)
  list(GET cfg 2 np)
  list(GET cfg 3 s)
  mfsdp_hf_run(hf_${m}_${tag} ${np} ${m} distributed.zero_dp_strategy=${s})
  list(APPEND lora_runs hf_${m}_${tag})
endforeach()
mfsdp_hf_run(hf_qwen2_lora_cp2_s3_n2 2 qwen2_lora distributed.cp_size=2 distributed.zero_dp_strategy=3)
list(APPEND lora_runs hf_qwen2_lora_cp2_s3_n2)
# DoRA: lora_A, lora_B and each adapted layer's magnitude train (PEFT's DoRA forward, traced), at 1
# and 2 ranks and with CP; its exports below (merged: each row rescaled to its magnitude).
mfsdp_hf_run(hf_llama_dora_n1 1 llama_dora)
mfsdp_hf_run(hf_llama_dora_s3_n2 2 llama_dora distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_llama_dora_cp2_s1_n2 2 llama_dora distributed.cp_size=2 distributed.zero_dp_strategy=1)
list(APPEND lora_runs hf_llama_dora_n1 hf_llama_dora_s3_n2 hf_llama_dora_cp2_s1_n2)
add_test(NAME hf_dora_init_from_refused
         COMMAND ${EXPECT} 2 "has DoRA adapters .*whose magnitudes were computed from the base weights at export" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama_dora.pt
                 run_dir=${FX}/hf_dora_init model.init_from=${HFX}/llama_pretrained)
set_tests_properties(hf_dora_init_from_refused PROPERTIES FIXTURES_REQUIRED "train;hf_models;hf_init_weights" PROCESSORS 2
                     TIMEOUT 120)
add_test(NAME hf_dora_tp_refused
         COMMAND ${EXPECT} 2 "has DoRA adapters .*which mfsdp does not split over tensor parallelism" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama_dora.pt
                 run_dir=${FX}/hf_dora_tp distributed.tp_size=2
                 "distributed.tp_plan={'*.q_proj.base_layer': colwise}")
set_tests_properties(hf_dora_tp_refused PROPERTIES FIXTURES_REQUIRED "train;hf_models" PROCESSORS 2 TIMEOUT 120)
# export: the merged model for transformers, and --only-trainable PEFT's adapter directory for peft.
foreach(m qwen2_lora gpt2_lora llama_lora llama_dora mixtral_lora)
  mfsdp_hf_run(hf_${m}_ckpt_s3_n2 2 ${m} distributed.zero_dp_strategy=3 training.max_steps=6
               checkpoint.dir=${FX}/hf_${m}_ckpt_s3_n2/ckpt checkpoint.save_final=true checkpoint.resume=none)
  add_test(NAME hf_export_${m}
           COMMAND ${MFSDP_PYTHON} ${HF_CHECK} --mfsdp ${MFSDP_BIN} --checkpoint ${FX}/hf_${m}_ckpt_s3_n2/ckpt
                   --work ${FX}/hf_export_${m} --lora)
  set_tests_properties(hf_export_${m} PROPERTIES FIXTURES_REQUIRED runs_hf_${m}_ckpt_s3_n2 TIMEOUT 300)
endforeach()
set_tests_properties(hf_export_llama_lora PROPERTIES FIXTURES_SETUP hf_llama_adapter)
# An adapter directory trained on: export_hf.py --model-dir (a save_pretrained Llama) --adapter-dir
# (the adapter mfsdp exported above), trained again at 2 ranks against PEFT.
add_test(NAME hf_export_adapter_dir
         COMMAND ${MFSDP_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/export_hf.py --model-dir ${HFX}/llama_pretrained
                 --adapter-dir ${FX}/hf_export_llama_lora/adapter --out ${HFX}/llama_adapter.pt)
set_tests_properties(hf_export_adapter_dir PROPERTIES FIXTURES_REQUIRED "hf_llama_adapter;hf_init_weights"
                     FIXTURES_SETUP hf_llama_adapter_pt TIMEOUT 300)
mfsdp_hf_run(hf_llama_adapter_s3_n2 2 llama_adapter distributed.zero_dp_strategy=3)
set_tests_properties(run_hf_llama_adapter_s3_n2 PROPERTIES FIXTURES_REQUIRED "train;hf_models;hf_llama_adapter_pt")
list(APPEND lora_runs hf_llama_adapter_s3_n2)
# A LoRA model exported without weights (--random-init), its base weights from the save_pretrained
# directory by their transformers names (model.init_from), the adapters kept as exported.
add_test(NAME hf_export_lora_random_init
         COMMAND ${MFSDP_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/export_hf.py --model-dir ${HFX}/llama_pretrained --random-init
                 --lora-r 4 --lora-targets q_proj k_proj v_proj o_proj --out ${HFX}/llama_lora_ri.pt)
set_tests_properties(hf_export_lora_random_init PROPERTIES FIXTURES_REQUIRED hf_init_weights FIXTURES_SETUP hf_llama_lora_ri
                     TIMEOUT 300)
mfsdp_hf_run(hf_llama_lora_init_s3_n2 2 llama_lora_ri distributed.zero_dp_strategy=3
             model.init_from=${HFX}/llama_pretrained)
set_tests_properties(run_hf_llama_lora_init_s3_n2 PROPERTIES FIXTURES_REQUIRED "train;hf_models;hf_llama_lora_ri")
list(APPEND lora_runs hf_llama_lora_init_s3_n2)
mfsdp_oracle(hf_lora RUNS ${lora_runs})
add_test(NAME hf_export_only_trainable_needs_lora
         COMMAND ${EXPECT} 2 "export --only-trainable --format hf writes a PEFT adapter directory, but .* is no LoRA model" --
                 ${MFSDP_BIN} export --checkpoint ${FX}/hf_qwen2_ckpt_s1_n2/ckpt --format hf --only-trainable
                 --out ${FX}/hf_export_not_lora)
set_tests_properties(hf_export_only_trainable_needs_lora PROPERTIES FIXTURES_REQUIRED runs_hf_qwen2_ckpt_s1_n2)
# LoRA under TP (the plan moved onto PEFT's names: lora_B split with a colwise base, lora_A with a
# rowwise one, a colwise layer's lora_A gradient summed over TP), with SP too.
mfsdp_hf_run(hf_qwen2_lora_tp2_s3_n4 4 qwen2_lora distributed.tp_size=2 distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_llama_lora_tp2_sp_s1_n4 4 llama_lora distributed.tp_size=2 distributed.sequence_parallel=true
             distributed.zero_dp_strategy=1)
mfsdp_oracle(hf_lora_tp RUNS hf_qwen2_lora_tp2_s3_n4 hf_llama_lora_tp2_sp_s1_n4)
add_test(NAME hf_lora_tp_refused
         COMMAND ${EXPECT} 2 "there is no tensor-parallel plan" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/gpt2_lora.pt
                 run_dir=${FX}/hf_lora_tp distributed.tp_size=2)
set_tests_properties(hf_lora_tp_refused PROPERTIES FIXTURES_REQUIRED "train;hf_models" PROCESSORS 2 TIMEOUT 120)

# Sequence parallelism: the stored plan marks each attention and MLP block sequence_gathered (the
# sequence gathered at its input, reduce-scattered by its rowwise output layer) and the norms
# sequence_parallel; with SP, CP and every strategy, against PyTorch (Phi-3: colwise_rep layers inside
# the gathered blocks).
set(sp_runs)
foreach(cfg "llama;tp2_sp_s3_n4;4;3" "qwen3;tp2_sp_n2;2;0" "qwen2;tp2_sp_s1_n4;4;1" "mistral;tp2_sp_s2_n2;2;2"
            "phi3;tp2_sp_s1_n4;4;1" "gpt_neox;tp2_sp_s3_n2;2;3" "phi;tp2_sp_s1_n2;2;1" "gemma2;tp2_sp_n2;2;0")
  list(GET cfg 0 m)
  list(GET cfg 1 tag)
  list(GET cfg 2 np)
  list(GET cfg 3 s)
  mfsdp_hf_run(hf_${m}_${tag} ${np} ${m} distributed.tp_size=2 distributed.sequence_parallel=true
               distributed.zero_dp_strategy=${s})
  list(APPEND sp_runs hf_${m}_${tag})
endforeach()
mfsdp_hf_run(hf_gemma_tp2_sp_cp2_s3_n4 4 gemma distributed.tp_size=2 distributed.sequence_parallel=true distributed.cp_size=2
             distributed.zero_dp_strategy=3)
list(APPEND sp_runs hf_gemma_tp2_sp_cp2_s3_n4)
# GPT-2 views the final norm's output to the input's (whole-sequence) shape: its plan's ln_f is
# sequence_parallel_gather, and the output head after it takes the gathered value.
mfsdp_hf_run(hf_gpt2_tp2_sp_cp2_s2_n4 4 gpt2 distributed.tp_size=2 distributed.sequence_parallel=true distributed.cp_size=2
             distributed.zero_dp_strategy=2)
list(APPEND sp_runs hf_gpt2_tp2_sp_cp2_s2_n4)
mfsdp_oracle(hf_sequence_parallel RUNS ${sp_runs})
# Without sequence_gathered, HF attention reshapes a gathered projection by its split input's length:
# an error that names the missing style (never a wrong run).
set(_no_gather "{\"model.layers.*.self_attn.q_proj\": colwise, \"model.layers.*.self_attn.k_proj\": colwise, \"model.layers.*.self_attn.v_proj\": colwise, \"model.layers.*.self_attn.o_proj\": rowwise, \"model.layers.*.mlp.gate_proj\": colwise, \"model.layers.*.mlp.up_proj\": colwise, \"model.layers.*.mlp.down_proj\": rowwise, \"model.layers.*.input_layernorm\": sequence_parallel, \"model.layers.*.post_attention_layernorm\": sequence_parallel, \"model.norm\": sequence_parallel, \"model.embed_tokens\": vocab_parallel, \"lm_head\": colwise}")
add_test(NAME hf_sequence_parallel_needs_gathered_blocks
         COMMAND ${EXPECT} 2 "needs the style sequence_gathered in the plan" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama.pt run_dir=${FX}/hf_sp
                 distributed.tp_size=2 distributed.sequence_parallel=true "distributed.tp_plan=${_no_gather}")

# A model exported in bf16 (export_hf.py --dtype bf16) trains with bf16 compute and fp32 main
# weights, with TP and with CP, against PyTorch training the transformers model so (measured at most
# 1.7e-4; bound 2e-3, tighter than the oracle's bf16 default of 1e-2). A trace keeps its dtype's
# casts, so a compute dtype other than the traced one is an error naming model.compute_dtype.
set(_hf_bf16 model.compute_dtype=bf16 distributed.preserve_fp32_weights=true distributed.grad_reduce_in_fp32=true)
mfsdp_hf_run(hf_llama_bf16_s3_n2 2 llama_bf16 ${_hf_bf16} distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_llama_bf16_tp2_s1_n2 2 llama_bf16 ${_hf_bf16} distributed.tp_size=2 distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_llama_bf16_cp2_s3_n2 2 llama_bf16 ${_hf_bf16} distributed.cp_size=2 distributed.zero_dp_strategy=3)
mfsdp_oracle(hf_bf16_export RUNS hf_llama_bf16_s3_n2 hf_llama_bf16_tp2_s1_n2 hf_llama_bf16_cp2_s3_n2 ARGS --bf16-rtol 2e-3)
add_test(NAME hf_bf16_trace_fp32_compute_refused
         COMMAND ${EXPECT} 2 "model.compute_dtype is fp32, but .*llama_bf16.pt was traced in bf16 by scripts/export_hf.py" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama_bf16.pt
                 run_dir=${FX}/hf_bf16_fp32)
add_test(NAME hf_fp32_trace_bf16_compute_refused
         COMMAND ${EXPECT} 2 "model.compute_dtype is bf16, but .*llama.pt was traced in fp32 by scripts/export_hf.py" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama.pt
                 run_dir=${FX}/hf_fp32_bf16 model.compute_dtype=bf16)
set_tests_properties(hf_bf16_trace_fp32_compute_refused hf_fp32_trace_bf16_compute_refused PROPERTIES
                     FIXTURES_REQUIRED "train;hf_models" PROCESSORS 2 TIMEOUT 120)

# What is not supported says so (never a silently wrong run): context parallelism of a
# sliding-window model (by the window export_hf.py records from the config; for a file without
# that record, by the mask the replaced sdpa call receives), TP of a family whose plan mfsdp cannot
# apply.
add_test(NAME hf_context_parallel_sliding_window_refused
         COMMAND ${EXPECT} 2 "restricts every layer to a window of 8 tokens \\(sliding_window 8\\), shorter than training.seq_length 32" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/mistral_sw.pt run_dir=${FX}/hf_cp
                 distributed.cp_size=2)
add_test(NAME hf_strip_attention_window
         COMMAND ${MFSDP_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/hf/strip_attention_window.py ${HFX}/mistral_sw.pt
                 ${HFX}/mistral_sw_norecord.pt)
set_tests_properties(hf_strip_attention_window PROPERTIES FIXTURES_REQUIRED hf_models FIXTURES_SETUP hf_mistral_sw_norecord)
add_test(NAME hf_context_parallel_sliding_mask_refused
         COMMAND ${EXPECT} 2 "the scaled_dot_product_attention call in model.layers.0.self_attn.forward has an attention mask that is not causal" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/mistral_sw_norecord.pt
                 run_dir=${FX}/hf_cp_mask distributed.cp_size=2)
# Llama 4's chunked attention: chunks of 8 tokens build the same mask on a rank's two 8-token CP
# chunks as HF builds from CP's position ids, so only the recorded window can refuse it.
add_test(NAME hf_context_parallel_chunked_attention_refused
         COMMAND ${EXPECT} 2 "restricts layers 0, 1 to a window of 8 tokens \\(layer_types chunked_attention, attention_chunk_size 8\\)" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama4_text.pt run_dir=${FX}/hf_cp_chunked
                 distributed.cp_size=2)
set_tests_properties(hf_sequence_parallel_needs_gathered_blocks hf_context_parallel_sliding_window_refused
                     hf_context_parallel_chunked_attention_refused PROPERTIES
                     FIXTURES_REQUIRED "train;hf_models" PROCESSORS 2 TIMEOUT 120)
set_tests_properties(hf_context_parallel_sliding_mask_refused PROPERTIES
                     FIXTURES_REQUIRED "train;hf_models;hf_mistral_sw_norecord" PROCESSORS 2 TIMEOUT 120)
# A custom autograd Function (BLOOM's GELU) traced through its forward, its gradients checked
# against its own backward; one whose backward is not the derivative refused.
add_test(NAME hf_export_custom_function
         COMMAND ${MFSDP_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/hf/check_inlined_functions.py ${PROJECT_SOURCE_DIR}
                 ${FX}/hf_custom_function)
set_tests_properties(hf_export_custom_function PROPERTIES TIMEOUT 300)
add_test(NAME hf_export_unknown_family
         COMMAND ${EXPECT} 1 "model type 'lama' is not one transformers" --
                 ${MFSDP_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/export_hf.py --family lama --out ${FX}/hf_bad.pt)
add_test(NAME hf_export_unknown_key
         COMMAND ${EXPECT} 1 "--set hiden_size: LlamaConfig has no key hiden_size" --
                 ${MFSDP_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/export_hf.py --family llama --set hiden_size=64 --out ${FX}/hf_bad.pt)
# --tp-plan none and --allow-new-keys: the key stored, no plan stored, and tp_size 2 on that file
# stops with the error asking for distributed.tp_plan.
add_test(NAME hf_export_options
         COMMAND ${MFSDP_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/hf/check_export_options.py ${PROJECT_SOURCE_DIR} ${HFX}/llama_noplan.pt)
set_tests_properties(hf_export_options PROPERTIES FIXTURES_REQUIRED hf_models FIXTURES_SETUP hf_noplan TIMEOUT 300)
add_test(NAME hf_no_plan_tp_refused
         COMMAND ${EXPECT} 2 "stores none \\(the exporter: no tensor-parallel plan \\(--tp-plan none\\)\\) and the config gives no distributed.tp_plan" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama_noplan.pt run_dir=${FX}/hf_noplan
                 distributed.tp_size=2)
set_tests_properties(hf_no_plan_tp_refused PROPERTIES FIXTURES_REQUIRED "train;hf_noplan" PROCESSORS 2 TIMEOUT 120)
add_test(NAME hf_export_dir_without_weights
         COMMAND ${EXPECT} 1 "no weights \\(model.safetensors or its index\\); --random-init" --
                 ${MFSDP_PYTHON} ${PROJECT_SOURCE_DIR}/scripts/export_hf.py --model-dir ${CMAKE_CURRENT_SOURCE_DIR}/hf/config_only
                 --out ${FX}/hf_bad.pt)

# export --format hf: checkpoints of TP x FSDP runs (pieces on every rank) written as Hugging Face
# directories that transformers loads with mfsdp's logits (tests/hf/check_hf_export.py): sharded
# with an index (gemma, tied head, tp 2 x dp_shard 2), one file (qwen2, tied, biases), bf16.
mfsdp_hf_run(hf_gemma_ckpt_tp2_s3_n4 4 gemma distributed.tp_size=2 distributed.zero_dp_strategy=3 training.max_steps=5
             checkpoint.dir=${FX}/hf_gemma_ckpt_tp2_s3_n4/ckpt checkpoint.save_final=true checkpoint.resume=none)
mfsdp_hf_run(hf_qwen2_ckpt_s1_n2 2 qwen2 distributed.zero_dp_strategy=1 training.max_steps=5
             checkpoint.dir=${FX}/hf_qwen2_ckpt_s1_n2/ckpt checkpoint.save_final=true checkpoint.resume=none)
add_test(NAME hf_export_sharded
         COMMAND ${MFSDP_PYTHON} ${HF_CHECK} --mfsdp ${MFSDP_BIN} --checkpoint ${FX}/hf_gemma_ckpt_tp2_s3_n4/ckpt
                 --work ${FX}/hf_export_sharded --max-shard-size 100KB --expect-shards 5)
set_tests_properties(hf_export_sharded PROPERTIES FIXTURES_REQUIRED runs_hf_gemma_ckpt_tp2_s3_n4 TIMEOUT 300)
add_test(NAME hf_export_one_file
         COMMAND ${MFSDP_PYTHON} ${HF_CHECK} --mfsdp ${MFSDP_BIN} --checkpoint ${FX}/hf_qwen2_ckpt_s1_n2/ckpt
                 --work ${FX}/hf_export_one_file)
add_test(NAME hf_export_bf16
         COMMAND ${MFSDP_PYTHON} ${HF_CHECK} --mfsdp ${MFSDP_BIN} --checkpoint ${FX}/hf_qwen2_ckpt_s1_n2/ckpt
                 --work ${FX}/hf_export_bf16 --dtype bfloat16)
set_tests_properties(hf_export_one_file hf_export_bf16 PROPERTIES FIXTURES_REQUIRED runs_hf_qwen2_ckpt_s1_n2 TIMEOUT 300)
# GPT-2 under TP: Conv1D weights ([in, out]) split along out (c_attn's three packed parts) or in.
mfsdp_hf_run(hf_gpt2_ckpt_tp2_s3_n4 4 gpt2 distributed.tp_size=2 distributed.zero_dp_strategy=3 training.max_steps=3
             checkpoint.dir=${FX}/hf_gpt2_ckpt_tp2_s3_n4/ckpt checkpoint.save_final=true checkpoint.resume=none)
add_test(NAME hf_export_gpt2_tp
         COMMAND ${MFSDP_PYTHON} ${HF_CHECK} --mfsdp ${MFSDP_BIN} --checkpoint ${FX}/hf_gpt2_ckpt_tp2_s3_n4/ckpt
                 --work ${FX}/hf_export_gpt2_tp)
set_tests_properties(hf_export_gpt2_tp PROPERTIES FIXTURES_REQUIRED runs_hf_gpt2_ckpt_tp2_s3_n4 TIMEOUT 300)
# A vocabulary that tp_size does not divide (267): the tied embedding and head padded to 134 rows
# per rank at TP 2 and 67 at TP 4 (the last rank 66 real), the padding logits masked from the loss
# (TpSplit, DESIGN.md section 5); checkpointed at TP 2 + SP, resumed on one rank, exported to HF.
mfsdp_hf_run(hf_gpt2_v267_tp2_sp_s3_n4 4 gpt2_v267 distributed.tp_size=2 distributed.sequence_parallel=true
             distributed.zero_dp_strategy=3 checkpoint.dir=${FX}/hf_gpt2_v267_tp2_sp_s3_n4/ckpt checkpoint.save_every=10
             checkpoint.resume=none)
mfsdp_hf_run(hf_gpt2_v267_tp4_s1_n4 4 gpt2_v267 distributed.tp_size=4 distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_gpt2_v267_resume_n1 1 gpt2_v267 checkpoint.dir=${FX}/hf_gpt2_v267_resume_n1/ckpt checkpoint.resume=auto
             checkpoint.save_final=false
             checkpoint.save_every=100)
add_test(NAME hf_gpt2_v267_resume_copy
         COMMAND ${CMAKE_COMMAND} -E copy_directory ${FX}/hf_gpt2_v267_tp2_sp_s3_n4/ckpt/step_00000010
                 ${FX}/hf_gpt2_v267_resume_n1/ckpt/step_00000010)
set_tests_properties(hf_gpt2_v267_resume_copy PROPERTIES FIXTURES_REQUIRED runs_hf_gpt2_v267_tp2_sp_s3_n4
                     FIXTURES_SETUP hf_gpt2_v267_resume_copy)
set_tests_properties(run_hf_gpt2_v267_resume_n1 PROPERTIES FIXTURES_REQUIRED "train;hf_models;hf_gpt2_v267_resume_copy")
add_test(NAME hf_gpt2_v267_resumed_equals_uninterrupted
         COMMAND ${MFSDP_PYTHON} ${CMP} ${FX}/hf_gpt2_v267_tp2_sp_s3_n4 ${FX}/hf_gpt2_v267_resume_n1 --after 10 --rtol 1e-5)
set_tests_properties(hf_gpt2_v267_resumed_equals_uninterrupted PROPERTIES FIXTURES_REQUIRED
                     "runs_hf_gpt2_v267_tp2_sp_s3_n4;runs_hf_gpt2_v267_resume_n1")
add_test(NAME hf_export_gpt2_v267
         COMMAND ${MFSDP_PYTHON} ${HF_CHECK} --mfsdp ${MFSDP_BIN} --checkpoint ${FX}/hf_gpt2_v267_tp2_sp_s3_n4/ckpt
                 --work ${FX}/hf_export_gpt2_v267)
set_tests_properties(hf_export_gpt2_v267 PROPERTIES FIXTURES_REQUIRED runs_hf_gpt2_v267_tp2_sp_s3_n4 TIMEOUT 300)
mfsdp_oracle(hf_padded_vocab RUNS hf_gpt2_v267_tp2_sp_s3_n4 hf_gpt2_v267_tp4_s1_n4)
# Only a vocabulary is padded: an uneven split of another colwise layer is refused, naming it.
add_test(NAME hf_uneven_split_refused
         COMMAND ${EXPECT} 2 "parameter model.layers.0.self_attn.q_proj.weight has shape \\[64, 64\\]: colwise cuts dimension 0 into tp_size 3 parts and 64 is not divisible by 3; mfsdp pads an uneven split only for a vocabulary" --
                 ${MFSDP_MPIRUN} -np 3 ${MFSDP_BIN} train -c ${FX}/base.yaml run_dir=${FX}/hf_uneven_split
                 model.path=${HFX}/llama.pt distributed.tp_size=3
                 "distributed.tp_plan={\"model.layers.*.self_attn.q_proj\": colwise}")
set_tests_properties(hf_uneven_split_refused PROPERTIES FIXTURES_REQUIRED "train;hf_models" PROCESSORS 3)
# Fewer key/value heads than TP ranks: the first forward's failed head view is reported with the
# config's head counts that tp_size does not divide.
add_test(NAME hf_kv_heads_tp4_refused
         COMMAND ${EXPECT} 2 "the model's config \\(mfsdp/hf_config.json\\): num_key_value_heads 2, not divisible by tp_size 4" --
                 ${MFSDP_MPIRUN} -np 4 ${MFSDP_BIN} train -c ${FX}/base.yaml run_dir=${FX}/hf_kv_heads_tp4
                 model.path=${HFX}/llama.pt distributed.tp_size=4)
set_tests_properties(hf_kv_heads_tp4_refused PROPERTIES FIXTURES_REQUIRED "train;hf_models" PROCESSORS 4)
# A training.seq_length past a learned position table: the first forward's index error is reported
# with the config's position limits.
add_test(NAME hf_seq_past_positions_refused
         COMMAND ${EXPECT} 2 "index out of range in self \\(the model's config, mfsdp/hf_config.json: .*n_positions 128, shorter than training.seq_length 256" --
                 ${MFSDP_BIN} train -c ${FX}/base.yaml run_dir=${FX}/hf_seq_past_positions
                 model.path=${HFX}/gpt2.pt training.seq_length=256)
set_tests_properties(hf_seq_past_positions_refused PROPERTIES FIXTURES_REQUIRED "train;hf_models")
# Mixtral under TP + SP: every expert's slices of the 3-D gate_up_proj (two packed parts) and
# down_proj written back as the whole tensors transformers loads.
mfsdp_hf_run(hf_mixtral_ckpt_tp2_sp_s3_n4 4 mixtral distributed.tp_size=2 distributed.sequence_parallel=true
             distributed.zero_dp_strategy=3 training.max_steps=3 checkpoint.dir=${FX}/hf_mixtral_ckpt_tp2_sp_s3_n4/ckpt
             checkpoint.save_final=true checkpoint.resume=none)
add_test(NAME hf_export_mixtral_tp
         COMMAND ${MFSDP_PYTHON} ${HF_CHECK} --mfsdp ${MFSDP_BIN} --checkpoint ${FX}/hf_mixtral_ckpt_tp2_sp_s3_n4/ckpt
                 --work ${FX}/hf_export_mixtral_tp)
set_tests_properties(hf_export_mixtral_tp PROPERTIES FIXTURES_REQUIRED runs_hf_mixtral_ckpt_tp2_sp_s3_n4 TIMEOUT 300)
add_test(NAME hf_export_needs_hf_model
         COMMAND ${EXPECT} 2 "holds no mfsdp/hf_config.json, so it is no Hugging Face model" --
                 ${MFSDP_BIN} export --checkpoint ${FX}/grad_np1/ckpt --format hf --out ${FX}/hf_export_not_hf)
set_tests_properties(hf_export_needs_hf_model PROPERTIES FIXTURES_REQUIRED runs_grad_np1)
add_test(NAME hf_export_refuses_full_dir
         COMMAND ${EXPECT} 2 "exists and is not an empty directory" --
                 ${MFSDP_BIN} export --checkpoint ${FX}/hf_qwen2_ckpt_s1_n2/ckpt --format hf --out ${CMAKE_CURRENT_SOURCE_DIR}/hf)
set_tests_properties(hf_export_refuses_full_dir PROPERTIES FIXTURES_REQUIRED runs_hf_qwen2_ckpt_s1_n2)

# model.init_from: a save_pretrained directory (bf16 shards + index) into the HF Llama at tp 2 x
# dp_shard 2 (each rank reads its slices), and a renamed safetensors file into the project's own
# Llama on the meta device (the full model never built); both against PyTorch with those weights.
add_test(NAME hf_init_weights COMMAND ${MFSDP_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/hf/make_init_weights.py ${HFX} ${FX})
set_tests_properties(hf_init_weights PROPERTIES FIXTURES_REQUIRED "train;hf_models" FIXTURES_SETUP hf_init_weights TIMEOUT 300)
mfsdp_hf_run(hf_llama_init_tp2_s3_n4 4 llama distributed.tp_size=2 distributed.zero_dp_strategy=3
             model.init_from=${HFX}/llama_pretrained)
# The same on the meta device: a traced HF model (tensor constants, rotary buffers) loaded without
# its parameters' bytes.
mfsdp_hf_run(hf_llama_init_meta_tp2_s3_n4 4 llama distributed.tp_size=2 distributed.zero_dp_strategy=3
             model.init_from=${HFX}/llama_pretrained distributed.init_fsdp_with_meta_device=true)
mfsdp_train_run(llama_init_meta_s3_n2 2 model.path=${FX}/llama.pt distributed.zero_dp_strategy=3
                distributed.init_fsdp_with_meta_device=true model.init_from=${FX}/llama_renamed.safetensors
                "model.init_from_rename=[\"^backbone\\\\.rotary\\\\.inv_freq$=\", \"^backbone\\\\.=\"]")
# Mixtral's directory in the hub's layout (per-expert tensors under block_sparse_moe): the exporter
# stored transformers' conversion (checkpoint_layout), so mfsdp stacks each rank's slices of the
# experts from the pieces, under TP (each rank's part of every expert's intermediate dimension) and
# on the meta device; the oracle loads the directory with transformers' from_pretrained.
mfsdp_hf_run(hf_mixtral_init_tp2_s3_n4 4 mixtral distributed.tp_size=2 distributed.zero_dp_strategy=3
             model.init_from=${HFX}/mixtral_pretrained)
mfsdp_hf_run(hf_mixtral_init_meta_s3_n2 2 mixtral distributed.zero_dp_strategy=3
             model.init_from=${HFX}/mixtral_pretrained distributed.init_fsdp_with_meta_device=true)
set_tests_properties(run_hf_llama_init_tp2_s3_n4 run_hf_llama_init_meta_tp2_s3_n4 run_llama_init_meta_s3_n2
                     run_hf_mixtral_init_tp2_s3_n4 run_hf_mixtral_init_meta_s3_n2 PROPERTIES
                     FIXTURES_REQUIRED "train;hf_models;hf_init_weights")
# DeepSeek V3's directory: per-expert tensors and the routers' e_score_correction_bias buffers
# (which pick the experts; loaded whole on every rank), TP 2 + SP; checkpointed (rank 0 saves the
# buffers), resumed at another layout, and exported: the buffers come back, and the export holds
# what save_pretrained writes with mfsdp's logits (check_hf_export).
mfsdp_hf_run(hf_deepseek_v3_init_tp2_sp_s3_n4 4 deepseek_v3 distributed.tp_size=2 distributed.sequence_parallel=true
             distributed.zero_dp_strategy=3 model.init_from=${HFX}/deepseek_v3_pretrained
             checkpoint.dir=${FX}/hf_deepseek_v3_init_tp2_sp_s3_n4/ckpt checkpoint.save_every=10 checkpoint.resume=none)
mfsdp_hf_run(hf_deepseek_v3_init_resume_s1_n2 2 deepseek_v3 distributed.zero_dp_strategy=1
             model.init_from=${HFX}/deepseek_v3_pretrained training.max_steps=20
             checkpoint.dir=${FX}/hf_deepseek_v3_init_resume_s1_n2/ckpt checkpoint.resume=auto
             checkpoint.save_every=100)
set_tests_properties(run_hf_deepseek_v3_init_tp2_sp_s3_n4 run_hf_deepseek_v3_init_resume_s1_n2 PROPERTIES
                     FIXTURES_REQUIRED "train;hf_models;hf_init_weights")
add_test(NAME hf_deepseek_v3_resume_copy
         COMMAND ${CMAKE_COMMAND} -E copy_directory ${FX}/hf_deepseek_v3_init_tp2_sp_s3_n4/ckpt/step_00000010
                 ${FX}/hf_deepseek_v3_init_resume_s1_n2/ckpt/step_00000010)
set_tests_properties(hf_deepseek_v3_resume_copy PROPERTIES FIXTURES_REQUIRED runs_hf_deepseek_v3_init_tp2_sp_s3_n4
                     FIXTURES_SETUP hf_deepseek_v3_resume_copy)
set_tests_properties(run_hf_deepseek_v3_init_resume_s1_n2 PROPERTIES FIXTURES_REQUIRED
                     "train;hf_models;hf_init_weights;hf_deepseek_v3_resume_copy")
# OLMo-Hybrid's directory: norms renamed and three convolutions concatenated along dim 0 into one
# (transformers' Concatenate, saved back as torch.chunk cuts it), read by each rank's slices under
# TP 2 + SP; its export holds what save_pretrained writes.
mfsdp_hf_run(hf_olmo_hybrid_init_tp2_sp_s3_n4 4 olmo_hybrid distributed.tp_size=2 distributed.sequence_parallel=true
             distributed.zero_dp_strategy=3 model.init_from=${HFX}/olmo_hybrid_pretrained
             checkpoint.dir=${FX}/hf_olmo_hybrid_init_tp2_sp_s3_n4/ckpt checkpoint.save_final=true checkpoint.resume=none)
set_tests_properties(run_hf_olmo_hybrid_init_tp2_sp_s3_n4 PROPERTIES FIXTURES_REQUIRED "train;hf_models;hf_init_weights")
add_test(NAME hf_export_olmo_hybrid_init
         COMMAND ${MFSDP_PYTHON} ${HF_CHECK} --mfsdp ${MFSDP_BIN} --checkpoint ${FX}/hf_olmo_hybrid_init_tp2_sp_s3_n4/ckpt
                 --work ${FX}/hf_export_olmo_hybrid_init)
set_tests_properties(hf_export_olmo_hybrid_init PROPERTIES FIXTURES_REQUIRED runs_hf_olmo_hybrid_init_tp2_sp_s3_n4 TIMEOUT 300)
add_test(NAME hf_export_deepseek_v3_init
         COMMAND ${MFSDP_PYTHON} ${HF_CHECK} --mfsdp ${MFSDP_BIN} --checkpoint ${FX}/hf_deepseek_v3_init_tp2_sp_s3_n4/ckpt
                 --work ${FX}/hf_export_deepseek_v3_init)
set_tests_properties(hf_export_deepseek_v3_init PROPERTIES FIXTURES_REQUIRED runs_hf_deepseek_v3_init_tp2_sp_s3_n4 TIMEOUT 300)
add_test(NAME hf_deepseek_v3_resumed_equals_uninterrupted
         COMMAND ${MFSDP_PYTHON} ${CMP} ${FX}/hf_deepseek_v3_init_tp2_sp_s3_n4 ${FX}/hf_deepseek_v3_init_resume_s1_n2
                 --after 10 --rtol 1e-5)
set_tests_properties(hf_deepseek_v3_resumed_equals_uninterrupted PROPERTIES FIXTURES_REQUIRED
                     "runs_hf_deepseek_v3_init_tp2_sp_s3_n4;runs_hf_deepseek_v3_init_resume_s1_n2")
# GPT-2's hub checkpoint layout: the base model's names (no "transformer." prefix) and the old
# attn.bias buffers, both forgiven as from_pretrained forgives them (hf_export.json
# base_model_prefix, ignore_unexpected); TP 2 with the tied head on the meta device.
mfsdp_hf_run(hf_gpt2_init_base_tp2_s3_n4 4 gpt2 distributed.tp_size=2 distributed.zero_dp_strategy=3
             distributed.init_fsdp_with_meta_device=true model.init_from=${HFX}/gpt2_base_pretrained)
set_tests_properties(run_hf_gpt2_init_base_tp2_s3_n4 PROPERTIES FIXTURES_REQUIRED "train;hf_models;hf_init_weights")
mfsdp_oracle(init_from RUNS hf_gpt2_init_base_tp2_s3_n4 hf_llama_init_tp2_s3_n4 hf_llama_init_meta_tp2_s3_n4 llama_init_meta_s3_n2
             hf_mixtral_init_tp2_s3_n4 hf_mixtral_init_meta_s3_n2 hf_deepseek_v3_init_tp2_sp_s3_n4
             hf_olmo_hybrid_init_tp2_sp_s3_n4)
# A piece of a stacked parameter missing from the directory: named with the parameter.
add_test(NAME init_from_stack_piece_missing
         COMMAND ${EXPECT} 2 "missing \\(in the model, not in the files\\): model.layers.1.mlp.experts.down_proj \\(the pieces model.layers.1.mlp.experts.3.w2.weight\\)" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/mixtral.pt run_dir=${FX}/init_bad_stack
                 model.init_from=${HFX}/mixtral_pretrained "model.init_from_rename=[\"^model\\\\.layers\\\\.1\\\\.block_sparse_moe\\\\.experts\\\\.3\\\\.w2\\\\.weight$=\"]")
set_tests_properties(init_from_stack_piece_missing PROPERTIES FIXTURES_REQUIRED "train;hf_models;hf_init_weights"
                     PROCESSORS 2 TIMEOUT 120)
add_test(NAME init_from_names_do_not_fit
         COMMAND ${EXPECT} 2 "model.init_from does not fit .*missing \\(in the model, not in the files\\): embed_tokens.weight.*unexpected \\(in the files, not in the model\\): backbone" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${FX}/llama.pt run_dir=${FX}/init_bad
                 model.init_from=${FX}/llama_renamed.safetensors)
add_test(NAME init_from_no_weights_in_dir
         COMMAND ${EXPECT} 2 "model.init_from: the directory holds neither model.safetensors nor model.safetensors.index.json" --
                 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${FX}/llama.pt run_dir=${FX}/init_bad2
                 model.init_from=${CMAKE_CURRENT_SOURCE_DIR}/hf/config_only)
set_tests_properties(init_from_names_do_not_fit init_from_no_weights_in_dir PROPERTIES
                     FIXTURES_REQUIRED "train;hf_init_weights" PROCESSORS 2 TIMEOUT 120)
add_test(NAME init_from_bad_rename
         COMMAND ${EXPECT} 2 "model.init_from_rename: expected rules \"REGEX=REPLACEMENT\"" --
                 ${MFSDP_BIN} validate "model.init_from_rename=[\"(unclosed=x\"]")

# Dropout kept (export_hf.py --dropout config: GPT-2's embd/resid/attn_pdrop 0.1, traced in
# training mode; mfsdp makes the traced calls follow train/eval). Each data-parallel rank draws
# from its own generator (training.seed + 100003 x rank), which the oracle reproduces rank by rank:
# losses within 1e-5 of PyTorch training the transformers model with the same masks, at 1 rank,
# under strategy 3 (with activation checkpointing replaying the masks), HSDP, and LoRA dropout
# against PEFT. At TP 2 the ranks share a generator: hidden dropout (attention dropout 0) draws one
# process's masks. The scripted GPT's residual dropout (tests/train) is judged too.
mfsdp_hf_run(hf_gpt2_dropout_n1 1 gpt2_dropout)
mfsdp_hf_run(hf_gpt2_dropout_s3_n2 2 gpt2_dropout distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_gpt2_dropout_ac_s3_n2 2 gpt2_dropout distributed.zero_dp_strategy=3 distributed.activation_checkpointing=true)
mfsdp_hf_run(hf_gpt2_dropout_hsdp_s2_n4 4 gpt2_dropout distributed.dp_replicate_size=2 distributed.zero_dp_strategy=2)
mfsdp_hf_run(hf_gpt2_hdropout_tp2_s1_n2 2 gpt2_hdropout distributed.tp_size=2 distributed.zero_dp_strategy=1)
mfsdp_hf_run(hf_qwen2_lora_dropout_s3_n2 2 qwen2_lora_dropout distributed.zero_dp_strategy=3)
mfsdp_oracle(hf_dropout RUNS hf_gpt2_dropout_n1 hf_gpt2_dropout_s3_n2 hf_gpt2_dropout_ac_s3_n2 hf_gpt2_dropout_hsdp_s2_n4
             hf_gpt2_hdropout_tp2_s1_n2 hf_qwen2_lora_dropout_s3_n2 dropout_s0_n1 dropout_s3_n2 dropout_ac_s3_n2)
mfsdp_compare(hf_dropout_ac_bit_identical 0 hf_gpt2_dropout_s3_n2 hf_gpt2_dropout_ac_s3_n2)
# Eager attention traced as its ops (export_hf.py --attention eager_traced): transformers'
# eager_attention_forward written out (repeat_kv, the additive mask sliced to key_states.shape[-2],
# softmax in fp32, .to(dtype), dropout), taken by mfsdp's attention kernel (model/eager_attention.cpp)
# with the repeat dropped; GPT-2's attention dropout 0.1 drawn as PyTorch draws it. Against the
# transformers model with eager attention; the line says every call ran the kernel.
mfsdp_hf_run(hf_llama_eager_s3_n2 2 llama_eager distributed.zero_dp_strategy=3)
mfsdp_hf_run(hf_gpt2_eager_dropout_n1 1 gpt2_eager_dropout)
mfsdp_oracle(hf_eager_traced RUNS hf_llama_eager_s3_n2 hf_gpt2_eager_dropout_n1)
add_test(NAME hf_eager_traced_line
         COMMAND ${EXPECT} 0 "mfsdp's CPU attention: 0 scaled_dot_product_attention call\\(s\\) and 2 written out.*mfsdp's CPU attention: ([1-9][0-9]*) of \\1 calls ran its kernel \\(\\1 of them with an explicit causal mask, 0 with dropout, \\1 with fewer" --
                 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama_eager.pt run_dir=${FX}/hf_eager_line
                 training.max_steps=2)
set_tests_properties(hf_eager_traced_line PROPERTIES FIXTURES_REQUIRED "train;hf_models" TIMEOUT 120)
# What eager_traced promises: the file holds no mfsdp operator, so plain PyTorch loads it (a file
# with mfsdp::attention fails here: its op is unknown without scripts/mfsdp_ops.py).
add_test(NAME hf_eager_traced_loads_in_pytorch
         COMMAND ${MFSDP_PYTHON} -c "import sys, torch; torch.jit.load(sys.argv[1]); torch.jit.load(sys.argv[2])"
                 ${HFX}/llama_eager.pt ${HFX}/gpt2_eager_dropout.pt)
add_test(NAME hf_eager_operator_needs_mfsdp_ops
         COMMAND ${EXPECT} 1 "mfsdp::attention|mfsdp.attention|Unknown builtin op" --
                 ${MFSDP_PYTHON} -c "import sys, torch; torch.jit.load(sys.argv[1])" ${HFX}/gemma2.pt)
set_tests_properties(hf_eager_traced_loads_in_pytorch hf_eager_operator_needs_mfsdp_ops PROPERTIES
                     FIXTURES_REQUIRED hf_models TIMEOUT 120)
# Off in evaluation: at learning rate 0 the dropout file's validation loss is the dropout-free
# file's (same weights), while its training loss is not.
mfsdp_hf_run(hf_gpt2_lr0 1 gpt2 optimizer.lr=0 training.max_steps=4 training.eval_every=2)
mfsdp_hf_run(hf_gpt2_dropout_lr0 1 gpt2_dropout optimizer.lr=0 training.max_steps=4 training.eval_every=2)
add_test(NAME hf_dropout_off_in_eval COMMAND ${MFSDP_PYTHON} ${CMP} ${FX}/hf_gpt2_lr0 ${FX}/hf_gpt2_dropout_lr0 --key val_loss --rtol 1e-6)
add_test(NAME hf_dropout_on_in_training COMMAND ${MFSDP_PYTHON} ${CMP} ${FX}/hf_gpt2_lr0 ${FX}/hf_gpt2_dropout_lr0 --expect-differ --rtol 1e-5)
set_tests_properties(hf_dropout_off_in_eval hf_dropout_on_in_training PROPERTIES
                     FIXTURES_REQUIRED "runs_hf_gpt2_lr0;runs_hf_gpt2_dropout_lr0")
# Attention dropout under CP is refused (sdpa with dropout is not replaced); hidden dropout under
# CP trains, and the oracle says it cannot judge it (masks of a rank's part of the sequence).
add_test(NAME hf_context_parallel_attention_dropout_refused
         COMMAND ${EXPECT} 2 "scaled_dot_product_attention call in transformer.h.0.attn.forward has dropout" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/gpt2_dropout.pt run_dir=${FX}/hf_cp_drop
                 distributed.cp_size=2)
set_tests_properties(hf_context_parallel_attention_dropout_refused PROPERTIES
                     FIXTURES_REQUIRED "train;hf_models" PROCESSORS 2 TIMEOUT 120)
mfsdp_hf_run(hf_gpt2_hdropout_cp2_n2 2 gpt2_hdropout distributed.cp_size=2)
add_test(NAME oracle_hf_dropout_cp_not_judged
         COMMAND ${EXPECT} 2 "has cp 2: a rank's masks cover its part of the sequence" --
                 ${MFSDP_PYTHON} ${ORACLE} --runs ${FX}/hf_gpt2_hdropout_cp2_n2)
set_tests_properties(oracle_hf_dropout_cp_not_judged PROPERTIES FIXTURES_REQUIRED runs_hf_gpt2_hdropout_cp2_n2 TIMEOUT 300)
# The judge sees masks: attention dropout of a TP rank's heads draws other masks than one process
# does, and the comparison says so.
mfsdp_hf_run(hf_gpt2_dropout_tp2_s1_n2 2 gpt2_dropout distributed.tp_size=2 distributed.zero_dp_strategy=1)
mfsdp_oracle(hf_dropout_split_masks_differ RUNS hf_gpt2_dropout_tp2_s1_n2 ARGS --expect-differ)
# mfsdp's CPU kernels in HF models, and each knob that keeps ATen's: Gemma (GELU's tanh form,
# RMSNorm, rotary embedding) and Llama (RMSNorm, SwiGLU through the traced SiLUActivation call,
# rotary embedding of q and k).
set(G "GELU \\(tanh\\) call\\(s\\)")
set(R "RMSNorm scaling\\(s\\)")
set(S "SwiGLU gate\\(s\\)")
set(P "rotary embedding\\(s\\)")
foreach(knob "gemma;none;2 ${G}, 5 ${R}, 0 ${S}, 4 ${P}"
             "gemma;MFSDP_FAST_GELU;0 ${G}, 5 ${R}"
             "gemma;MFSDP_FAST_RMSNORM;2 ${G}, 0 ${R}"
             "llama;none;0 ${G}, 5 ${R}, 2 ${S}, 4 ${P}"
             "llama;MFSDP_FAST_SWIGLU;0 ${G}, 5 ${R}, 0 ${S}, 4 ${P}"
             "llama;MFSDP_FAST_ROTARY;0 ${G}, 5 ${R}, 2 ${S}, 0 ${P}")
  list(GET knob 0 model)
  list(GET knob 1 var)
  list(GET knob 2 want)
  set(name hf_cpu_kernels_off_${var})
  if(model STREQUAL "llama")
    set(name hf_cpu_kernels_llama_off_${var})
  endif()
  add_test(NAME ${name}
           COMMAND ${EXPECT} 0 "mfsdp's CPU kernels: ${want}" --
                   ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/${model}.pt run_dir=${FX}/${name}
                   training.max_steps=1)
  set_tests_properties(${name} PROPERTIES FIXTURES_REQUIRED "train;hf_models" TIMEOUT 120 ENVIRONMENT "${var}=off")
endforeach()
# mfsdp's CPU attention in an HF model: its SDPA calls pass transformers' causal mask explicitly,
# which the kernel recognises on every call (the run's count says all of them ran it).
add_test(NAME hf_cpu_attention_causal_mask
         COMMAND ${EXPECT} 0 "mfsdp's CPU attention: 2 scaled_dot_product_attention call\\(s\\).*mfsdp's CPU attention: ([1-9][0-9]*) of \\1 calls ran its kernel \\(\\1 of them with an explicit causal mask, 0 with dropout, \\1 with fewer key/value heads than query heads\\)" --
                 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama.pt run_dir=${FX}/hf_cpu_attention_causal_mask
                 training.max_steps=2)
set_tests_properties(hf_cpu_attention_causal_mask PROPERTIES FIXTURES_REQUIRED "train;hf_models" TIMEOUT 120)
# HF layers get the rotary cos/sin from the model as position_embeddings, through each unit's
# mfsdp::pre_forward, which leaves an input that needs no gradient needing none (fsdp/unit_ops.cpp,
# pass_through): every rotary call runs mfsdp's kernel (before, all of them ran ATen's, and autograd
# computed a gradient of each table). Two HF families, each with its rotary rewritten per layer.
foreach(m llama qwen2)
  add_test(NAME hf_rotary_kernel_runs_${m}
           COMMAND ${EXPECT} 0 "mfsdp's CPU kernels: [^\\n]* ([1-9][0-9]*) rotary embedding\\(s\\).*mfsdp's rotary embedding: ([1-9][0-9]*) of \\2 calls ran its kernel\\n" --
                   ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/${m}.pt run_dir=${FX}/hf_rotary_kernel_runs_${m}
                   training.max_steps=2)
  set_tests_properties(hf_rotary_kernel_runs_${m} PROPERTIES FIXTURES_REQUIRED "train;hf_models" TIMEOUT 120)
endforeach()
# GPT-2's Conv1D layers (aten::addmm(b, x, w), the weight stored [in, out]) write their gradients into
# the buckets as Linear layers do (model/linear.h, mfsdp::linear_t): 4 per layer type and the tied
# head, 9 in the 2-layer fixture (1, the head alone, before). Their gradients against PyTorch's:
# oracle_hf_families (hf_gpt2_s3_n2, hf_gpt2_cp2_s1_n2).
add_test(NAME hf_gpt2_conv1d_into_buckets
         COMMAND ${EXPECT} 0 "gradients: the products of 9 linear call site\\(s\\) write theirs into the buckets" --
                 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/gpt2.pt run_dir=${FX}/hf_gpt2_conv1d_into_buckets
                 training.max_steps=1)
set_tests_properties(hf_gpt2_conv1d_into_buckets PROPERTIES FIXTURES_REQUIRED "train;hf_models" TIMEOUT 120)
# MFSDP_FAST_ATTENTION=off: the run says so, replaces no call, and no call runs the kernel.
add_test(NAME hf_cpu_attention_off
         COMMAND ${EXPECT} 0 "\\A(?!.*mfsdp's CPU attention: [0-9]+ of [0-9]+ calls ran its kernel)(?!.*scaled_dot_product_attention call\\(s\\)).*mfsdp's CPU attention: off \\(MFSDP_FAST_ATTENTION=off\\)" --
                 ${MFSDP_BIN} train -c ${FX}/base.yaml model.path=${HFX}/llama.pt run_dir=${FX}/hf_cpu_attention_off
                 training.max_steps=2)
set_tests_properties(hf_cpu_attention_off PROPERTIES FIXTURES_REQUIRED "train;hf_models" TIMEOUT 120
                     ENVIRONMENT "MFSDP_FAST_ATTENTION=off")
# A unit called twice per forward whose second call the trace recorded as another graph (forward1:
# another constant) is refused, naming the call; one whose calls are one graph trains (Dory above).
add_test(NAME hf_repeat_model COMMAND ${MFSDP_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/hf/make_repeat_model.py ${FX}/repeat.pt)
set_tests_properties(hf_repeat_model PROPERTIES FIXTURES_SETUP repeat_model)
add_test(NAME hf_repeat_unit_refused
         COMMAND ${EXPECT} 2 "FSDP unit block is called more than once per forward.*block.forward1" --
                 ${MFSDP_MPIRUN} -np 2 ${MFSDP_BIN} train -c ${FX}/base.yaml run_dir=${FX}/hf_repeat_unit_refused
                 model.path=${FX}/repeat.pt distributed.zero_dp_strategy=3 "distributed.megatron_fsdp_unit_modules=[block]"
                 training.max_steps=1)
set_tests_properties(hf_repeat_unit_refused PROPERTIES FIXTURES_REQUIRED "train;repeat_model" PROCESSORS 2)
