// One declaration of every config key, walked by a visitor: the YAML reader, the YAML writer and
// the key lister all use it, so a key can never be readable but not printable (or vice versa).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "config/config.h"

namespace mfsdp::schema {

// A check returns "" when the value is fine, else what was expected ("an integer >= 1").
template <class T>
using Check = std::function<std::string(const T&)>;

template <class T>
Check<T> at_least(T lo) {
  return [lo](const T& v) { return v >= lo ? std::string() : "a value >= " + std::to_string(lo); };
}
template <class T>
Check<T> between(T lo, T hi) {
  return [lo, hi](const T& v) {
    return (v >= lo && v <= hi) ? std::string()
                                : "a value in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  };
}
Check<std::string> one_of(std::vector<std::string> choices);
Check<std::string> non_empty();
// "glob=zeros", "glob=ones", "glob=normal:0.01", "glob=uniform:0.1"
std::string init_rules_check(const std::vector<std::string>& rules);
std::string rename_rules_check(const std::vector<std::string>& rules);

// Marker types for fields whose YAML spelling is not their C++ type.
struct IntOrAuto {
  std::optional<int64_t>* value;
};

// The visitor V provides:
//   void section(const char* key, F&& body);        // a nested mapping
//   void field(const char* key, T& value, Check<T>); // a typed leaf
//   void field(const char* key, IntOrAuto value, Check<int64_t>);
template <class V>
void describe(Config& c, V& v) {
  v.field("run_dir", c.run_dir, non_empty());
  v.section("model", [&] {
    v.field("path", c.model.path, non_empty());
    v.field("compute_dtype", c.model.compute_dtype, one_of({"fp32", "bf16"}));
    v.field("init_std", c.model.init_std, at_least(0.0));
    v.field("init_rules", c.model.init_rules, Check<std::vector<std::string>>(init_rules_check));
    v.field("init_from", c.model.init_from);
    v.field("init_from_rename", c.model.init_from_rename, Check<std::vector<std::string>>(rename_rules_check));
    v.field("trainable", c.model.trainable);
    v.field("frozen", c.model.frozen);
  });
  v.section("distributed", [&] {
    auto& d = c.distributed;
    v.field("strategy", d.strategy, one_of({"megatron_fsdp"}));
    v.field("dp_size", IntOrAuto{&d.dp_size}, at_least<int64_t>(1));
    v.field("dp_replicate_size", d.dp_replicate_size, at_least<int64_t>(1));
    v.field("tp_size", d.tp_size, at_least<int64_t>(1));
    v.field("cp_size", d.cp_size, at_least<int64_t>(1));
    v.field("tp_plan", d.tp_plan);
    v.field("sequence_parallel", d.sequence_parallel);
    v.field("cp_comm_type", d.cp_comm_type, one_of({"all_gather", "p2p"}));
    v.field("core_attention_modules", d.core_attention_modules, Check<std::vector<std::string>>([](const std::vector<std::string>& v) {
              return v.empty() ? std::string("a non-empty list of class names or module-path globs") : std::string();
            }));
    v.field("megatron_fsdp_unit_modules", d.megatron_fsdp_unit_modules);
    v.field("zero_dp_strategy", d.zero_dp_strategy);
    v.field("init_fsdp_with_meta_device", d.init_fsdp_with_meta_device);
    v.field("grad_reduce_in_fp32", d.grad_reduce_in_fp32);
    v.field("preserve_fp32_weights", d.preserve_fp32_weights);
    v.field("overlap_grad_reduce", d.overlap_grad_reduce);
    v.field("overlap_param_gather", d.overlap_param_gather);
    v.field("check_for_nan_in_grad", d.check_for_nan_in_grad);
    v.field("average_in_collective", d.average_in_collective);
    v.field("disable_bucketing", d.disable_bucketing);
    v.field("calculate_per_token_loss", d.calculate_per_token_loss);
    v.field("keep_fp8_transpose_cache", d.keep_fp8_transpose_cache);
    v.field("nccl_ub", d.nccl_ub);
    v.field("fsdp_double_buffer", d.fsdp_double_buffer);
    v.field("activation_checkpointing", d.activation_checkpointing);
    v.field("report_nan_in_param_grad", d.report_nan_in_param_grad);
    v.field("timeout_s", d.timeout_s, Check<double>([](const double& x) {
              return x >= 1 ? std::string() : std::string("a number of seconds >= 1");
            }));
    v.field("backend", d.backend, one_of({"auto", "nccl", "mpi"}));
  });
  v.section("data", [&] {
    v.field("train", c.data.train);
    v.field("valid", c.data.valid);
    v.field("format", c.data.format, one_of({"auto", "megatron", "llmc"}));
    v.field("valid_fraction", c.data.valid_fraction, between(0.0, 0.5));
    v.field("shuffle", c.data.shuffle);
    v.field("eod_token", c.data.eod_token, at_least<int64_t>(0));
    v.field("eod_mask_loss", c.data.eod_mask_loss);
    v.field("prefetch_steps", c.data.prefetch_steps, between<int64_t>(0, 64));
  });
  v.section("training", [&] {
    auto& t = c.training;
    v.field("max_steps", t.max_steps, at_least<int64_t>(1));
    v.field("global_batch_size", t.global_batch_size, at_least<int64_t>(1));
    v.field("micro_batch_size", t.micro_batch_size, at_least<int64_t>(1));
    v.field("seq_length", t.seq_length, at_least<int64_t>(1));
    v.field("seed", t.seed, at_least<int64_t>(0));
    v.field("log_every", t.log_every, at_least<int64_t>(1));
    v.field("eval_every", t.eval_every, at_least<int64_t>(0));
    v.field("eval_iters", t.eval_iters, at_least<int64_t>(1));
    v.field("clip_grad", t.clip_grad, at_least(0.0));
    v.field("threads", IntOrAuto{&t.threads}, at_least<int64_t>(1));
    v.field("device", t.device, one_of({"auto", "cpu", "cuda"}));
  });
  v.section("optimizer", [&] {
    auto& o = c.optimizer;
    v.field("name", o.name, one_of({"adamw", "adam", "sgd"}));
    v.field("lr", o.lr, at_least(0.0));
    v.field("weight_decay", o.weight_decay, at_least(0.0));
    v.field("betas", o.betas, Check<std::vector<double>>([](const std::vector<double>& b) {
              bool ok = b.size() == 2 && b[0] >= 0 && b[0] < 1 && b[1] >= 0 && b[1] < 1;
              return ok ? std::string() : std::string("two numbers in [0, 1), e.g. [0.9, 0.95]");
            }));
    v.field("eps", o.eps, at_least(0.0));
    v.field("momentum", o.momentum, between(0.0, 1.0));
    v.field("nesterov", o.nesterov);
    v.field("decay_norm_and_bias", o.decay_norm_and_bias);
  });
  v.section("lr_scheduler", [&] {
    auto& s = c.lr_scheduler;
    v.field("name", s.name, one_of({"constant", "linear", "cosine", "wsd", "inverse_sqrt"}));
    v.field("warmup_steps", s.warmup_steps, at_least<int64_t>(0));
    v.field("min_lr", s.min_lr, at_least(0.0));
    v.field("decay_steps", s.decay_steps, at_least<int64_t>(1));
    v.field("wsd_decay_steps", s.wsd_decay_steps, at_least<int64_t>(1));
  });
  v.section("checkpoint", [&] {
    auto& k = c.checkpoint;
    v.field("dir", k.dir, non_empty());
    v.field("save_every", k.save_every, at_least<int64_t>(0));
    v.field("resume", k.resume, non_empty());
    v.field("keep_last", k.keep_last, at_least<int64_t>(0));
    v.field("async", k.async);
    v.field("save_final", k.save_final);
  });
  v.section("logging", [&] {
    v.field("all_ranks", c.logging.all_ranks);
    v.field("progress", c.logging.progress, one_of({"auto", "on", "off"}));
    v.field("peak_tflops", c.logging.peak_tflops, Check<double>([](const double& x) {
              return x > 0 ? std::string() : std::string("a positive number");
            }));
    v.field("tensorboard", c.logging.tensorboard);
  });
  v.section("profiling", [&] {
    auto& p = c.profiling;
    v.field("enabled", p.enabled);
    v.field("start_step", p.start_step, at_least<int64_t>(1));
    v.field("end_step", p.end_step, at_least<int64_t>(1));
    v.field("ranks", p.ranks, Check<std::vector<int64_t>>([](const std::vector<int64_t>& r) {
              for (int64_t x : r)
                if (x < 0) return std::string("a list of rank numbers >= 0 (empty: every rank)");
              return std::string();
            }));
    v.field("record_shapes", p.record_shapes);
    v.field("trace", p.trace);
    v.field("top", p.top, at_least<int64_t>(1));
  });
}

// Every dotted key the schema knows ("training.max_steps"), for did-you-mean across sections.
std::vector<std::string> all_keys();

}  // namespace mfsdp::schema
