// Megatron-FSDP sharding (DESIGN.md section 5) for every zero_dp_strategy.
//
// Each FSDP unit (and the parameters outside units, and with disable_bucketing each parameter) is
// a bucket: one flat buffer per role, padded to split evenly over the sharding group
// (dp_shard x cp, size S); this rank owns elements [r*n, (r+1)*n), n = padded / S.
//
//   strategy            compute weights         main weights   main grads         reduction
//   0 no_shard          full, persistent        full           full               all-reduce (dp), last micro-batch
//   1 optim             full, persistent        shard          full + shard       reduce-scatter, last micro-batch
//   2 optim_grads       full, persistent        shard          shard              reduce-scatter, every micro-batch
//   3 optim_grads_params shard; full only while the unit runs   shard             reduce-scatter, every micro-batch
//
// Parameters are views into the full compute buffer (set_data once). Under strategy 3 the buffer's
// storage is freed after the unit's forward and allocated again, in place, before its backward:
// tensors that autograd saved keep pointing at the same storage and see the gathered data again.
// After the optimizer steps on the shards, strategies 1-2 all-gather the updated weights (waited
// for just before each unit's next forward when overlap_param_gather), strategy 3 just updates its
// shard. With HSDP (dp_replicate > 1) the shard gradients are then all-reduced across replicas.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <unordered_map>

#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "fsdp/engine.h"
#include "fsdp/unit_ops.h"
#include "mesh/process_groups.h"
#include "model/graph_rewrite.h"
#include "model/cpu_blas.h"
#include "model/linear.h"
#include "model/model.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {
namespace {

class FsdpEngine;

class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(FsdpEngine* engine, int param) : engine_(engine), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override;

 private:
  FsdpEngine* engine_;
  int param_;
};

struct ParamInfo {
  std::string name;
  int bucket = -1;
  int64_t offset = 0, numel = 0;
};

struct PendingReduce {
  WorkHandle work;
  at::Tensor out;   // reduce-scatter output (strategies 2-3), accumulated into the shard gradient
  at::Tensor keep;  // the full gradient buffer, alive until the collective is done
  uint64_t order = 0;  // strategies 2-3: launch order, for the cap on reduce-scatters in flight
};

struct Bucket {
  std::string name;
  int unit = -1;  // -1: not a unit (parameters outside units, or one parameter)
  bool frozen = false;  // model.frozen parameters only: weights, never gradients
  std::vector<int> params;
  int64_t numel = 0, padded = 0, shard = 0;
  at::Tensor full;        // compute weights, padded; under strategy 3 its storage comes and goes
  at::Tensor shard_w;     // strategy 3: this rank's shard of the compute weights
  at::Tensor main;        // main weights: full (0) or shard (1-3); may alias full/shard_w
  at::Tensor grad_full;   // full gradients: persistent (0-1) or per backward (2-3)
  at::Tensor grad_shard;  // the optimizer's gradients: = grad_full (0) or this rank's shard
  int pending = 0;        // gradients still to arrive in this backward
  bool ready = false;     // every gradient of this backward arrived: its reduction may start in turn
  bool reduced_this_micro = false;
  std::vector<PendingReduce> reduces;
  int64_t dbuf_offset = 0;  // element offset in the double buffer of its unit
  WorkHandle gather;      // all-gather in flight (strategy 3 gather, or post-step gather of 1-2)
  bool gathered = false;  // strategy 3: the full buffer holds (or is receiving) the weights
  at::Tensor norm;        // tp 1: ||grad_shard||, taken in finish_grad_sync as its reduction finished
};

class FsdpEngine final : public ParallelEngine, public UnitHooks, public GradSink {
 public:
  FsdpEngine(Model& model, const Config& cfg, ProcessGroups& pg)
      : model_(model),
        dev_(model.device()),
        d_(cfg.distributed),
        strategy_(static_cast<int>(cfg.distributed.zero_dp_strategy)),
        dp_(pg.get(MeshGroup::kDp)),
        shard_(pg.get(MeshGroup::kDpShardCp)),
        replicate_(pg.get(MeshGroup::kDpReplicate)),
        tp_(pg.get(MeshGroup::kTp)),
        dpcp_(pg.get(MeshGroup::kDpCp)),
        cp_size_(pg.get(MeshGroup::kCp).size()),
        model_cfg_(cfg.model),
        seed_(uint64_t(cfg.training.seed)),
        // fp32 state tensors per element the optimizer keeps (optim/optimizer.cpp): Adam's two
        // moments, SGD's momentum buffer when momentum is on.
        optim_states_(cfg.optimizer.name == "sgd" ? (cfg.optimizer.momentum != 0 ? 1 : 0) : 2),
        optim_name_(cfg.optimizer.name == "sgd" && cfg.optimizer.momentum != 0 ? "sgd with momentum" : cfg.optimizer.name) {
    const bool bf16 = cfg.model.compute_dtype == "bf16";
    cd_ = bf16 ? at::kBFloat16 : at::kFloat;
    md_ = (!bf16 || d_.preserve_fp32_weights) ? at::kFloat : at::kBFloat16;
    gd_ = (!bf16 || d_.grad_reduce_in_fp32) ? at::kFloat : at::kBFloat16;
    S_ = strategy_ == 0 ? 1 : shard_.size();
    r_ = strategy_ == 0 ? 0 : shard_.rank();
    build_buckets(cfg);
    // The one order in which every rank starts the buckets' reductions (launch_in_order): units from
    // the last to the first (backward's order), then the buckets outside units; frozen ones never.
    for (int pass = 0; pass < 2; ++pass)
      for (int bi = int(buckets_.size()) - 1; bi >= 0; --bi)
        if (!buckets_[bi].frozen && (buckets_[bi].unit >= 0) == (pass == 0)) launch_order_.push_back(bi);
    for (size_t b = 0; b < buckets_.size(); ++b) build_buffers(buckets_[b], int(b));
    build_slots(cfg);
    if (model_.loaded_on_meta()) init_note_ = "; weights initialised shard by shard (init_fsdp_with_meta_device)";
    if (d_.fsdp_double_buffer)
      for (auto& buf : double_buffer_) buf = at::empty({double_buffer_size_}, opt(cd_));
    if (d_.nccl_ub)  // distributed.nccl_ub: the all-gathers write into registered memory
      for (auto& buf : double_buffer_) shard_.register_buffer(buf);
    // Keep each accumulator alive: a hook on a node that is later recreated would never fire.
    auto& params = model_.params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].frozen) continue;  // autograd computes no gradient for it
      auto acc = torch::autograd::impl::grad_accumulator(params[i].tensor);
      if (!acc) throw std::runtime_error("parameter " + params[i].name + " has no gradient accumulator");
      acc->add_post_hook(std::make_unique<GradReadyHook>(this, int(i)));
      accumulators_.push_back(acc);
    }
    checkpointed_calls_ = instrument_units(model_, d_.activation_checkpointing);
    set_unit_hooks(this);
    take_linear_grads();
  }

  ~FsdpEngine() override {
    set_grad_sink(nullptr);
    set_unit_hooks(nullptr);
    for (auto& b : buckets_)
      if (b.gather) b.gather->wait();
  }

  // ---------------------------------------------------------------------------- step protocol
  void start_step() override {
    norms_ready_ = false;
    for (auto& b : buckets_) {
      if (b.frozen) continue;
      // Strategies 0-1: the persistent gradient buffer is not zeroed here; each parameter's first
      // gradient of the step is copied into it and the later ones added (on_grad_ready), and a
      // parameter that got none is zeroed when its bucket's reduction starts (settle_unwritten).
      // That is one pass less over every gradient per step (the zeroing) and a copy for an add.
      if (strategy_ <= 1)
        for (int pi : b.params) written_[pi] = 0;
      if (strategy_ >= 1) b.grad_shard.zero_();
    }
  }

  void start_micro_batch(bool last) override {
    last_micro_ = last;
    next_launch_ = 0;
    for (auto& b : buckets_) {
      b.pending = int(b.params.size());
      b.ready = false;
      b.reduced_this_micro = false;
    }
  }

  void pre_model_forward() override {
    for (auto& b : buckets_) {
      if (b.unit >= 0) continue;
      if (strategy_ == 3) ensure_gathered(b);
      else wait_gather(b);
    }
    // Start the first unit's weights on their way while the embedding runs.
    if (strategy_ == 3 && d_.overlap_param_gather && !unit_groups_.empty())
      for (int bi : unit_groups_[0]) start_gather(buckets_[bi]);
  }

  void on_grad_ready(int pi) {
    auto& p = model_.params()[pi];
    at::Tensor g = p.tensor.grad();
    // A linear layer's product may have written this parameter's gradient into the bucket already
    // (sink_buffer): then autograd brings none, or only what other uses of it gave (a tied head).
    const bool sunk = sunk_[pi];
    sunk_[pi] = 0;
    if (!g.defined() && !sunk) return;
    const ParamInfo& info = info_[pi];
    Bucket& b = buckets_[info.bucket];
    // The bucket's last gradient of this backward: autograd runs a parameter's accumulator only
    // after every node that used the parameter has run, so no node left in this backward reads
    // the bucket's gathered weights. Under strategy 3 they are freed now, before the full-size
    // gradient buffer is allocated, rather than when the unit's backward ends: a unit of one large
    // parameter (an output head) then holds its weights or its gradient buffer beside autograd's
    // gradient, never all three (DESIGN.md section 5).
    if (strategy_ == 3 && b.unit >= 0 && b.pending == 1) release(b);
    if (g.defined()) {
      at::NoGradGuard ng;
      if (!b.grad_full.defined() && adoptable(b, info, g)) {
        // A bucket of this one parameter, reduced every backward (strategies 2-3): autograd's
        // gradient is the full-size buffer the reduce-scatter reads. No second buffer of the
        // parameter's size and no copy: for an output head or an embedding table, the largest
        // tensors of a step, that is their size off the step's peak.
        b.grad_full = g.reshape({-1});
        track(b.padded * at::elementSize(gd_));
      } else {
        if (!b.grad_full.defined()) {
          b.grad_full = at::zeros({b.padded}, opt(gd_));
          track(b.padded * at::elementSize(gd_));
        }
        at::Tensor dst = b.grad_full.narrow(0, info.offset, info.numel);
        if (strategy_ <= 1 && !written_[pi]) dst.copy_(g.reshape({-1}));
        else dst.add_(g.reshape({-1}));
        written_[pi] = 1;
      }
    }
    p.tensor.mutable_grad() = at::Tensor();  // the main gradient holds it now
    if (--b.pending == 0) {
      b.ready = true;
      if (d_.overlap_grad_reduce && (last_micro_ || strategy_ >= 2)) launch_in_order();
      retire_finished_reduces();
    }
  }

  // ---------------------------------------------------------------- gradients into the buckets
  // GradSink (model/linear.h): every aten::linear of the model becomes mfsdp::linear, whose backward
  // writes the weight's (and bias's) gradient with the product itself into this engine's gradient
  // buffer, as Megatron's gradient-accumulation fusion writes main_grad: the first gradient of a
  // step overwrites (beta 0), later ones add (beta 1). Autograd then holds no gradient tensor for
  // them and on_grad_ready copies nothing. Where the gradient buffer has the compute dtype (fp32,
  // or bf16 without grad_reduce_in_fp32), and for bf16 compute into fp32 main gradients on a CPU
  // that multiplies bf16 in hardware (cpu_bf16_products_native): there the products take bf16
  // operands and accumulate in fp32 straight into the buffer (model/linear.cpp, product_into), so
  // the gradient is never rounded to bf16. Elsewhere (a GPU, or a CPU without bf16 products) a bf16
  // product into fp32 main gradients stays autograd's, converted by the copy.
  // MFSDP_GRAD_INTO_BUCKETS=off keeps every gradient autograd's (bench/ measures both ways).
  void take_linear_grads() {
    sunk_.assign(model_.params().size(), 0);
    const char* knob = std::getenv("MFSDP_GRAD_INTO_BUCKETS");
    if (knob && std::string(knob) == "off") {
      sink_note_ = "; gradients: autograd's, copied into the buckets (MFSDP_GRAD_INTO_BUCKETS=off)";
      return;
    }
    mixed_sink_ = gd_ == at::kFloat && cd_ == at::kBFloat16 && dev_.is_cpu() && cpu_bf16_products_native();
    if (gd_ != cd_ && !mixed_sink_) {
      sink_note_ = fmt::format("; gradients: autograd's {}, converted into the {} buckets", c10::toString(cd_),
                               c10::toString(gd_));
      return;
    }
    const auto& params = model_.params();
    for (size_t pi = 0; pi < params.size(); ++pi)
      if (!params[pi].frozen && !buckets_[info_[pi].bucket].frozen)
        sink_index_[params[pi].tensor.unsafeGetTensorImpl()] = int(pi);
    const SinkCalls calls = use_sink_linear(model_.module());
    if (calls.linear + calls.embedding == 0) return;
    set_grad_sink(this);
    sink_note_ = fmt::format("; gradients: the products of {} linear call site(s) write theirs into the buckets{}{}",
                             calls.linear,
                             calls.embedding ? fmt::format(", {} embedding call site(s) their rows", calls.embedding) : "",
                             mixed_sink_ ? " (BFloat16 products accumulated in the Float buckets)" : "");
  }
  int sink_param(const at::Tensor& t) const override {
    auto it = sink_index_.find(t.unsafeGetTensorImpl());
    const bool dtype = t.scalar_type() == gd_ || (mixed_sink_ && t.scalar_type() == cd_);
    return it != sink_index_.end() && dtype && t.device() == dev_ ? it->second : -1;
  }
  at::Tensor sink_buffer(int pi, bool& accumulate) override {
    const ParamInfo& info = info_[pi];
    Bucket& b = buckets_[info.bucket];
    if (!b.grad_full.defined()) {  // strategies 2-3: the first gradient of this backward into it
      b.grad_full = at::zeros({b.padded}, opt(gd_));
      track(b.padded * at::elementSize(gd_));
    }
    // Strategies 0-1 keep the buffer between steps and overwrite on the step's first gradient
    // (start_step); 2-3 allocate it zeroed for each backward.
    accumulate = strategy_ >= 2 || written_[pi];
    written_[pi] = 1;
    sunk_[pi] = 1;
    return b.grad_full.narrow(0, info.offset, info.numel).view(model_.params()[pi].tensor.sizes());
  }

  // Whether autograd's gradient `g` can serve as bucket b's full gradient buffer: b holds only this
  // parameter, unpadded, in the gradient dtype; the buffer lives for one backward (strategies 2-3;
  // 0-1 accumulate micro-batches into it); `g` is contiguous and its storage is nobody else's (the
  // reduction scales it in place). Two references are the expected count: AccumulateGrad stores a
  // detached alias of the incoming gradient as .grad, and autograd's engine keeps the incoming one
  // in the node's inputs until the post hooks (this call) have run, then drops it unread.
  bool adoptable(const Bucket& b, const ParamInfo& info, const at::Tensor& g) const {
    return strategy_ >= 2 && b.params.size() == 1 && info.offset == 0 && info.numel == b.padded &&
           g.scalar_type() == gd_ && g.is_contiguous() && g.device() == dev_ && !g.is_sparse() &&
           g.storage_offset() == 0 && g.storage().use_count() <= 2 &&
           g.storage().nbytes() == size_t(b.padded) * at::elementSize(gd_);
  }

  // Strategies 2-3: a finished reduce-scatter's full-size gradient buffer is freed at once (its
  // shard added to the main gradients) instead of waiting for the next micro-batch or the step end.
  void retire_finished_reduces() {
    if (strategy_ < 2) return;
    for (auto& b : buckets_) {
      auto& rs = b.reduces;
      for (auto it = rs.begin(); it != rs.end();) {
        if (!it->work->is_completed()) {
          ++it;
          continue;
        }
        absorb_reduce(b, *it);
        it = rs.erase(it);
      }
    }
  }

  void end_micro_batch() override {
    // Strategies 2-3 reduce every backward, 0-1 the last one: what has not started yet starts here,
    // before the trainer's own collectives (the loss sums), so that every rank issues the same
    // sequence whichever buckets its backward completed.
    if (strategy_ >= 2 || last_micro_) launch_remaining();
  }

  // Collectives must be issued in the same order on every rank: NCCL (and MPI) match them by order,
  // so two ranks that start bucket reductions in different orders exchange the wrong buffers, or
  // hang. Which buckets' gradients are complete, and when, can differ between ranks: a parameter
  // that a rank's batch does not reach (an MoE expert that got no tokens, a branch the data did not
  // take) gets no gradient there, so its bucket is never ready in that backward. A ready bucket
  // therefore starts only when every bucket before it in launch_order_ has started; the rest start
  // at the end of the backward, in that order (launch_remaining). In the usual backward, buckets
  // become ready in exactly that order and each starts at once.
  void launch_in_order() {
    while (next_launch_ < launch_order_.size()) {
      Bucket& b = buckets_[launch_order_[next_launch_]];
      if (!b.reduced_this_micro) {
        if (!b.ready) return;
        launch_reduce(b);
      }
      ++next_launch_;
    }
  }

  // Every bucket not yet started, in launch_order_, whether or not its gradients came: one that got
  // none in this backward reduces zeros (strategies 2-3 allocate them here; 0-1 zero the parameters
  // that got none, settle_unwritten), since other ranks may hold gradients for it.
  void launch_remaining() {
    for (int bi : launch_order_) {
      Bucket& b = buckets_[bi];
      if (b.reduced_this_micro) continue;
      if (!b.grad_full.defined()) {
        at::NoGradGuard ng;
        b.grad_full = at::zeros({b.padded}, opt(gd_));
        track(b.padded * at::elementSize(gd_));
      }
      launch_reduce(b);
    }
    next_launch_ = launch_order_.size();
  }

  // Without TP a bucket's gradients are final once its own reductions are in: it is scaled and its
  // norm taken right there, while the later buckets' reductions are still in flight on the
  // progress thread (or the GPU's stream), so grad_norm() has only the partial sums left to add.
  // With TP the sequence-parallel sum over tp comes after every bucket, and the norm after it.
  void finish_grad_sync(double scale) override {
    launch_remaining();
    const bool early = tp_.size() == 1;
    for (auto& b : buckets_) {
      if (b.frozen) continue;
      for (auto& pr : b.reduces) {
        if (strategy_ >= 2) absorb_reduce(b, pr);
        else pr.work->wait();
      }
      b.reduces.clear();
      if (strategy_ >= 1 && replicate_.size() > 1)  // HSDP: shards agree across replicas
        replicate_.all_reduce(b.grad_shard, d_.average_in_collective ? ReduceOp::kAvg : ReduceOp::kSum);
      if (early) {
        if (scale != 1.0) b.grad_shard.mul_(scale);
        b.norm = b.grad_shard.norm();
      }
    }
    norms_ready_ = early;
    sum_sequence_parallel_grads();
    if (scale != 1.0 && !early)
      for (auto& b : buckets_)
        if (!b.frozen) b.grad_shard.mul_(scale);
    if (strategy_ == 3)
      for (auto& b : buckets_)
        if (b.unit >= 0) release(b);  // units whose input needed no grad never ran post_backward
  }

  // Every element counted once: a TP-split parameter's slices differ across the TP group and are
  // summed over it; a replicated one is identical there and counted on this rank only. Then the
  // shards of the data-parallel group, each held by exactly one rank of it, are summed.
  // On the device, no host read: the trainer reads it once per step with the loss (DESIGN.md
  // section 11). Norms per bucket (or per slot) in the gradient dtype, squared and summed in fp64.
  at::Tensor grad_norm() override {
    const auto f64 = opt(at::kDouble);
    at::Tensor split_sq = at::zeros({1}, f64), replicated_sq = at::zeros({1}, f64);
    if (tp_.size() == 1) {
      std::vector<at::Tensor> n;
      for (auto& b : buckets_)
        if (!b.frozen) n.push_back(norms_ready_ ? b.norm : b.grad_shard.norm());
      if (!n.empty()) replicated_sq = at::stack(n).to(at::kDouble).pow(2).sum().reshape({1});
    } else {
      std::vector<at::Tensor> split, replicated;
      for (size_t i = 0; i < slots_.size(); ++i)
        if (!slots_[i].frozen)
          (model_.params()[slot_param_[i]].tp.split() ? split : replicated).push_back(slots_[i].grad.norm());
      auto sum_sq = [&](const std::vector<at::Tensor>& n) {
        return n.empty() ? at::zeros({1}, f64) : at::stack(n).to(at::kDouble).pow(2).sum().reshape({1});
      };
      split_sq = sum_sq(split);
      replicated_sq = sum_sq(replicated);
      tp_.all_reduce(split_sq, ReduceOp::kSum);
    }
    at::Tensor sq = split_sq + replicated_sq;
    if (strategy_ >= 1 && shard_.size() > 1) shard_.all_reduce(sq, ReduceOp::kSum);
    return sq.sqrt().reshape({});
  }

  std::vector<std::string> nonfinite_grads() override {
    std::vector<std::string> bad;
    for (auto& s : slots_)
      if (!s.frozen && !at::isfinite(s.grad).all().item<bool>()) bad.push_back(s.name);
    return bad;
  }

  std::vector<OptimSlot>& slots() override { return slots_; }

  void install_weights(bool trainable_only) override {
    at::NoGradGuard ng;
    for (auto& b : buckets_) {
      if (b.frozen && trainable_only) continue;  // unchanged: no copy, no post-step gather
      if (strategy_ == 0) {
        if (!b.main.is_same(b.full)) b.full.copy_(b.main);
      } else if (strategy_ <= 2) {
        at::Tensor mine = b.full.narrow(0, r_ * b.shard, b.shard);
        if (!b.main.is_same(mine)) mine.copy_(b.main);
        FlightRecorder::instance().set_tag("post-step gather of " + b.name);
        b.gather = shard_.all_gather_async(b.full, mine);
        FlightRecorder::instance().set_tag("");
        if (!d_.overlap_param_gather) wait_gather(b);
      } else {
        if (!b.main.is_same(b.shard_w)) b.shard_w.copy_(b.main);
        release(b);  // the gathered copy is stale now
      }
    }
  }

  std::string describe() const override {
    Memory m = memory();
    int64_t local_elems = 0, frozen_buckets = 0;
    for (auto& b : buckets_) {
      if (b.frozen) ++frozen_buckets;
      else local_elems += strategy_ == 0 ? b.numel : b.shard;
    }
    return fmt::format(
        "megatron_fsdp {} over {} ranks (dp_shard x cp{}): {} buckets ({} units{}{}), compute {}, main weights {}, "
        "gradients {}; this rank holds weights {}, main weights {}, gradients {}, optimizer state ~{} "
        "({}); overlap: grad reduce {}, param gather {}{}{}{}",
        to_string(d_.zero_dp_strategy), S_, replicate_.size() > 1 ? fmt::format(", x{} replicas", replicate_.size()) : "",
        buckets_.size(), unit_groups_.size(), d_.disable_bucketing ? ", one per parameter" : "",
        frozen_buckets ? fmt::format("; {} of frozen parameters, without gradients", frozen_buckets) : "", c10::toString(cd_),
        c10::toString(md_), c10::toString(gd_), human_bytes(double(m.weights)), human_bytes(double(m.main_weights)),
        human_bytes(double(m.grads)), human_bytes(4.0 * optim_states_ * double(local_elems)),
        optim_states_ == 0 ? optim_name_ + ": no state"
                           : fmt::format("{}: {} fp32 per local element", optim_name_, optim_states_),
        d_.overlap_grad_reduce ? "on" : "off",
        d_.overlap_param_gather ? "on" : "off", d_.fsdp_double_buffer ? ", double buffer" : "",
        strategy_ != 3 || unit_groups_.empty() ? ""
        : keep_last_ ? "; the forward's last unit stays gathered for its backward"
                     : "; every unit freed after its forward (MFSDP_KEEP_LAST_UNIT=off)",
        checkpointed_calls_ ? fmt::format("; activation checkpointing: {} unit calls recomputed in backward", checkpointed_calls_)
                            : "") + init_note_ + sink_note_;
  }

  const std::vector<SlotRange>& slot_ranges() const override { return ranges_; }
  bool checkpoint_writer() const override {
    return strategy_ == 0 ? dpcp_.rank() == 0 : replicate_.rank() == 0;
  }

  int rebind_parameters() override {
    int replaced = 0;
    auto& params = model_.params();
    for (size_t pi = 0; pi < params.size(); ++pi) {
      std::vector<std::string> names = params[pi].aliases;
      names.insert(names.begin(), params[pi].name);
      for (const auto& name : names) {
        auto dot = name.rfind('.');
        torch::jit::Module owner = submodule_at(model_.module(), dot == std::string::npos ? "" : name.substr(0, dot));
        at::Tensor current = owner.attr(dot == std::string::npos ? name : name.substr(dot + 1)).toTensor();
        if (current.is_same(params[pi].tensor)) continue;
        if (current.sizes() != params[pi].tensor.sizes() && current.sizes().vec() != params[pi].global_shape())
          throw UserError(fmt::format("parameter {} was replaced by a tensor of shape [{}], expected [{}]", name,
                                      fmt::join(current.sizes(), ", "), fmt::join(params[pi].global_shape(), ", ")));
        set_param_value(int(pi), current.detach());
        ++replaced;
      }
      for (const auto& name : names) {
        auto dot = name.rfind('.');
        torch::jit::Module owner = submodule_at(model_.module(), dot == std::string::npos ? "" : name.substr(0, dot));
        owner.register_parameter(dot == std::string::npos ? name : name.substr(dot + 1), params[pi].tensor, false);
      }
    }
    return replaced;
  }

  void load_full_weights(const std::vector<std::pair<std::string, at::Tensor>>& weights) override {
    std::map<std::string, int> by_name;
    for (size_t pi = 0; pi < model_.params().size(); ++pi) {
      by_name[model_.params()[pi].name] = int(pi);
      for (const auto& a : model_.params()[pi].aliases) by_name[a] = int(pi);
    }
    for (const auto& [name, value] : weights) {
      auto it = by_name.find(name);
      if (it == by_name.end()) throw UserError("no parameter named " + name + " in " + model_.path());
      set_param_value(it->second, value);
    }
  }

  int64_t take_peak_bytes() override {
    Memory m = memory();
    int64_t peak = m.weights + m.main_weights + m.grads + transient_peak_;
    transient_peak_ = transient_;
    last_gathered_peak_ = gathered_peak_;
    gathered_peak_ = gathered_;
    return peak;
  }

  int64_t gathered_peak_bytes() const override { return last_gathered_peak_; }

  Memory memory() const override {
    Memory m;
    const int64_t ce = at::elementSize(cd_), me = at::elementSize(md_), ge = at::elementSize(gd_);
    for (auto& b : buckets_) {
      m.weights += (strategy_ == 3 ? b.shard : b.padded) * ce;
      const bool main_alias = md_ == cd_;
      if (!main_alias) m.main_weights += (strategy_ == 0 ? b.padded : b.shard) * me;
      if (!b.frozen) m.grads += (strategy_ <= 1 ? b.padded : 0) * ge + (strategy_ >= 1 ? b.shard : 0) * ge;
    }
    if (d_.fsdp_double_buffer) m.weights += 2 * double_buffer_[0].numel() * ce;
    return m;
  }

  // ---------------------------------------------------------------------------- unit hooks
  // Under strategy 3 a unit's weights are gathered for its forward and freed after it, then
  // gathered again from the backward of its post_forward until the backward of its pre_forward.
  // The exception is the unit that runs last in a forward that backward follows: its backward is
  // the first to run, right after the loss, so freeing it would only gather it again at once. It
  // keeps its weights until its backward is done (FSDP2's reshard_after_forward=False for the last
  // block, as torchtitan applies it): one all-gather fewer per micro-batch, at no extra peak (in
  // backward the engine holds that unit and the prefetched one before it either way). Which unit
  // is last is what the previous forward showed (the post_forward before the first pre_backward);
  // before any, the highest index (units are numbered in forward order). A guess that is wrong
  // only holds that unit's weights longer: its backward frees them.
  // With activation checkpointing the recomputed forward comes first in that window: it gathers
  // (or finds gathered, by the previous unit's prefetch), prefetches the unit before it (backward
  // order, not the next one, which is already done and freed), and does not free at its end, so
  // the backward that follows uses the same copy: one all-gather per unit in backward.
  void pre_forward(int unit) override {
    if (unit < 0) return;
    for (int bi : unit_groups_[unit]) {
      if (strategy_ == 3) ensure_gathered(buckets_[bi]);
      else wait_gather(buckets_[bi]);
    }
    if (strategy_ != 3 || !d_.overlap_param_gather) return;
    const int next = recomputing_ == unit ? unit - 1 : unit + 1;
    if (next >= 0 && next < int(unit_groups_.size()))
      for (int bi : unit_groups_[next]) start_gather(buckets_[bi]);
  }
  void post_forward(int unit, bool backward_follows) override {
    if (unit < 0 || strategy_ != 3 || recomputing_ == unit) return;
    if (backward_follows && keep_last_) {
      forward_last_ = unit;
      if (unit == keep_unit_) return;
    }
    for (int bi : unit_groups_[unit]) release(buckets_[bi]);
  }
  void pre_backward(int unit) override {
    if (unit < 0 || strategy_ != 3) return;
    if (forward_last_ >= 0) keep_unit_ = forward_last_;
    for (int bi : unit_groups_[unit]) ensure_gathered(buckets_[bi]);
    if (d_.overlap_param_gather && unit > 0)
      for (int bi : unit_groups_[unit - 1]) start_gather(buckets_[bi]);
  }
  void post_backward(int unit) override {
    if (unit >= 0 && strategy_ == 3)
      for (int bi : unit_groups_[unit]) release(buckets_[bi]);
  }
  void recompute(int unit, bool begin) override { recomputing_ = begin ? unit : -1; }

  int64_t gathers_issued() const override { return gathers_issued_; }

 private:
  void build_buckets(const Config& cfg) {
    const auto& params = model_.params();
    info_.resize(params.size());
    written_.assign(params.size(), 0);
    auto add1 = [&](std::string name, int unit, const std::vector<int>& members, bool frozen) {
      Bucket b;
      b.name = std::move(name);
      b.unit = unit;
      b.frozen = frozen;
      b.params = members;
      for (int pi : members) {
        info_[pi].name = params[pi].name;
        info_[pi].bucket = int(buckets_.size());
        info_[pi].offset = b.numel;
        info_[pi].numel = params[pi].tensor.numel();
        b.numel += info_[pi].numel;
      }
      b.padded = (b.numel + S_ - 1) / S_ * S_;
      b.shard = b.padded / S_;
      buckets_.push_back(std::move(b));
    };
    // Frozen parameters go into buckets of their own (a unit then has two): a bucket either has
    // gradients for all of its elements or for none.
    auto add = [&](const std::string& name, int unit, const std::vector<int>& members) {
      std::vector<int> trainable, frozen;
      for (int pi : members) (params[pi].frozen ? frozen : trainable).push_back(pi);
      if (!trainable.empty()) {
        add1(name, unit, trainable, false);
        if (unit >= 0) unit_groups_[unit].push_back(int(buckets_.size()) - 1);
      }
      if (!frozen.empty()) {
        add1(trainable.empty() ? name : name + " (frozen)", unit, frozen, true);
        if (unit >= 0) unit_groups_[unit].push_back(int(buckets_.size()) - 1);
      }
    };
    std::vector<int> rest;
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].unit < 0) rest.push_back(int(i));
    unit_groups_.assign(model_.units().size(), {});
    keep_unit_ = int(model_.units().size()) - 1;
    if (d_.disable_bucketing) {
      // One collective per parameter; a unit still gathers and frees its parameters together.
      for (size_t i = 0; i < params.size(); ++i) add(params[i].name, params[i].unit, {int(i)});
    } else {
      for (size_t u = 0; u < model_.units().size(); ++u) add(model_.units()[u].path, int(u), model_.units()[u].params);
      if (!rest.empty()) add("(outside units)", -1, rest);
    }
    // Double buffering: each block's buckets sit side by side in buffer (unit % 2); a leaf unit
    // outside the blocks (an embedding table or output head, usually larger than a block) is
    // allocated when gathered, as the buffers are sized by the largest unit they hold.
    for (size_t u = 0; u < unit_groups_.size(); ++u) {
      if (!model_.units()[u].block) continue;
      const auto& group = unit_groups_[u];
      int64_t off = 0;
      for (int bi : group) {
        buckets_[bi].dbuf_offset = off;
        off += buckets_[bi].padded;
      }
      double_buffer_size_ = std::max(double_buffer_size_, off);
    }
    (void)cfg;
  }

  // The value of one parameter (full, unsharded) into whatever this rank holds of it.
  void set_param_value(int pi, const at::Tensor& value) {
    at::NoGradGuard ng;
    const ParamInfo& info = info_[pi];
    Bucket& b = buckets_[info.bucket];
    const auto& p = model_.params()[pi];
    at::Tensor v = value;
    if (p.tp.split() && value.numel() == p.global_numel()) {  // a full tensor: take this rank's slice
      at::Tensor local = at::empty({info.numel}, value.scalar_type());
      at::Tensor src = value.reshape({-1});
      p.tp.for_each_run(0, info.numel, [&](int64_t g, int64_t l, int64_t len) {
        local.narrow(0, l, len).copy_(src.narrow(0, g, len));
      });
      v = local;
    }
    if (v.numel() != info.numel)
      throw UserError(fmt::format("parameter {}: {} elements given, {} expected", info.name, value.numel(), p.global_numel()));
    at::Tensor flat = v.reshape({-1}).to(at::kFloat);
    if (strategy_ <= 2) b.full.narrow(0, info.offset, info.numel).copy_(flat);
    const int64_t lo_shard = strategy_ == 0 ? 0 : r_ * b.shard, hi_shard = strategy_ == 0 ? b.padded : lo_shard + b.shard;
    const int64_t lo = std::max(info.offset, lo_shard), hi = std::min(info.offset + info.numel, hi_shard);
    if (hi > lo) {
      at::Tensor part = flat.narrow(0, lo - info.offset, hi - lo);
      if (strategy_ == 3) b.shard_w.narrow(0, lo - lo_shard, hi - lo).copy_(part);
      if (!b.main.is_same(b.full) && !(strategy_ == 3 && b.main.is_same(b.shard_w)) &&
          !(strategy_ >= 1 && strategy_ <= 2 && md_ == cd_))
        b.main.narrow(0, lo - lo_shard, hi - lo).copy_(part);
    }
    if (strategy_ == 3) release(b);  // a gathered copy would be stale
  }

  // ---- init_fsdp_with_meta_device: each rank initialises only its shard. Random values come in
  // chunks of 64 Ki elements seeded by (parameter name, chunk, training.seed), so every element
  // gets the same value whatever the world size or strategy, and no rank generates more than its
  // shard (plus one chunk at each end).
  struct InitRule {
    std::string kind;  // zeros, ones, normal, uniform
    double scale = 0;
  };

  InitRule rule_for(int pi) const {
    const auto& p = model_.params()[pi];
    std::vector<std::string> names = p.aliases;
    names.insert(names.begin(), p.name);
    for (const auto& r : model_cfg_.init_rules) {
      auto eq = r.find('=');
      std::string glob = r.substr(0, eq), spec = r.substr(eq + 1);
      for (const auto& n : names)
        if (glob_match(glob, n)) {
          if (spec == "zeros" || spec == "ones") return {spec, 0};
          auto colon = spec.find(':');
          return {spec.substr(0, colon), std::strtod(spec.c_str() + colon + 1, nullptr)};
        }
    }
    if (p.name.size() >= 4 && p.name.compare(p.name.size() - 4, 4, "bias") == 0) return {"zeros", 0};
    if (p.tensor.dim() == 1) return {"ones", 0};
    return {"normal", model_cfg_.init_std};
  }

  static uint64_t fnv1a(const std::string& s) {
    uint64_t h = 1469598103934665603ULL;
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
    return h;
  }

  // Writes the values of elements [from, to) of this rank's (TP slice of) parameter pi into out.
  void init_values(int pi, int64_t from, int64_t to, at::Tensor out) const {
    model_.params()[pi].tp.for_each_run(from, to, [&](int64_t g, int64_t l, int64_t len) {
      init_global_values(pi, g, g + len, out.narrow(0, l - from, len));
    });
  }

  // Elements [from, to) of the global parameter: the same values whatever the TP or DP layout.
  void init_global_values(int pi, int64_t from, int64_t to, at::Tensor out) const {
    const InitRule rule = rule_for(pi);
    if (rule.kind == "zeros") return void(out.zero_());
    if (rule.kind == "ones") return void(out.fill_(1));
    constexpr int64_t kChunk = 1 << 16;
    const int64_t numel = model_.params()[pi].global_numel();
    const uint64_t base = fnv1a(model_.params()[pi].name) ^ (seed_ * 0x9E3779B97F4A7C15ULL);
    for (int64_t c = from / kChunk; c * kChunk < to; ++c) {
      const int64_t c0 = c * kChunk, c1 = std::min(numel, c0 + kChunk);
      at::Generator gen = at::detail::createCPUGenerator(base + uint64_t(c) * 0xBF58476D1CE4E5B9ULL);
      at::Tensor vals = at::empty({c1 - c0}, at::kFloat);
      if (rule.kind == "normal") vals.normal_(0.0, rule.scale, gen);
      else vals.uniform_(-rule.scale, rule.scale, gen);
      const int64_t lo = std::max(from, c0), hi = std::min(to, c1);
      out.narrow(0, lo - from, hi - lo).copy_(vals.narrow(0, lo - c0, hi - lo));
    }
  }

  // Fills `dst`, which holds bucket elements [start, start + dst.numel()), from the rules.
  void init_range(const Bucket& b, at::Tensor dst, int64_t start) const {
    dst.zero_();
    const int64_t end = start + dst.numel();
    for (int pi : b.params) {
      const ParamInfo& info = info_[pi];
      const int64_t lo = std::max(start, info.offset), hi = std::min(end, info.offset + info.numel);
      if (hi > lo) init_values(pi, lo - info.offset, hi - info.offset, dst.narrow(0, lo - start, hi - lo));
    }
  }

  // Main weights wider than the compute copy (bf16 compute, preserve_fp32_weights) take their
  // values from the source, never from the rounded copy: the trainer leaves the model's parameters
  // in the file's dtype until here, so an fp32 file's weights start the run at full precision, as
  // PyTorch's fp32 master weights do (rounding them first put the main weights up to half a bf16
  // step off the file's: 1.2e-2 on an embedding table of N(0, 1) values, a hundred Adam steps of
  // 1e-4). `from`, `len`: the bucket elements this rank's main weights hold.
  at::Tensor source_main(const Bucket& b, int64_t from, int64_t len) const {
    at::Tensor out = at::zeros({len}, opt(md_));
    if (model_.loaded_on_meta()) {  // the init rules' values, drawn in fp32 (init_global_values)
      init_range(b, out, from);
      return out;
    }
    for (int pi : b.params) {
      const ParamInfo& info = info_[pi];
      const int64_t lo = std::max(from, info.offset), hi = std::min(from + len, info.offset + info.numel);
      if (hi > lo)
        out.narrow(0, lo - from, hi - lo)
            .copy_(model_.params()[pi].tensor.detach().reshape({-1}).narrow(0, lo - info.offset, hi - lo));
    }
    return out;
  }

  void build_buffers(Bucket& b, int index) {
    at::NoGradGuard ng;
    auto& params = model_.params();
    const bool wider = md_ != cd_;
    // This rank's main weights, as elements of the bucket: the whole of it under strategy 0.
    const int64_t main_from = strategy_ == 0 ? 0 : r_ * b.shard, main_len = strategy_ == 0 ? b.padded : b.shard;
    at::Tensor main = wider ? source_main(b, main_from, main_len) : at::Tensor();
    if (model_.loaded_on_meta()) {
      // The full buffer is reserved but never written here (no pages touched under strategy 3).
      b.full = at::empty({b.padded}, opt(cd_));
      for (int pi : b.params)
        params[pi].tensor.set_data(b.full.narrow(0, info_[pi].offset, info_[pi].numel).view(params[pi].tensor.sizes()));
      if (strategy_ == 3) {
        b.shard_w = at::empty({b.shard}, opt(cd_));
        if (wider) b.shard_w.copy_(main);
        else init_range(b, b.shard_w, r_ * b.shard);
        b.main = wider ? main : b.shard_w;
        b.gathered = true;
        track_gathered(int64_t(b.padded) * int64_t(at::elementSize(cd_)));
        release(b);
      } else {
        at::Tensor mine = b.full.narrow(0, r_ * b.shard, b.shard);
        if (wider) mine.copy_(main.narrow(0, r_ * b.shard - main_from, b.shard));
        else init_range(b, mine, r_ * b.shard);
        // Strategies 1-2 hold the full weights: gathered. Strategy 0's `mine` is the whole bucket,
        // initialised here on every rank (the rules' values do not depend on the layout).
        if (strategy_ != 0) shard_.all_gather(b.full, mine);
        b.main = wider ? main : (strategy_ == 0 ? b.full : mine);
      }
      if (!b.frozen) {
        if (strategy_ <= 1) b.grad_full = at::zeros({b.padded}, opt(gd_));
        b.grad_shard = strategy_ == 0 ? b.grad_full : at::zeros({b.shard}, opt(gd_));
      }
      return;
    }
    b.full = at::zeros({b.padded}, opt(cd_));
    for (int pi : b.params) {
      const ParamInfo& info = info_[pi];
      at::Tensor view = b.full.narrow(0, info.offset, info.numel).view(params[pi].tensor.sizes());
      view.copy_(params[pi].tensor.detach());
      params[pi].tensor.set_data(view);  // the parameter is now a view into the flat buffer
    }
    if (strategy_ == 3) {
      b.shard_w = b.full.narrow(0, r_ * b.shard, b.shard).clone();
      b.main = wider ? main : b.shard_w;
      b.gathered = true;
      track_gathered(int64_t(b.padded) * int64_t(at::elementSize(cd_)));  // the initial full buffer
      release(b);
    } else if (strategy_ == 0) {
      b.main = wider ? main : b.full;
    } else {
      b.main = wider ? main : b.full.narrow(0, r_ * b.shard, b.shard);
    }
    if (!b.frozen) {
      if (strategy_ <= 1) b.grad_full = at::zeros({b.padded}, opt(gd_));
      b.grad_shard = strategy_ == 0 ? b.grad_full : at::zeros({b.shard}, opt(gd_));
    }
    (void)index;
  }

  void build_slots(const Config& cfg) {
    auto& params = model_.params();
    for (size_t pi = 0; pi < params.size(); ++pi) {
      const ParamInfo& info = info_[pi];
      const Bucket& b = buckets_[info.bucket];
      const int64_t lo_shard = strategy_ == 0 ? 0 : r_ * b.shard, hi_shard = strategy_ == 0 ? b.padded : lo_shard + b.shard;
      const int64_t lo = std::max(info.offset, lo_shard), hi = std::min(info.offset + info.numel, hi_shard);
      if (hi <= lo) continue;  // none of this parameter lives on this rank
      OptimSlot s;
      s.name = info.name;
      s.weight = b.main.narrow(0, lo - lo_shard, hi - lo);
      if (!b.frozen) s.grad = b.grad_shard.narrow(0, lo - lo_shard, hi - lo);
      s.frozen = b.frozen;
      s.decay = params[pi].tensor.dim() >= 2 || cfg.optimizer.decay_norm_and_bias;
      slots_.push_back(s);
      slot_param_.push_back(int(pi));
      ranges_.push_back({params[pi].global_shape(), lo - info.offset, hi - info.offset, params[pi].tp,
                         tp_.size() > 1 && !params[pi].tp.split()});
    }
  }

  // Sequence parallel: parameters replicated over TP that saw only this rank's part of the sequence
  // (norms, rowwise biases) hold partial gradients; one all-reduce over TP sums all of them.
  void sum_sequence_parallel_grads() {
    if (tp_.size() == 1) return;
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < slots_.size(); ++i)
      if (model_.params()[slot_param_[i]].tp_grad_sum && !slots_[i].frozen) parts.push_back(slots_[i].grad.reshape({-1}));
    if (parts.empty()) return;
    at::Tensor packed = at::cat(parts);
    FlightRecorder::instance().set_tag("sum sequence-parallel gradients over tp");
    tp_.all_reduce(packed, ReduceOp::kSum);
    FlightRecorder::instance().set_tag("");
    int64_t off = 0;
    for (auto& part : parts) {
      part.copy_(packed.narrow(0, off, part.numel()));
      off += part.numel();
    }
  }

  // Strategies 0-1, before a bucket's gradients are read: the regions of parameters that received
  // no gradient this step (unused by every micro-batch) still hold an earlier step's; zero them.
  // (Padding is zero from the buffer's allocation and never written.)
  void settle_unwritten(Bucket& b) {
    if (strategy_ > 1) return;
    for (int pi : b.params)
      if (!written_[pi]) {
        b.grad_full.narrow(0, info_[pi].offset, info_[pi].numel).zero_();
        written_[pi] = 1;
      }
  }

  void launch_reduce(Bucket& b) {
    if (b.reduced_this_micro) return;
    b.reduced_this_micro = true;
    settle_unwritten(b);
    // Gradients are summed over context-parallel ranks (each holds part of every sequence) and
    // averaged over data-parallel ones (each holds other samples): the reduction group is dp x cp.
    const int dp = dp_.size();
    ReduceOp op = d_.average_in_collective ? ReduceOp::kAvg : ReduceOp::kSum;
    FlightRecorder::instance().set_tag("reduce gradients of " + b.name);
    if (!d_.calculate_per_token_loss && !d_.average_in_collective && dp > 1) b.grad_full.div_(dp);
    if (d_.average_in_collective && cp_size_ > 1) b.grad_full.mul_(cp_size_);  // the average divides by dp x cp
    if (strategy_ == 0) {
      b.reduces.push_back({dpcp_.all_reduce_async(b.grad_full, op), {}, {}});
    } else if (strategy_ == 1) {
      b.reduces.push_back({shard_.reduce_scatter_async(b.grad_shard, b.grad_full, op), {}, b.grad_full});
    } else {
      // Accumulate an earlier micro-batch's result first, so that at most one is in flight.
      for (auto& pr : b.reduces) absorb_reduce(b, pr);
      b.reduces.clear();
      limit_reduces_in_flight();
      at::Tensor out = at::empty({b.shard}, opt(gd_));
      b.reduces.push_back({shard_.reduce_scatter_async(out, b.grad_full, op), out, b.grad_full, ++reduce_order_});
      b.grad_full = at::Tensor();  // the next backward starts a new one; this one is freed when reduced
    }
    FlightRecorder::instance().set_tag("");
  }

  // Strategies 2-3: at most kMaxReducesInFlight reduce-scatters in flight; before another starts,
  // the oldest is waited for and its full-size gradient buffer freed. Without the cap a backward
  // that outruns its reductions (CPU ranks sharing cores, a slow network) keeps every finished
  // unit's full gradient alive until the reductions catch up: measured on a 322 M-parameter Llama
  // at 4 ranks on 2 cores, 6-7 layers' gradients at once (bench/results_init_from.md). Two in
  // flight still overlap one unit's reduction with the next unit's backward, which is all the
  // overlap a step has (PyTorch FSDP2 likewise waits for the previous reduce-scatter). The wait is
  // the host's on CPU and a stream wait on the GPU.
  static constexpr int kMaxReducesInFlight = 2;
  void limit_reduces_in_flight() {
    while (true) {
      Bucket* oldest = nullptr;
      int in_flight = 0;
      for (auto& b : buckets_)
        for (auto& pr : b.reduces) {
          ++in_flight;
          if (!oldest || pr.order < oldest->reduces.front().order) oldest = &b;
        }
      if (in_flight < kMaxReducesInFlight) return;
      absorb_reduce(*oldest, oldest->reduces.front());  // one per bucket under strategies 2-3
      oldest->reduces.erase(oldest->reduces.begin());
    }
  }
  uint64_t reduce_order_ = 0;

  // Strategies 2-3: a reduce-scatter's result into the shard gradient, once it is done; its
  // full-size gradient buffer leaves the accounting (the caller drops the entry, freeing it).
  void absorb_reduce(Bucket& b, PendingReduce& pr) {
    pr.work->wait();
    b.grad_shard.add_(pr.out);
    track(-b.padded * int64_t(at::elementSize(gd_)));
  }

  // ---- strategy 3 storage: allocated in place before use, freed after
  c10::StorageImpl* storage(Bucket& b) { return b.full.storage().unsafeGetStorageImpl(); }

  void start_gather(Bucket& b) {
    if (b.gathered) return;
    const size_t bytes = size_t(b.padded) * at::elementSize(cd_);
    if (double_buffered(b)) {
      // Two persistent buffers used alternately by consecutive units: nothing is allocated.
      void* p = static_cast<char*>(double_buffer_[b.unit % 2].data_ptr()) + b.dbuf_offset * at::elementSize(cd_);
      storage(b)->set_data_ptr_noswap(at::DataPtr(p, dev_));
    } else {
      // The storage's own allocator: the CPU's, or CUDA's caching allocator on the current stream
      // (the caller's), where release() hands it back after the gather's wait() ordered that stream
      // after the collective (DESIGN.md section 11).
      storage(b)->set_data_ptr_noswap(storage(b)->allocator()->allocate(bytes));
      track_gathered(int64_t(bytes));
    }
    storage(b)->set_nbytes(bytes);
    FlightRecorder::instance().set_tag("gather weights of " + b.name);
    b.gather = shard_.all_gather_async(b.full, b.shard_w);
    FlightRecorder::instance().set_tag("");
    b.gathered = true;
    if (b.unit >= 0) ++gathers_issued_;
  }

  void wait_gather(Bucket& b) {
    if (b.gather) {
      b.gather->wait();
      b.gather.reset();
    }
  }

  void ensure_gathered(Bucket& b) {
    start_gather(b);
    wait_gather(b);
  }

  bool double_buffered(const Bucket& b) const {
    return d_.fsdp_double_buffer && b.unit >= 0 && model_.units()[size_t(b.unit)].block;
  }

  void release(Bucket& b) {
    if (strategy_ != 3 || !b.gathered) return;
    wait_gather(b);  // never free memory a collective is writing into
    if (!double_buffered(b)) track_gathered(-int64_t(storage(b)->nbytes()));
    storage(b)->set_data_ptr_noswap(at::DataPtr(nullptr, dev_));
    storage(b)->set_nbytes(0);
    b.gathered = false;
  }

  Model& model_;
  c10::Device dev_;  // where every buffer lives: the model's device
  const DistributedConfig& d_;
  at::TensorOptions opt(at::ScalarType t) const { return at::TensorOptions().dtype(t).device(dev_); }
  int strategy_;
  Communicator &dp_, &shard_, &replicate_, &tp_, &dpcp_;
  int cp_size_ = 1;
  std::vector<int> slot_param_;  // slot -> parameter index
  const ModelConfig& model_cfg_;
  uint64_t seed_;
  int optim_states_;
  std::string optim_name_;
  at::ScalarType cd_, md_, gd_;
  int64_t S_ = 1, r_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<ParamInfo> info_;
  std::vector<uint8_t> written_;   // strategies 0-1: whether parameter pi's gradient was stored this step
  std::vector<uint8_t> sunk_;      // parameter pi's gradient was written into its bucket by a product
  std::unordered_map<const c10::TensorImpl*, int> sink_index_;  // parameters whose gradients products write
  std::string sink_note_;
  bool mixed_sink_ = false;  // bf16 parameters' products write into the fp32 buffers (take_linear_grads)
  std::vector<int> launch_order_;  // buckets' reductions start in this order on every rank
  size_t next_launch_ = 0;         // launch_order_[next_launch_] is the next to start
  std::vector<std::vector<int>> unit_groups_;  // unit -> its buckets (one, or one per parameter)
  int64_t double_buffer_size_ = 0;
  std::vector<OptimSlot> slots_;
  std::vector<SlotRange> ranges_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  at::Tensor double_buffer_[2];
  bool last_micro_ = true;
  bool norms_ready_ = false;  // finish_grad_sync took every bucket's norm (tp 1); start_step clears it
  int checkpointed_calls_ = 0;
  int recomputing_ = -1;          // the unit whose forward is being recomputed in backward, else -1
  // Strategy 3: the unit kept gathered from its forward to its backward (set with the buckets);
  // MFSDP_KEEP_LAST_UNIT=off frees every unit after its forward (for side-by-side measurement).
  bool keep_last_ = [] {
    const char* knob = std::getenv("MFSDP_KEEP_LAST_UNIT");
    return !(knob && std::string(knob) == "off");
  }();
  int keep_unit_ = -1;
  int forward_last_ = -1;  // the unit whose post_forward came last in the latest forward with a backward
  int64_t gathers_issued_ = 0;    // strategy 3 unit gathers since start (metrics: gathers per step)
  std::string init_note_;
  int64_t transient_ = 0, transient_peak_ = 0;  // gathered weights and gradients in flight, in bytes
  // Gathered weights alone (strategy 3): allocated and freed by the main thread in issue order, so
  // their peak does not move with when the progress thread finishes a reduction (the tests'
  // comparisons of what a schedule holds rely on that).
  int64_t gathered_ = 0, gathered_peak_ = 0, last_gathered_peak_ = 0;

  void track(int64_t delta) {
    transient_ += delta;
    transient_peak_ = std::max(transient_peak_, transient_);
  }
  void track_gathered(int64_t delta) {
    track(delta);
    gathered_ += delta;
    gathered_peak_ = std::max(gathered_peak_, gathered_);
  }
};

torch::autograd::variable_list GradReadyHook::operator()(const torch::autograd::variable_list& outputs,
                                                         const torch::autograd::variable_list&) {
  engine_->on_grad_ready(param_);
  return outputs;
}

}  // namespace

std::unique_ptr<ParallelEngine> make_engine(Model& model, const Config& cfg, ProcessGroups& pg) {
  const auto& d = cfg.distributed;
  if (d.nccl_ub && pg.get(MeshGroup::kDpShardCp).backend() != Backend::kNccl)
    throw ConfigError(cfg.where("distributed.nccl_ub") + ": distributed.nccl_ub registers NCCL user buffers, but this "
                      "run's collectives use MPI (" + (model.device().is_cuda() ? "CUDA tensors staged through host "
                      "memory: distributed.backend mpi, or several ranks on one GPU" : "CPU tensors") +
                      "), where there is nothing to register; use training.device: cuda with distributed.backend: nccl");
  return std::make_unique<FsdpEngine>(model, cfg, pg);
}

}  // namespace mfsdp
