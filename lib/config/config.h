// The experiment configuration: typed structs for every YAML section (DESIGN.md section 2).
// No torch and no yaml-cpp here, so that any file may include it cheaply.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mfsdp {

// Megatron-FSDP's zero_dp_strategy: what is sharded over the data-parallel shard group.
enum class ZeroDpStrategy : int {
  kNoShard = 0,           // replicate everything, all-reduce gradients
  kOptim = 1,             // shard main weights + optimizer state
  kOptimGrads = 2,        // ... and gradients (reduce-scatter every backward)
  kOptimGradsParams = 3,  // ... and compute weights (all-gather per unit)
};
const char* to_string(ZeroDpStrategy s);

// One style of distributed.tp_plan: the names of Hugging Face tp_plan / PyTorch parallelize_module.
//   colwise         weight rows (output features) and bias sharded; "colwise:3" or "colwise:512+128+128"
//                   shards each of the packed parts (fused q/k/v) separately
//   rowwise         weight columns (input features) sharded; output all-reduced, bias added once
//   colwise_rep     colwise, output gathered along the last dimension
//   vocab_parallel  embedding rows sharded; ids outside the shard masked; output all-reduced
//   sequence_parallel  replicated parameters on sequence-split activations (norms): with
//                   distributed.sequence_parallel their gradients are summed across the TP group
//   sequence_gathered  a block (attention, MLP) whose code reads the sequence length from its input,
//                   as Hugging Face's do: with distributed.sequence_parallel its hidden-state input is
//                   all-gathered along the sequence at its call (torchtitan's PrepareModuleInput),
//                   its colwise layers take it as it is, and its rowwise output layer reduce-scatters
//                   (RowwiseParallel(output_layouts=Shard(1))); without it, the block's input is
//                   copied once at its call (its colwise layers' copy, and its gradient's reduction)
//   moe_experts     a mixture-of-experts module holding every expert's weights as 3-D tensors, as
//                   Hugging Face's experts modules do (HF's moe_tp_experts with packed_colwise
//                   gate_up_proj and rowwise down_proj): each rank keeps every expert's slice of the
//                   intermediate dimension (gate_up_proj [E, 2I, H] in its two packed parts,
//                   down_proj [E, H, I]; or their transposes), its tensor inputs are copied to the TP
//                   region (all-gathered along the tokens under sequence parallelism) and its
//                   output, a partial sum, is all-reduced (reduce-scattered under SP)
//   replicate       nothing sharded (overrides a broader glob)
struct TpStyle {
  std::string kind;
  std::vector<int64_t> parts;  // colwise only: sizes of the packed parts, or {N} equal parts; empty: one
};
// Parses a style; returns "" or what was expected.
std::string parse_tp_style(const std::string& text, TpStyle& out);
using TpPlan = std::vector<std::pair<std::string, std::string>>;  // module-path glob -> style, in order

// Every MegatronFSDPConfig field of NeMo Automodel (same names and defaults), the mesh sizes,
// and `strategy`. Sizes: world = dp_replicate x dp_shard x cp x tp, dp = dp_replicate x dp_shard.
struct DistributedConfig {
  std::string strategy = "megatron_fsdp";
  std::optional<int64_t> dp_size;  // nullopt = auto (inferred from the world size)
  int64_t dp_replicate_size = 1;
  int64_t tp_size = 1;
  int64_t cp_size = 1;
  // Tensor parallelism: the plan (null: the one stored in the model file by its exporter) and
  // Megatron's sequence parallelism on top of it.
  std::optional<TpPlan> tp_plan;
  bool sequence_parallel = false;
  // Context parallelism replaces the calls of these modules (class names or module-path globs),
  // the model's attention core forward(q, k, v) on [B, heads, T, head_dim].
  std::vector<std::string> core_attention_modules = {"CoreAttention"};
  // How keys and values reach the other CP ranks (Transformer Engine's cp_comm_type names):
  // all_gather (whole sequence at once) or p2p (a ring of point-to-point exchanges overlapped
  // with the block computations).
  std::string cp_comm_type = "all_gather";

  // --- MegatronFSDPConfig (16 fields) ---
  std::optional<std::vector<std::string>> megatron_fsdp_unit_modules;  // null: auto-detect
  ZeroDpStrategy zero_dp_strategy = ZeroDpStrategy::kOptimGradsParams;
  bool init_fsdp_with_meta_device = false;
  bool grad_reduce_in_fp32 = false;
  bool preserve_fp32_weights = false;
  bool overlap_grad_reduce = true;
  bool overlap_param_gather = true;
  bool check_for_nan_in_grad = true;
  bool average_in_collective = false;
  bool disable_bucketing = false;
  bool calculate_per_token_loss = false;
  bool keep_fp8_transpose_cache = false;
  bool nccl_ub = false;
  bool fsdp_double_buffer = false;
  bool activation_checkpointing = false;
  bool report_nan_in_param_grad = false;

  // A collective that has not finished after this many seconds stops the job with a flight record.
  double timeout_s = 600;
  // Collectives on device tensors: nccl, or mpi (CUDA tensors staged through pinned host memory:
  // several ranks on one GPU, which NCCL refuses); auto: nccl when every local rank has a GPU of
  // its own, else mpi. CPU tensors (and control values on GPU runs) always go through MPI.
  std::string backend = "auto";
};

// One dataset of a (possibly weighted) blend. `path` is a Megatron prefix (path.bin + path.idx)
// or an llm.c token file (*.bin with the 256-int32 header).
struct DataSource {
  std::string path;
  double weight = 1.0;
};

struct ModelConfig {
  std::string path;               // TorchScript file
  std::string compute_dtype = "fp32";  // fp32 | bf16
  // Used by distributed.init_fsdp_with_meta_device (the file's weights are not loaded):
  double init_std = 0.02;               // weights ~ N(0, init_std); biases 0; other 1-D (norms) 1
  std::vector<std::string> init_rules;  // "glob=zeros|ones|normal:STD|uniform:A", first match wins
  // Initial weights from safetensors (a file, or a Hugging Face directory: model.safetensors or its
  // model.safetensors.index.json), every parameter by name; init_from_rename: "REGEX=REPLACEMENT"
  // rules applied in order to the file's names (an empty result drops the tensor).
  std::string init_from;
  std::vector<std::string> init_from_rename;
  // Fine-tuning: which parameters train (globs over parameter names, tied aliases included).
  // trainable null: every parameter, or the list the exporter stored in the file (a PEFT model's
  // adapters); frozen: subtracted from that. Frozen parameters get no gradient, no optimizer state
  // and no reduction (DESIGN.md section 13).
  std::optional<std::vector<std::string>> trainable;
  std::vector<std::string> frozen;
};

struct DataConfig {
  std::vector<DataSource> train;
  std::vector<DataSource> valid;  // empty: hold out valid_fraction of train's documents
  std::string format = "auto";    // auto | megatron | llmc
  double valid_fraction = 0.0;
  bool shuffle = true;
  std::optional<int64_t> eod_token;  // end-of-document id (256 for prepare-data's byte tokenizer)
  bool eod_mask_loss = false;        // Megatron's --eod-mask-loss: no loss on predicting eod_token
  int64_t prefetch_steps = 2;        // steps of batches a thread reads ahead; 0: read on the main thread
};

struct TrainingConfig {
  int64_t max_steps = 100;
  int64_t global_batch_size = 8;
  int64_t micro_batch_size = 8;
  int64_t seq_length = 128;
  int64_t seed = 1234;
  int64_t log_every = 1;
  int64_t eval_every = 0;  // 0: never
  int64_t eval_iters = 10;
  double clip_grad = 1.0;  // 0: no clipping
  std::optional<int64_t> threads;  // nullopt: cores given to this process / local ranks
  // auto: CUDA when this build has it and the node has a GPU, else CPU. One GPU per local rank
  // (local ranks beyond the GPU count share them round-robin).
  std::string device = "auto";
};

struct OptimizerConfig {
  std::string name = "adamw";  // adamw | adam | sgd
  double lr = 3e-4;
  double weight_decay = 0.01;
  std::vector<double> betas = {0.9, 0.95};
  double eps = 1e-8;
  double momentum = 0.9;  // sgd
  bool nesterov = false;  // sgd
  bool decay_norm_and_bias = false;
};

struct LrSchedulerConfig {
  std::string name = "cosine";  // constant | linear | cosine | wsd | inverse_sqrt
  int64_t warmup_steps = 0;
  double min_lr = 0.0;
  std::optional<int64_t> decay_steps;      // null: max_steps
  std::optional<int64_t> wsd_decay_steps;  // null: 10% of decay_steps
};

struct CheckpointConfig {
  std::optional<std::string> dir;  // null: no checkpoints
  int64_t save_every = 0;          // 0: only at the end (when dir is set)
  std::string resume = "auto";     // auto | none | <path>
  int64_t keep_last = 0;           // 0: keep all
  bool async = false;
  bool save_final = true;
};

struct LoggingConfig {
  bool all_ranks = false;  // every rank prints, prefixed with its rank
  std::string progress = "auto";  // auto | on | off
  std::optional<double> peak_tflops;  // per rank, for MFU; null: measured at start
  bool tensorboard = false;  // event files under run_dir/tensorboard (rank 0), beside metrics.jsonl
};

// PyTorch's profiler (Kineto) over a window of steps: a summary table and a Chrome/Perfetto trace
// per recording rank under run_dir/profile (train/profiler.h). Megatron's --profile-step-start /
// --profile-step-end / --profile-ranks with --use-pytorch-profiler.
struct ProfilingConfig {
  bool enabled = false;
  int64_t start_step = 3;                // first recorded step (1-based): after the first steps' allocations
  int64_t end_step = 4;                  // last recorded step, inclusive
  std::vector<int64_t> ranks = {0};      // ranks that record; empty: every rank
  bool record_shapes = false;            // input shapes in the trace
  bool trace = true;                     // write the trace beside the summary
  int64_t top = 30;                      // rows per table of the summary
};

struct Config {
  std::string source;  // file the config came from ("<embedded default>" for the built-in one)
  std::string run_dir = "runs/default";
  ModelConfig model;
  DistributedConfig distributed;
  DataConfig data;
  TrainingConfig training;
  OptimizerConfig optimizer;
  LrSchedulerConfig lr_scheduler;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  ProfilingConfig profiling;

  // Where each key was set ("file:line:col" or "command-line override 'k=v'"), by dotted path.
  // Later layers use it so that world-size dependent errors still point at the YAML.
  std::map<std::string, std::string> locations;
  std::string where(const std::string& dotted_key) const;
  // Legal but probably unintended settings, each naming its key; printed by validate and train.
  std::vector<std::string> warnings;
};

// Loads, applies `key.path=value` overrides (typed by the schema), and validates everything that
// does not depend on the world size. Throws ConfigError naming file:line:col and the key.
Config load_config_file(const std::string& path, const std::vector<std::string>& overrides = {});
Config load_config_string(const std::string& yaml, const std::string& source_name,
                          const std::vector<std::string>& overrides = {});

// The config shipped inside the binary (configs/default.yaml at build time).
const std::string& embedded_default_config();

// The resolved config as YAML, loadable again by load_config_*.
std::string to_yaml(const Config& cfg);

// Checks that need the data-parallel size: global batch divisible by micro batch x dp.
// Throws ConfigError citing the keys involved.
void check_batch_against_dp(const Config& cfg, int64_t dp_size);
// Checks that need the world size: profiling.ranks within it (when profiling is on).
void check_against_world(const Config& cfg, int64_t world);
// Gradient-accumulation steps per optimizer step for a given dp size.
int64_t grad_accum_steps(const Config& cfg, int64_t dp_size);

}  // namespace mfsdp
