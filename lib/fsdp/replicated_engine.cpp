// zero_dp_strategy no_shard: every rank holds every parameter; gradients are all-reduced over the
// data-parallel group in buckets (one per FSDP unit, one for the parameters outside units, or one
// per parameter with disable_bucketing). A bucket's all-reduce starts from the autograd hook of
// its last gradient (overlap_grad_reduce), so communication runs under the rest of backward.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>

#include "comm/communicator.h"
#include "fsdp/engine.h"
#include "mesh/process_groups.h"
#include "model/model.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {
namespace {

class ReplicatedEngine;

// Runs after a parameter's AccumulateGrad: the gradient is complete for this backward.
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(ReplicatedEngine* engine, int param) : engine_(engine), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override;

 private:
  ReplicatedEngine* engine_;
  int param_;
};

struct Bucket {
  std::string name;
  std::vector<int> params;
  at::Tensor grads;  // flat main gradients
  int pending = 0;   // gradients still to arrive in the current backward
  WorkHandle work;
};

class ReplicatedEngine final : public ParallelEngine {
 public:
  ReplicatedEngine(Model& model, const Config& cfg, ProcessGroups& pg)
      : model_(model), cfg_(cfg.distributed), dp_(pg.get(MeshGroup::kDp)) {
    const bool bf16 = cfg.model.compute_dtype == "bf16";
    const at::ScalarType grad_dtype = (!bf16 || cfg_.grad_reduce_in_fp32) ? at::kFloat : at::kBFloat16;
    const bool fp32_main = !bf16 || cfg_.preserve_fp32_weights;
    auto& params = model_.params();
    // Buckets: units in model order, then the rest.
    std::vector<std::vector<int>> groups;
    std::vector<std::string> names;
    for (const auto& u : model_.units()) {
      groups.push_back(u.params);
      names.push_back(u.path);
    }
    std::vector<int> rest;
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].unit < 0) rest.push_back(int(i));
    if (!rest.empty()) {
      groups.push_back(rest);
      names.push_back("(outside units)");
    }
    if (cfg_.disable_bucketing) {
      groups.clear();
      names.clear();
      for (size_t i = 0; i < params.size(); ++i) {
        groups.push_back({int(i)});
        names.push_back(params[i].name);
      }
    }
    param_bucket_.assign(params.size(), -1);
    slot_of_param_.assign(params.size(), -1);
    for (size_t b = 0; b < groups.size(); ++b) {
      Bucket bucket;
      bucket.name = names[b];
      bucket.params = groups[b];
      int64_t n = 0;
      for (int pi : groups[b]) n += params[pi].tensor.numel();
      bucket.grads = at::zeros({n}, grad_dtype);
      int64_t off = 0;
      for (int pi : groups[b]) {
        const at::Tensor& t = params[pi].tensor;
        OptimSlot s;
        s.name = params[pi].name;
        s.grad = bucket.grads.slice(0, off, off + t.numel()).view(t.sizes());
        s.weight = fp32_main && t.scalar_type() != at::kFloat ? t.detach().to(at::kFloat) : t.detach();
        s.decay = t.dim() >= 2 || cfg.optimizer.decay_norm_and_bias;
        slot_of_param_[pi] = int(slots_.size());
        slots_.push_back(s);
        param_bucket_[pi] = int(b);
        off += t.numel();
      }
      grad_bytes_ += bucket.grads.nbytes();
      buckets_.push_back(std::move(bucket));
    }
    // Keep each accumulator alive: a hook on a node that is later recreated would never fire.
    for (size_t i = 0; i < params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params[i].tensor);
      if (!acc) throw std::runtime_error("parameter " + params[i].name + " has no gradient accumulator");
      acc->add_post_hook(std::make_unique<GradReadyHook>(this, int(i)));
      accumulators_.push_back(acc);
    }
  }

  void on_grad_ready(int pi) {
    auto& p = model_.params()[pi];
    at::Tensor g = p.tensor.grad();
    if (!g.defined()) return;
    {
      at::NoGradGuard ng;
      slots_[slot_of_param_[pi]].grad.add_(g);
    }
    p.tensor.mutable_grad() = at::Tensor();  // the main gradient holds it now
    Bucket& b = buckets_[param_bucket_[pi]];
    if (--b.pending == 0 && last_micro_ && cfg_.overlap_grad_reduce) launch(b);
  }

  void start_step() override {
    for (auto& b : buckets_) {
      b.grads.zero_();
      b.work.reset();
    }
  }

  void start_micro_batch(bool last) override {
    last_micro_ = last;
    for (auto& b : buckets_) b.pending = int(b.params.size());
  }

  void finish_grad_sync(double scale) override {
    // Buckets not launched from hooks (no overlap, or parameters that got no gradient).
    for (auto& b : buckets_)
      if (!b.work) launch(b);
    for (auto& b : buckets_) {
      b.work->wait();
      b.work.reset();
      if (scale != 1.0) b.grads.mul_(scale);
    }
  }

  double grad_norm() override {
    double sq = 0;
    for (auto& b : buckets_) sq += b.grads.to(at::kDouble).pow(2).sum().item<double>();
    return std::sqrt(sq);  // replicated: every rank holds the whole gradient
  }

  void scale_grads(double s) override {
    for (auto& b : buckets_) b.grads.mul_(s);
  }

  std::vector<std::string> nonfinite_grads() override {
    std::vector<std::string> bad;
    for (auto& s : slots_)
      if (!at::isfinite(s.grad).all().item<bool>()) bad.push_back(s.name);
    return bad;
  }

  std::vector<OptimSlot>& slots() override { return slots_; }

  void install_weights() override {
    at::NoGradGuard ng;
    auto& params = model_.params();
    for (size_t i = 0; i < params.size(); ++i) {
      const OptimSlot& s = slots_[slot_of_param_[i]];
      at::Tensor w = params[i].tensor.detach();
      if (!s.weight.is_same(w) && s.weight.data_ptr() != w.data_ptr()) w.copy_(s.weight);
    }
  }

  std::string describe() const override {
    return fmt::format("no_shard: {} gradient buckets ({} main gradients, {}), all-reduce over dp={} {}", buckets_.size(),
                       human_bytes(double(grad_bytes_)), c10::toString(buckets_.front().grads.scalar_type()),
                       dp_.size(),
                       cfg_.overlap_grad_reduce ? "overlapped with backward" : "after backward");
  }

 private:
  void launch(Bucket& b) {
    if (b.work) return;
    const int n = dp_.size();
    ReduceOp op = ReduceOp::kSum;
    if (!cfg_.calculate_per_token_loss && n > 1) {
      if (cfg_.average_in_collective) op = ReduceOp::kAvg;
      else b.grads.div_(n);  // pre-scale, then sum
    }
    b.work = dp_.all_reduce_async(b.grads, op);
  }

  Model& model_;
  const DistributedConfig& cfg_;
  Communicator& dp_;
  std::vector<Bucket> buckets_;
  std::vector<OptimSlot> slots_;
  std::vector<int> param_bucket_, slot_of_param_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  bool last_micro_ = true;
  int64_t grad_bytes_ = 0;
};

torch::autograd::variable_list GradReadyHook::operator()(const torch::autograd::variable_list& outputs,
                                                         const torch::autograd::variable_list&) {
  engine_->on_grad_ready(param_);
  return outputs;
}

}  // namespace

std::unique_ptr<ParallelEngine> make_engine(Model& model, const Config& cfg, ProcessGroups& pg) {
  const auto& d = cfg.distributed;
  const int64_t shard_group = pg.get(MeshGroup::kDpShardCp).size();
  if (d.tp_size > 1) throw ConfigError(cfg.where("distributed.tp_size") + ": distributed.tp_size > 1: tensor parallelism is not in this build yet");
  if (d.cp_size > 1) throw ConfigError(cfg.where("distributed.cp_size") + ": distributed.cp_size > 1: context parallelism is not in this build yet");
  if (d.zero_dp_strategy != ZeroDpStrategy::kNoShard && shard_group > 1)
    throw ConfigError(cfg.where("distributed.zero_dp_strategy") + ": distributed.zero_dp_strategy " +
                      to_string(d.zero_dp_strategy) + " with " + std::to_string(shard_group) +
                      " data-parallel ranks needs sharded buffers, which are not in this build yet; use no_shard (0) "
                      "or a single rank");
  return std::make_unique<ReplicatedEngine>(model, cfg, pg);
}

}  // namespace mfsdp
