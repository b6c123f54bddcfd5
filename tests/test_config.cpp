// Config: defaults, types, overrides, and malformed inputs whose errors must name file:line:col
// and the key.
#include <string>
#include <vector>

#include "catch.h"
#include "config/config.h"
#include "config/schema.h"
#include "optim/optimizer.h"
#include "util/error.h"

using namespace mfsdp;

namespace {

const std::string kMinimal = "model:\n  path: m.pt\ndata:\n  train: d\n";

Config load(const std::string& yaml, const std::vector<std::string>& ov = {}) {
  return load_config_string(yaml, "t.yaml", ov);
}

// Loads `yaml` expecting a ConfigError whose message contains every one of `parts`.
void expect_error(const std::string& yaml, const std::vector<std::string>& parts,
                  const std::vector<std::string>& ov = {}) {
  std::string msg;
  try {
    load(yaml, ov);
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  INFO("yaml:\n" << yaml << "\nmessage: " << msg);
  REQUIRE(!msg.empty());
  for (const auto& p : parts) CHECK(msg.find(p) != std::string::npos);
}

}  // namespace

TEST_CASE("defaults match NeMo Automodel's MegatronFSDPConfig") {
  Config c = load(kMinimal);
  const auto& d = c.distributed;
  CHECK(d.strategy == "megatron_fsdp");
  CHECK(!d.dp_size.has_value());
  CHECK(d.dp_replicate_size == 1);
  CHECK(d.tp_size == 1);
  CHECK(d.cp_size == 1);
  CHECK(!d.megatron_fsdp_unit_modules.has_value());
  CHECK(d.zero_dp_strategy == ZeroDpStrategy::kOptimGradsParams);
  CHECK(d.overlap_grad_reduce);
  CHECK(d.overlap_param_gather);
  CHECK(d.check_for_nan_in_grad);
  for (bool f : {d.init_fsdp_with_meta_device, d.grad_reduce_in_fp32, d.preserve_fp32_weights, d.average_in_collective,
                 d.disable_bucketing, d.calculate_per_token_loss, d.keep_fp8_transpose_cache, d.nccl_ub,
                 d.fsdp_double_buffer, d.activation_checkpointing, d.report_nan_in_param_grad})
    CHECK_FALSE(f);
}

TEST_CASE("the distributed section carries all 16 MegatronFSDPConfig fields") {
  const std::vector<std::string> fields = {
      "activation_checkpointing", "average_in_collective", "calculate_per_token_loss", "check_for_nan_in_grad",
      "disable_bucketing", "fsdp_double_buffer", "grad_reduce_in_fp32", "init_fsdp_with_meta_device",
      "keep_fp8_transpose_cache", "megatron_fsdp_unit_modules", "nccl_ub", "overlap_grad_reduce",
      "overlap_param_gather", "preserve_fp32_weights", "report_nan_in_param_grad", "zero_dp_strategy"};
  auto keys = schema::all_keys();
  for (const auto& f : fields) {
    INFO(f);
    CHECK(std::find(keys.begin(), keys.end(), "distributed." + f) != keys.end());
  }
}

TEST_CASE("zero_dp_strategy takes 0..3 and the names") {
  const char* names[] = {"no_shard", "optim", "optim_grads", "optim_grads_params"};
  for (int i = 0; i < 4; ++i) {
    CHECK(load(kMinimal + "distributed:\n  zero_dp_strategy: " + std::to_string(i) + "\n").distributed.zero_dp_strategy ==
          static_cast<ZeroDpStrategy>(i));
    CHECK(load(kMinimal + "distributed:\n  zero_dp_strategy: " + names[i] + "\n").distributed.zero_dp_strategy ==
          static_cast<ZeroDpStrategy>(i));
  }
}

TEST_CASE("overrides are typed by the schema and may create sections") {
  Config c = load(kMinimal, {"training.max_steps=1000", "distributed.zero_dp_strategy=optim", "optimizer.lr=1e-3",
                             "distributed.overlap_grad_reduce=false", "run_dir=/tmp/x",
                             "distributed.megatron_fsdp_unit_modules=[Block, 'layers.*']", "distributed.dp_size=2"});
  CHECK(c.training.max_steps == 1000);
  CHECK(c.distributed.zero_dp_strategy == ZeroDpStrategy::kOptim);
  CHECK(c.optimizer.lr == Approx(1e-3));
  CHECK_FALSE(c.distributed.overlap_grad_reduce);
  CHECK(c.run_dir == "/tmp/x");
  REQUIRE(c.distributed.megatron_fsdp_unit_modules.has_value());
  CHECK(*c.distributed.megatron_fsdp_unit_modules == std::vector<std::string>{"Block", "layers.*"});
  CHECK(c.distributed.dp_size == 2);
  CHECK(c.where("training.max_steps") == "command-line override 'training.max_steps=1000'");
  // A later override of the same key wins.
  CHECK(load(kMinimal, {"training.seed=1", "training.seed=2"}).training.seed == 2);
}

TEST_CASE("data sources: path, list, {path, weight}, Megatron's flat weighted list") {
  CHECK(load(kMinimal).data.train.size() == 1);
  auto c = load("model: {path: m}\ndata:\n  train: [0.3, a, 0.7, b]\n");
  REQUIRE(c.data.train.size() == 2);
  CHECK(c.data.train[1].path == "b");
  CHECK(c.data.train[1].weight == Approx(0.7));
  c = load("model: {path: m}\ndata:\n  train:\n    - {path: a, weight: 2}\n    - b\n");
  REQUIRE(c.data.train.size() == 2);
  CHECK(c.data.train[0].weight == Approx(2.0));
  CHECK(c.data.train[1].weight == Approx(1.0));
}

TEST_CASE("to_yaml round trip") {
  Config a = load("model: {path: m}\ndata:\n  train: [0.25, x, 0.75, y]\ndistributed:\n  zero_dp_strategy: 1\n"
                  "  dp_size: 4\ntraining:\n  clip_grad: 0.5\n",
                  {"optimizer.betas=[0.8, 0.99]", "distributed.megatron_fsdp_unit_modules=[Block]"});
  Config b = load_config_string(to_yaml(a), "printed.yaml");
  CHECK(to_yaml(a) == to_yaml(b));
  CHECK(b.distributed.zero_dp_strategy == ZeroDpStrategy::kOptim);
  CHECK(b.distributed.dp_size == 4);
  CHECK(b.training.clip_grad == 0.5);
  CHECK(b.optimizer.betas == std::vector<double>{0.8, 0.99});
  CHECK(b.data.train[1].weight == 0.75);
}

TEST_CASE("the embedded default config loads and validates") {
  Config c = load_config_string(embedded_default_config(), "<embedded default>");
  CHECK(c.model.path.size() > 0);
  CHECK(grad_accum_steps(c, 1) * c.training.micro_batch_size == c.training.global_batch_size);
}

TEST_CASE("batch sizes against the data-parallel size") {
  Config c = load(kMinimal + "training:\n  global_batch_size: 12\n  micro_batch_size: 2\n");
  CHECK(grad_accum_steps(c, 2) == 3);
  CHECK(grad_accum_steps(c, 6) == 1);
  try {
    grad_accum_steps(c, 4);
    FAIL("expected an error");
  } catch (const ConfigError& e) {
    std::string m = e.what();
    CHECK(m.find("t.yaml:6:22") != std::string::npos);
    CHECK(m.find("training.global_batch_size") != std::string::npos);
  }
}

// --- Malformed inputs: each names the key and its line ----------------------------------------

TEST_CASE("malformed: unknown and misplaced keys") {
  expect_error("modle:\n  path: m.pt\ndata:\n  train: d\n", {"t.yaml:1:1", "unknown key 'modle'", "did you mean 'model'"});
  expect_error(kMinimal + "distributed:\n  zero_dp_stratgy: 2\n",
               {"t.yaml:6:3", "distributed.zero_dp_stratgy", "did you mean 'zero_dp_strategy'"});
  expect_error(kMinimal + "training:\n  lr: 0.1\n", {"t.yaml:6:3", "training.lr", "belongs at 'optimizer.lr'"});
  expect_error(kMinimal + "training:\n  steps: 10\n", {"t.yaml:6:3", "did you mean 'max_steps'"});
  expect_error(kMinimal + "training:\n  max_steps: 5\n  max_steps: 6\n", {"t.yaml:7:3", "duplicate key 'max_steps'"});
  expect_error(kMinimal + "checkpoint:\n  every: 5\n", {"t.yaml:6:3", "checkpoint.every", "unknown key"});
  expect_error("model:\n  path: m\ndata:\n  train:\n    - {path: a, wieght: 2}\n",
               {"t.yaml:5:17", "data.train[0].wieght", "unknown key 'wieght'"});
}

TEST_CASE("malformed: wrong types") {
  expect_error(kMinimal + "training:\n  max_steps: abc\n", {"t.yaml:6:14", "training.max_steps", "expected an integer", "'abc'"});
  expect_error(kMinimal + "training:\n  max_steps: 1.5\n", {"t.yaml:6:14", "expected an integer"});
  expect_error(kMinimal + "training:\n  max_steps: \"10\"\n", {"t.yaml:6:14", "expected an integer"});
  expect_error(kMinimal + "distributed:\n  overlap_grad_reduce: yes\n",
               {"t.yaml:6:24", "distributed.overlap_grad_reduce", "expected true or false"});
  expect_error(kMinimal + "distributed:\n  overlap_param_gather: 1\n", {"t.yaml:6:25", "expected true or false"});
  expect_error(kMinimal + "distributed:\n  dp_size: many\n", {"t.yaml:6:12", "distributed.dp_size", "'auto'"});
  expect_error(kMinimal + "distributed: [1, 2]\n", {"t.yaml:5:14", "distributed", "expected a mapping"});
  expect_error(kMinimal + "distributed:\n  megatron_fsdp_unit_modules: {a: 1}\n",
               {"t.yaml:6:31", "megatron_fsdp_unit_modules", "list of strings"});
  expect_error(kMinimal + "optimizer:\n  lr: fast\n", {"t.yaml:6:7", "optimizer.lr", "expected a number"});
  expect_error(kMinimal + "optimizer:\n  betas: 0.9\n", {"t.yaml:6:10", "optimizer.betas", "list of numbers"});
  expect_error("- model\n- data\n", {"t.yaml:1:1", "expected a mapping of sections"});
  expect_error("", {"t.yaml:1:1", "empty"});
  expect_error("model:\n  path: [unclosed\ndata: x\n", {"t.yaml:", "YAML syntax error"});
}

TEST_CASE("malformed: out-of-range values and bad choices") {
  expect_error(kMinimal + "training:\n  max_steps: 0\n", {"t.yaml:6:14", "training.max_steps", ">= 1"});
  expect_error(kMinimal + "distributed:\n  zero_dp_strategy: 4\n",
               {"t.yaml:6:21", "distributed.zero_dp_strategy", "0, 1, 2, 3", "'4'"});
  expect_error(kMinimal + "distributed:\n  zero_dp_strategy: full_shard\n", {"t.yaml:6:21", "optim_grads_params"});
  expect_error(kMinimal + "distributed:\n  zero_dp_strategy: optim_grad\n", {"did you mean 'optim_grads'"});
  expect_error(kMinimal + "distributed:\n  tp_size: -2\n", {"t.yaml:6:12", "distributed.tp_size", ">= 1"});
  expect_error(kMinimal + "distributed:\n  strategy: fsdp2\n", {"t.yaml:6:13", "distributed.strategy", "megatron_fsdp"});
  expect_error(kMinimal + "optimizer:\n  betas: [0.9]\n", {"t.yaml:6:10", "optimizer.betas", "two numbers"});
  expect_error(kMinimal + "optimizer:\n  betas: [0.9, 1.5]\n", {"t.yaml:6:10", "two numbers"});
  expect_error(kMinimal + "optimizer:\n  name: adamx\n", {"t.yaml:6:9", "optimizer.name", "adamw, adam, sgd"});
  expect_error(kMinimal + "optimizer:\n  lr: -1\n", {"t.yaml:6:7", "optimizer.lr", ">= 0"});
  expect_error(kMinimal + "lr_scheduler:\n  name: cosin\n", {"t.yaml:6:9", "lr_scheduler.name", "inverse_sqrt"});
  expect_error(kMinimal + "run_dir: ''\n", {"t.yaml:5:10", "run_dir", "non-empty"});
  expect_error(kMinimal + "logging:\n  peak_tflops: 0\n", {"t.yaml:6:16", "logging.peak_tflops", "positive"});
  expect_error(kMinimal + "data:\n  shuffle: true\n", {"t.yaml:5:1", "duplicate key 'data'"});
  expect_error("model:\n  path: m\ndata:\n  train: [0.3, a, 0.7]\n", {"t.yaml:4:10", "data.train", "even number"});
  expect_error("model:\n  path: m\ndata:\n  train: [{path: a, weight: -1}]\n", {"t.yaml:4:10", "weights must be > 0"});
  expect_error("model:\n  path: m\ndata:\n  train: []\n", {"t.yaml:4:10", "data.train"});
  expect_error(kMinimal + "data2:\n  valid_fraction: 0.9\n", {"t.yaml:5:1", "unknown key 'data2'"});
}

TEST_CASE("malformed: missing required keys and impossible combinations") {
  expect_error("data:\n  train: d\n", {"model.path", "required"});
  expect_error("model:\n  path: m\n", {"data.train", "required"});
  expect_error(kMinimal + "distributed:\n  keep_fp8_transpose_cache: true\n",
               {"t.yaml:6:29", "distributed.keep_fp8_transpose_cache", "FP8"});
  expect_error(kMinimal + "distributed:\n  zero_dp_strategy: 1\n  fsdp_double_buffer: true\n",
               {"t.yaml:7:23", "distributed.fsdp_double_buffer", "optim_grads_params"});
  expect_error(kMinimal + "distributed:\n  nccl_ub: true\n", {"t.yaml:6:12", "distributed.nccl_ub", "fsdp_double_buffer"});
  expect_error(kMinimal + "distributed:\n  average_in_collective: true\n  calculate_per_token_loss: true\n",
               {"t.yaml:6:26", "distributed.average_in_collective", "calculate_per_token_loss"});
  expect_error(kMinimal + "distributed:\n  dp_size: 3\n  dp_replicate_size: 2\n",
               {"t.yaml:7:22", "distributed.dp_replicate_size", "multiple"});
  expect_error(kMinimal + "training:\n  global_batch_size: 10\n  micro_batch_size: 4\n",
               {"t.yaml:6:22", "training.global_batch_size", "multiple of training.micro_batch_size"});
  expect_error(kMinimal + "distributed:\n  cp_size: 2\ntraining:\n  seq_length: 6\n",
               {"t.yaml:8:15", "training.seq_length", "multiple of 4"});
  expect_error(kMinimal + "optimizer:\n  lr: 0.001\nlr_scheduler:\n  min_lr: 0.01\n", {"t.yaml:8:11", "lr_scheduler.min_lr"});
  expect_error(kMinimal + "training:\n  eval_every: 10\n", {"t.yaml:6:15", "training.eval_every", "data.valid"});
  expect_error(kMinimal + "checkpoint:\n  save_every: 10\n", {"t.yaml:6:15", "checkpoint.save_every", "checkpoint.dir"});
}

TEST_CASE("malformed: command-line overrides") {
  expect_error(kMinimal, {"command-line override 'training.max_stepz=5'", "did you mean 'max_steps'"},
               {"training.max_stepz=5"});
  expect_error(kMinimal, {"command-line override 'training.max_steps=ten'", "expected an integer"},
               {"training.max_steps=ten"});
  expect_error(kMinimal, {"command-line override 'training.max_steps'", "key.path=value"}, {"training.max_steps"});
  expect_error(kMinimal, {"'model.path' is not a section"}, {"model.path.x=1"});
  expect_error(kMinimal, {"command-line override 'distributed.zero_dp_strategy=7'", "0, 1, 2, 3"},
               {"distributed.zero_dp_strategy=7"});
  expect_error(kMinimal, {"invalid character"}, {"training.max-steps=3"});
}

TEST_CASE("malformed: initialisation rules") {
  expect_error(kMinimal + "model:\n  init_rules: ['*.bias=zero']\n", {"duplicate key 'model'"});
  expect_error("model:\n  path: m\n  init_rules: ['*.bias=zero']\ndistributed: {init_fsdp_with_meta_device: true}\n"
               "data: {train: d}\n",
               {"t.yaml:3:15", "model.init_rules", "bad: '*.bias=zero'"});
  expect_error("model:\n  path: m\n  init_rules: ['*.bias=normal:x']\ndistributed: {init_fsdp_with_meta_device: true}\n"
               "data: {train: d}\n",
               {"t.yaml:3:15", "model.init_rules"});
  expect_error("model:\n  path: m\n  init_rules: ['*.bias=zeros']\ndata: {train: d}\n",
               {"t.yaml:3:15", "model.init_rules", "init_fsdp_with_meta_device"});
  Config c = load("model:\n  path: m\n  init_rules: ['*.bias=zeros', 'x=normal:0.1']\n"
                  "distributed: {init_fsdp_with_meta_device: true}\ndata: {train: d}\n");
  CHECK(c.model.init_rules.size() == 2);
}

TEST_CASE("malformed: eod_mask_loss without eod_token") {
  expect_error(kMinimal + "training: {max_steps: 5}\ndata2: {}\n", {"unknown key 'data2'"});
  expect_error("model: {path: m}\ndata:\n  train: d\n  eod_mask_loss: true\n", {"t.yaml:4:18", "data.eod_mask_loss", "eod_token"});
  expect_error("model: {path: m}\ndata:\n  train: d\n  eod_token: -1\n", {"t.yaml:4:14", "data.eod_token", ">= 0"});
}

TEST_CASE("tp_plan: an ordered mapping of globs to styles, with packed parts") {
  Config c = load(kMinimal + "distributed:\n  tp_size: 2\n  tp_plan:\n    \"b.*.qkv\": colwise:3\n    \"b.*.o\": rowwise\n"
                             "    emb: vocab_parallel\n    \"*\": colwise:64+32+32\n");
  REQUIRE(c.distributed.tp_plan);
  const auto& plan = *c.distributed.tp_plan;
  REQUIRE(plan.size() == 4);
  CHECK(plan[0] == std::make_pair(std::string("b.*.qkv"), std::string("colwise:3")));
  CHECK(plan[3].first == "*");  // file order is kept: the first match wins
  TpStyle st;
  CHECK(parse_tp_style("colwise:64+32+32", st).empty());
  CHECK(st.parts == std::vector<int64_t>{64, 32, 32});
  CHECK(parse_tp_style("colwise:1", st).empty());
  CHECK(st.parts.empty());
  // Hugging Face's names of the same styles.
  CHECK(parse_tp_style("colwise_gather_output", st).empty());
  CHECK(st.kind == "colwise_rep");
  CHECK(parse_tp_style("rowwise_split_input", st).empty());
  CHECK(st.kind == "rowwise_rep");
  CHECK(parse_tp_style("embedding_rowwise", st).empty());
  CHECK(st.kind == "vocab_parallel");
  CHECK(parse_tp_style("embedding_rowwise:2", st).find("only colwise takes packed parts") != std::string::npos);
  CHECK(parse_tp_style("local_colwise", st).find("embedding_rowwise are colwise_rep") != std::string::npos);
  // It survives the YAML writer, and an override replaces it whole.
  Config again = load(to_yaml(c));
  CHECK(*again.distributed.tp_plan == plan);
  Config o = load(kMinimal, {"distributed.tp_plan={lm_head: colwise_rep}"});
  REQUIRE(o.distributed.tp_plan->size() == 1);
  CHECK(!load(kMinimal).distributed.tp_plan);  // null: the model file's plan
}

TEST_CASE("malformed: tp_plan, sequence_parallel, core_attention_modules") {
  expect_error(kMinimal + "distributed:\n  tp_plan: [a, b]\n", {"t.yaml:6:12", "distributed.tp_plan", "expected a mapping"});
  expect_error(kMinimal + "distributed:\n  tp_plan:\n    a: colwize\n", {"t.yaml:7:8", "distributed.tp_plan.a", "expected a style", "'colwize'"});
  expect_error(kMinimal + "distributed:\n  tp_plan:\n    a: rowwise:2\n", {"t.yaml:7:8", "only colwise takes packed parts"});
  expect_error(kMinimal + "distributed:\n  tp_plan:\n    a: colwise:0+4\n", {"parts must be positive integers"});
  expect_error(kMinimal + "distributed:\n  tp_plan:\n    a: colwise\n    a: rowwise\n", {"t.yaml:8:5", "duplicate"});
  expect_error(kMinimal + "distributed:\n  sequence_parallel: true\n", {"t.yaml:6:22", "needs distributed.tp_size > 1"});
  expect_error(kMinimal + "distributed:\n  core_attention_modules: []\n", {"t.yaml:6:27", "a non-empty list"});
}

TEST_CASE("warmup longer than the run is a warning naming the key, not an error (quick runs of long configs)") {
  Config c = load(kMinimal + "training:\n  max_steps: 10\nlr_scheduler:\n  warmup_steps: 500\n");
  REQUIRE(c.warnings.size() == 1);
  REQUIRE_THAT(c.warnings[0], Catch::Contains("t.yaml:8:17") && Catch::Contains("lr_scheduler.warmup_steps (500)") &&
                                  Catch::Contains("training.max_steps (10)"));
  // The schedule is still defined: the learning rate is warming up at every step of the run.
  for (int64_t s = 1; s <= 10; ++s)
    REQUIRE(learning_rate(c.lr_scheduler, c.optimizer.lr, 10, s) == Approx(c.optimizer.lr * double(s) / 500.0));
  REQUIRE(load(kMinimal).warnings.empty());
}

TEST_CASE("profiling: the window, the ranks (a list, or one number), and what is refused") {
  Config c = load(kMinimal + "profiling:\n  enabled: true\n  start_step: 5\n  end_step: 7\n  ranks: [0, 3]\n"
                             "  record_shapes: true\n  trace: false\n  top: 12\n");
  CHECK(c.profiling.enabled);
  CHECK(c.profiling.start_step == 5);
  CHECK(c.profiling.end_step == 7);
  CHECK(c.profiling.ranks == std::vector<int64_t>{0, 3});
  CHECK(c.profiling.record_shapes);
  CHECK_FALSE(c.profiling.trace);
  CHECK(c.profiling.top == 12);
  // Written back and read again: the same settings.
  Config again = load(to_yaml(c));
  CHECK(again.profiling.ranks == c.profiling.ranks);
  CHECK(again.profiling.end_step == 7);
  CHECK(load(kMinimal, {"profiling.ranks=2"}).profiling.ranks == std::vector<int64_t>{2});
  CHECK(load(kMinimal, {"profiling.ranks=[]"}).profiling.ranks.empty());
  CHECK(load(kMinimal).profiling.ranks == std::vector<int64_t>{0});  // default: rank 0
  expect_error(kMinimal + "profiling:\n  enabled: true\n  start_step: 5\n  end_step: 4\n",
               {"t.yaml:8:", "profiling.end_step", "must not be before profiling.start_step (5), got 4"});
  expect_error(kMinimal + "profiling:\n  ranks: [0, -1]\n", {"t.yaml:6:", "profiling.ranks", "rank numbers >= 0"});
  expect_error(kMinimal + "profiling:\n  ranks: [0, one]\n", {"profiling.ranks[1]", "expected an integer"});
  expect_error(kMinimal + "profiling:\n  start_step: 0\n", {"profiling.start_step", "a value >= 1"});
  expect_error(kMinimal + "profiling:\n  enable: true\n", {"profiling.enable", "enabled"});
  // A window past the end of a short trial run: a warning naming the key.
  Config late = load(kMinimal + "training:\n  max_steps: 3\nprofiling:\n  enabled: true\n  start_step: 9\n  end_step: 10\n");
  REQUIRE(late.warnings.size() == 1);
  CHECK(late.warnings[0].find("profiling.start_step (9) is beyond training.max_steps (3)") != std::string::npos);
  CHECK(load(kMinimal + "profiling:\n  start_step: 9\n  end_step: 2\n").warnings.empty());  // off: not checked
}
