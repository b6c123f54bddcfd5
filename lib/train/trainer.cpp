// The training loop, one optimizer step at a time:
//   1. every micro-batch of this rank: forward, cross entropy with the loss mask, backward; the
//      engine's hooks move each finished gradient into its bucket and, on the last micro-batch,
//      start the bucket's reduction across data-parallel ranks while backward continues;
//   2. wait for the reductions; normalise (per token over the global batch, or per micro-batch);
//   3. global gradient norm, NaN check, clipping;
//   4. optimizer step on the main weights with the scheduled learning rate; install the weights;
//   5. metrics, evaluation, logging.
#include "train/trainer.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <torch/script.h>
#include <torch/utils.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>

#include <atomic>
#include <csignal>
#include <fstream>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "checkpoint/init_from.h"
#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "comm/mpi_env.h"
#include "data/batch_prefetcher.h"
#include "data/gpt_dataset.h"
#include "device/device.h"
#include "device/host_cache.h"
#include "fsdp/engine.h"
#include "mesh/device_mesh.h"
#include "mesh/process_groups.h"
#include "model/fast_ops.h"
#include "model/model.h"
#include "optim/optimizer.h"
#include "parallel/context_parallel.h"
#include "parallel/tensor_parallel.h"
#include "parallel/cross_entropy.h"
#include "parallel/tp_ops.h"
#include "train/metrics.h"
#include "train/profiler.h"
#include "train/system.h"
#include "train/tensorboard.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {
namespace {

// A Hugging Face trace (scripts/export_hf.py) bakes the dtype it was traced in into its graph:
// transformers' norms compute in fp32 and cast back with `.to(input_dtype)`, which the tracer
// records as a cast to that dtype. A file traced in fp32 then cannot compute in bf16 (its norms hand
// fp32 to bf16 matrix products), and one traced in bf16 computes partly in bf16 whatever
// model.compute_dtype says (measured: 1.2e-4 off PyTorch fp32 training in 20 steps). So the
// compute dtype must be the traced one. The dtype is the file's record (hf_export.json "dtype"),
// else, for files written before the record existed, that of its first floating parameter.
void check_traced_dtype(const Model& model, const Config& cfg) {
  if (model.stored_hf_export().empty()) return;
  std::string traced;
  try {
    auto j = nlohmann::json::parse(model.stored_hf_export());
    if (j.contains("dtype") && j["dtype"].is_string()) traced = j["dtype"].get<std::string>();
  } catch (const std::exception&) {
  }
  if (traced.empty())
    for (const auto& p : model.params())
      if (p.tensor.is_floating_point()) {
        traced = p.tensor.scalar_type() == at::kBFloat16 ? "bf16" : p.tensor.scalar_type() == at::kFloat ? "fp32" : "";
        break;
      }
  if (traced.empty() || traced == cfg.model.compute_dtype) return;
  throw ConfigError(cfg.where("model.compute_dtype") +
                    fmt::format(": model.compute_dtype is {}, but {} was traced in {} by scripts/export_hf.py, and a trace keeps the dtype "
                                "of its casts (the norms' cast back to the input's dtype); set model.compute_dtype: {}, "
                                "or export the model again with --dtype {}{}",
                                cfg.model.compute_dtype, model.path(), traced, traced, cfg.model.compute_dtype,
                                cfg.model.compute_dtype == "bf16"
                                    ? " (fp32 main weights beside bf16 compute: distributed.preserve_fp32_weights)"
                                    : ""));
}


using Clock = std::chrono::steady_clock;

// SLURM's warning signals (SIGUSR1 with --signal, SIGTERM at preemption): finish the step, save,
// exit 0. The handler only sets a flag; the ranks agree on it after every step.
std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

// The directories rank 0 made for this run, innermost last, while set-up runs: a rank that fails in
// set-up aborts the job, and mpirun/srun then TERM the others (rank 0 waiting in a collective)
// before they can unwind. The handler removes those directories where they are still empty
// (rmdir is async-signal-safe; a flight record dumped into one keeps it) and dies of the signal.
char g_setup_dirs[32][4096];
std::atomic<int> g_setup_ndirs{0};
extern "C" void on_setup_kill(int sig) {
  for (int i = g_setup_ndirs.load() - 1; i >= 0; --i) ::rmdir(g_setup_dirs[i]);
  std::signal(sig, SIG_DFL);
  ::raise(sig);
}
void guard_setup_dirs(const std::vector<std::string>& dirs) {
  int n = 0;  // the innermost 32 (an outer one cannot go before them)
  for (size_t i = dirs.size() > 32 ? dirs.size() - 32 : 0; i < dirs.size(); ++i)
    if (dirs[i].size() < sizeof g_setup_dirs[0]) std::snprintf(g_setup_dirs[n++], sizeof g_setup_dirs[0], "%s", dirs[i].c_str());
  g_setup_ndirs.store(n);
  std::signal(SIGTERM, on_setup_kill);  // until install_stop_signal_handlers (SIGINT stays main's)
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Creates `path` and its missing parents; returns the directories it created, outermost first
// (a run that fails in set-up removes them again if they are still empty).
std::vector<std::string> make_dirs(const std::string& path) {
  std::vector<std::string> created;
  std::string cur;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      if (!cur.empty()) {
        if (::mkdir(cur.c_str(), 0755) == 0) created.push_back(cur);
        else if (errno != EEXIST)
          throw UserError(cur + ": cannot create the run directory (run_dir): " + std::strerror(errno));
      }
    }
    if (i < path.size()) cur += path[i];
  }
  return created;
}

// A micro-batch's loss: the masked sum stays where it was computed (a device scalar on a GPU run,
// read by the host once per step); the token count comes from the host copy of the mask.
struct LossSums {
  at::Tensor loss_sum;
  double tokens = 0;
  void add(const LossSums& o) {
    loss_sum = loss_sum.defined() ? loss_sum + o.loss_sum : o.loss_sum;
    tokens += o.tokens;
  }
};

// A micro-batch on its way to the device: the host batch's token count and largest id (checked
// against the vocabulary before it is used), and the device copies, issued as non-blocking copies
// from pinned memory ahead of the step that uses them.
struct ReadyBatch {
  Batch device;
  double tokens = 0;
  int64_t max_token = 0;
};

class Trainer {
 public:
  explicit Trainer(const Config& cfg) : cfg_(cfg) {}

  TrainResult run() {
    try {
      setup();
    } catch (...) {
      // Bad input found in set-up (a model that does not load, a plan that does not fit, a
      // checkpoint that does not match) leaves nothing behind: the run directory this run created
      // goes again, innermost first, where nothing else has been written into it.
      for (auto it = created_dirs_.rbegin(); it != created_dirs_.rend(); ++it) ::rmdir(it->c_str());
      throw;
    }
    setup_peak_mib_ = peak_memory_mib();
    // CPU ranks: LibTorch's CPU tensors from here on through the host memory cache
    // (device/host_cache.h); set-up's blocks (a whole model loaded before sharding) are not kept.
    const bool host_cache = device_.is_cpu() && install_host_cache();
    TrainResult result;
    result.resumed_from = start_step_;
    for (int64_t step = start_step_; step < cfg_.training.max_steps; ++step) {
      if (profiler_) profiler_->begin_step(step + 1);
      StepMetrics m = train_step(step);
      const int64_t s = step + 1;
      if (profiler_) log_here(profiler_->end_step(s));
      const bool last = s == cfg_.training.max_steps;
      if (cfg_.training.eval_every > 0 && (s % cfg_.training.eval_every == 0 || last)) m.val_loss = evaluate();
      if (rank0_) metrics_->write(m);
      if (tensorboard_) write_tensorboard(m);
      if (s == 1 || last || s % cfg_.training.log_every == 0 || m.val_loss) log(format_console_line(m, cfg_.training.max_steps));
      else if (progress_) progress(s);
      result.steps = s;
      result.last_loss = m.loss;
      if (m.val_loss) result.last_val_loss = m.val_loss;
      if (ckpt_) ckpt_->poll();
      if (ckpt_ && cfg_.checkpoint.save_every > 0 && s % cfg_.checkpoint.save_every == 0 && !last) save(s, result);
      // Ranks agree on a stop signal received by any of them.
      at::Tensor stop = at::full({1}, int64_t(g_stop_signal.load()), at::kLong);
      pg_->get(MeshGroup::kWorld).all_reduce(stop, ReduceOp::kMax);
      if (stop.item<int64_t>() != 0 && !last) {
        if (ckpt_) save(s, result);
        log(fmt::format("received {} : stopped after step {}{}", strsignal(int(stop.item<int64_t>())), s,
                        ckpt_ ? "; resume with checkpoint.resume=auto" : " (no checkpoint.dir: nothing saved)"));
        result.preempted = true;
        result.stop_signal = int(stop.item<int64_t>());
        break;
      }
    }
    if (ckpt_ && cfg_.checkpoint.save_final && !result.preempted && result.steps == cfg_.training.max_steps)
      save(result.steps, result);
    if (ckpt_) ckpt_->poll(/*wait=*/true);
    if (profiler_) log_here(profiler_->finish(result.steps));
    if (host_cache) log(describe_host_cache());
    if (fast_attention_) log(describe_fast_attention());
    if (const std::string r = describe_fast_rotary(); !r.empty()) log(r);
    if (progress_) std::printf("\n");
    return result;
  }

 private:
  void save(int64_t step, TrainResult& result) {
    ckpt_->save({step, step * cfg_.training.global_batch_size, {}});
    result.last_checkpoint = *cfg_.checkpoint.dir + "/" + ckpt_->step_dir_name(step);
    log(fmt::format("checkpoint {}{}", result.last_checkpoint, cfg_.checkpoint.async ? " (writing in the background)" : ""));
  }

  void log(const std::string& line) {
    if (rank0_ || cfg_.logging.all_ranks) {
      if (progress_) std::printf("\r\033[K");
      if (cfg_.logging.all_ranks && world_ > 1) std::printf("[rank %d] %s\n", rank_, line.c_str());
      else std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
  }

  // A line of this rank's own (the profiler's: it may record on ranks other than 0).
  void log_here(const std::string& line) {
    if (line.empty()) return;
    if (rank0_ || cfg_.logging.all_ranks) return log(line);
    std::printf("[rank %d] %s\n", rank_, line.c_str());
    std::fflush(stdout);
  }

  void progress(int64_t s) {
    if (!rank0_) return;
    const int64_t total = cfg_.training.max_steps;
    const double elapsed = seconds_since(start_), eta = elapsed / double(s) * double(total - s);
    const int width = 30, filled = int(width * s / total);
    std::printf("\r[%s%s] %lld/%lld  ETA %.0fs", std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                (long long)s, (long long)total, eta);
    std::fflush(stdout);
  }

  void setup() {
    rank_ = MpiEnv::world_rank();
    world_ = MpiEnv::world_size();
    rank0_ = rank_ == 0;
    shape_ = resolve_mesh_shape(cfg_, world_);
    check_batch_against_dp(cfg_, shape_.dp());
    check_against_world(cfg_, world_);
    mesh_ = std::make_unique<DeviceMesh>(shape_, rank_);
    device_ = select_device(cfg_.training.device, MpiEnv::local_rank(), cfg_.where("training.device"));
    const Backend backend = resolve_backend();
    pg_ = std::make_unique<ProcessGroups>(*mesh_, backend, device_.is_cuda());
    // LibTorch seeds its generators non-deterministically: seed them from training.seed, so that
    // dropout (and anything else random in the model) is reproducible. TP ranks share a seed (the
    // activations around a TP region are replicated there and must be dropped alike); data- and
    // context-parallel ranks, which hold other tokens, get their own. A resumed run restores the
    // generator state saved in its checkpoint instead.
    seed_generators();
    const std::string pfx = cfg_.logging.all_ranks && world_ > 1 ? fmt::format("[rank {}] ", rank_) : "";

    // Threads (`training.threads: auto`): OMP_NUM_THREADS / MKL_NUM_THREADS as PyTorch reads them,
    // else SLURM's cpus-per-task, else the physical cores the launcher bound us to, else an equal
    // share of the node's physical cores among its ranks (a core's hardware threads count once, as
    // in PyTorch's and MKL's default).
    const int online = int(sysconf(_SC_NPROCESSORS_ONLN));
    const int local = MpiEnv::local_size();
    std::string env_name;
    const int from_env = env_threads(&env_name);
    const char* slurm_cpus = std::getenv("SLURM_CPUS_PER_TASK");
    const bool auto_threads = !cfg_.training.threads && !slurm_cpus;
    const bool under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
    // The job's share of this node per rank: what the launcher's daemon may run on, over the local ranks.
    const int job_cores = launcher_cores_available(), share = std::max(1, job_cores / std::max(1, local));
    // `threads: auto` under Open MPI's default binding, narrower than that share: Open MPI binds each
    // rank to one core when there are no more ranks than cores, so `mpirun -np 1` would train on one
    // thread of a machine where PyTorch (and mfsdp started without mpirun, or with --bind-to none)
    // uses them all. That binding is Open MPI's default, not the user's choice: the rank takes its
    // share of the node's cores instead (widen_to_share: whole physical cores, slice local_rank of
    // local_size). A placement the user gave (--bind-to, --map-by, --cpu-set, a rankfile) is kept.
    if (const int before = cores_available(); auto_threads && under_mpirun && before < share && openmpi_default_binding()) {
      if (const std::string cpus = widen_to_share(MpiEnv::local_rank(), local); !cpus.empty())
        log(fmt::format("note: Open MPI's default binding put rank {} on {} of the {} cores this job has on the node "
                        "({} rank(s) here); with training.threads: auto it runs on its share, CPUs {} (an explicit "
                        "mpirun --bind-to keeps mpirun's binding)",
                        rank_, before, job_cores, local, cpus));
    }
    const int mine = cores_available();
    const int threads = cfg_.training.threads ? int(*cfg_.training.threads)
                        : from_env            ? from_env
                        : slurm_cpus          ? std::max(1, std::atoi(slurm_cpus))
                        : mine < online       ? physical_cores_available()
                                              : std::max(1, physical_cores_available() / std::max(1, local));
    set_threads(threads);
    if (!cfg_.training.threads && from_env)
      log(fmt::format("threads: {} per rank from {} (training.threads: auto)", threads, env_name));
    if (threads > mine)
      log(fmt::format("warning: {}={} but rank {} may run on only {} core(s) ({}); "
                      "use mpirun --bind-to none or --map-by slot:PE={}, or srun --cpus-per-task={}",
                      cfg_.training.threads ? "training.threads" : from_env ? env_name : "SLURM_CPUS_PER_TASK",
                      threads, rank_, mine, mine < online ? "the launcher bound it" : "all this machine has",
                      threads, threads));
    // Bound narrower than that share by an explicit placement (or by a launcher other than Open MPI
    // 4's default): said once, so that a side-by-side measurement is not one thread against several
    // unawares. Only under mpirun: a process started alone has no launcher binding it (a taskset is
    // the user's).
    if (auto_threads && !from_env && under_mpirun && mine < share)
      log(fmt::format("note: mpirun bound rank {} to {} of the {} cores this job has on the node ({} rank(s) here): "
                      "{} thread(s) per rank; for {} use mpirun --bind-to none or --map-by slot:PE={}, or start a "
                      "single rank without mpirun",
                      rank_, mine, job_cores, local, threads, share, share));
    if (const int reached = parallel_loop_threads(); reached < at::get_num_threads())
      log(fmt::format("warning: mfsdp's own parallel loops (its CPU kernels, the optimizer passes) reach {} of {} "
                      "threads: this build compiled at::parallel_for without ATen's OpenMP (lib/CMakeLists.txt)",
                      reached, at::get_num_threads()));

    if (rank0_) {
      created_dirs_ = make_dirs(cfg_.run_dir);  // the watchdog's dumps go there from here on
      guard_setup_dirs(created_dirs_);
    }
    FlightRecorder::instance().start_watchdog(cfg_.distributed.timeout_s, cfg_.run_dir, rank_, world_);
    log_placement(threads);
    for (const auto& w : cfg_.warnings) log("warning: " + w);
    log(fmt::format("mfsdp train: {} ranks, {}, {} threads per rank, {}", world_,
                    fmt::format("mesh dp_replicate {} x dp_shard {} x cp {} x tp {}", shape_.dp_replicate, shape_.dp_shard,
                                shape_.cp, shape_.tp),
                    threads, blas_description()));
    if (device_.is_cuda())
      log(fmt::format("device: {}; collectives on CUDA tensors: {}{}", describe_device(device_),
                      backend == Backend::kNccl ? "nccl (two streams per group: gathers, reductions)"
                                                : "mpi, staged through pinned host memory",
                      "; control values: mpi"));

    model_ = std::make_unique<Model>(Model::load(cfg_.model.path, cfg_.distributed.init_fsdp_with_meta_device, device_));
    if (!model_->load_note().empty()) log(model_->load_note());
    if (const std::string k = model_->use_fast_kernels(); !k.empty()) log(k);
    check_traced_dtype(*model_, cfg_);
    const std::string units = model_->find_units(cfg_.distributed.megatron_fsdp_unit_modules,
                                                 cfg_.where("distributed.megatron_fsdp_unit_modules"));
    const bool bf16 = cfg_.model.compute_dtype == "bf16";
    // bf16 compute: the parameters stay in the file's dtype until the engine builds its buffers,
    // which round the compute copy and take the main weights from the source (make_engine).
    model_->train(true);
    n_params_ = model_->num_params();
    const int64_t n_dense = n_params_ - model_->num_embedding_params();
    const int64_t L = std::max<int64_t>(1, model_->num_block_units());
    flops_per_token_ = 6.0 * double(n_dense) + 6.0 * double(L) * double(cfg_.training.seq_length) * double(model_->hidden_size());
    log(fmt::format("model {}: {} parameters ({} in matmuls: embedding tables excluded, a tied output head counted), {}; compute {}", cfg_.model.path, n_params_, n_dense,
                    units, cfg_.model.compute_dtype));

    if (cfg_.distributed.zero_dp_strategy == ZeroDpStrategy::kOptimGradsParams) log_root_note();
    tp_ = apply_tensor_parallel(*model_, cfg_, *pg_);  // splits parameters, rewrites TP call sites
    cp_ = apply_context_parallel(*model_, cfg_, *pg_);  // replaces attention-core calls
    if (const std::string a = model_->use_fast_attention(fast_attention_); !a.empty()) log(a);
    const std::string trainable = model_->apply_trainable(cfg_);  // after TP: it replaces parameters
    for (const std::string& line : {tp_->describe(), cp_->describe(), trainable})
      if (!line.empty()) log(line);
    engine_ = make_engine(*model_, cfg_, *pg_);  // rewrites the unit graphs: before any forward
    log(engine_->describe());
    vocab_ = probe_vocabulary();
    // The probe may have drawn random numbers: a model traced in training mode that samples
    // (PhiMoE's router) draws in every forward. Training starts from the seeded state, as the
    // oracle (and a rerun) assumes.
    seed_generators();
    model_->train(true);
    optimizer_ = make_optimizer(cfg_.optimizer);

    const int64_t dp_rank = mesh_->group_rank(MeshGroup::kDp);
    data_ = std::make_unique<DataPipeline>(cfg_, dp_rank, shape_.dp());
    log("data: " + data_->describe());
    accum_ = grad_accum_steps(cfg_, shape_.dp());
    log(fmt::format("batch: global {} = micro {} x dp {} x accumulation {}; seq_length {}; {} tokens per step",
                    cfg_.training.global_batch_size, cfg_.training.micro_batch_size, shape_.dp(), accum_,
                    cfg_.training.seq_length, cfg_.training.global_batch_size * cfg_.training.seq_length));

    if (cfg_.logging.peak_tflops) {
      peak_tflops_ = *cfg_.logging.peak_tflops;
      log(fmt::format("MFU against a peak of {:.3f} TFLOP/s per rank (logging.peak_tflops)", peak_tflops_));
    } else {
      pg_->get(MeshGroup::kWorld).barrier();  // every rank measures at once: they share the cores
      at::Tensor p = at::full({1}, measure_peak_tflops(bf16, device_), at::kDouble);
      pg_->get(MeshGroup::kWorld).all_reduce(p, ReduceOp::kAvg);
      peak_tflops_ = p.item<double>();
      log(fmt::format("MFU against a measured peak of {:.3f} TFLOP/s per rank ({} matmul on {}, all ranks at once)",
                      peak_tflops_, bf16 ? "bf16" : "fp32",
                      device_.is_cuda() ? describe_device(device_) : fmt::format("{} threads", threads)));
    }
    if (cfg_.checkpoint.dir || cfg_.checkpoint.resume != "auto")
      ckpt_ = std::make_unique<CheckpointManager>(cfg_, *pg_, *model_, *engine_, *optimizer_);
    if (ckpt_) {
      if (auto dir = ckpt_->resume_dir()) {
        TrainerState st = ckpt_->load(*dir);
        start_step_ = st.step;
        log(fmt::format("resumed from {} at step {} ({} samples consumed)", *dir, st.step, st.consumed_samples));
        if (!st.note.empty()) log("checkpoint: " + st.note);
      }
    }
    if (!cfg_.model.init_from.empty()) {
      if (start_step_ > 0)
        log("model.init_from " + cfg_.model.init_from + " not read: the run resumed from a checkpoint");
      else
        log(init_weights_from(cfg_, *pg_, *model_, *engine_));
    }
    if (!cfg_.checkpoint.dir) ckpt_.reset();  // resumed from a path, saving nowhere
    // Every rank has passed set-up before rank 0 writes into the run directory: a rank whose own
    // set-up failed (its model file, its memory, its checkpoint shard) has aborted the job, and
    // rank 0, terminated while it waits here, removes the directories it made (on_setup_kill)
    // instead of leaving a config.yaml and metrics.jsonl of a run that never trained.
    at::Tensor ready = at::ones({1}, at::kLong);
    pg_->get(MeshGroup::kWorld).all_reduce(ready, ReduceOp::kSum);
    if (rank0_) {
      const std::string path = cfg_.run_dir + "/metrics.jsonl";
      if (start_step_ > 0) truncate_metrics(path, start_step_);  // drop steps the resumed run will redo
      metrics_ = std::make_unique<MetricsWriter>(path, /*append=*/start_step_ > 0);
      if (cfg_.logging.tensorboard) {
        tensorboard_ = std::make_unique<TensorBoardWriter>(cfg_.run_dir + "/tensorboard");
        log("tensorboard: " + tensorboard_->path() + " (tensorboard --logdir " + cfg_.run_dir + "/tensorboard)");
      }
    }
    // Written once set-up has passed: a run refused for its model, plan or checkpoint leaves no
    // config.yaml claiming a run directory.
    if (rank0_)
      write_file_atomically(cfg_.run_dir + "/config.yaml",
                            "# resolved config of this run (source: " + cfg_.source + ")\n" +
                                fmt::format("# mesh: dp_replicate {} x dp_shard {} x cp {} x tp {} ({} ranks)\n",
                                            shape_.dp_replicate, shape_.dp_shard, shape_.cp, shape_.tp, world_) +
                                to_yaml(cfg_));
    profiler_ = StepProfiler::create(cfg_.profiling, rank_, cfg_.run_dir, device_.is_cuda(),
                                     [d = device_] { synchronize(d); });
    install_stop_signal_handlers();
    // auto: a bar only on a terminal of our own; under mpirun/srun a rank's stdout may be a pty that
    // the launcher forwards into a file or pipe, so launched jobs print plain lines.
    const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("SLURM_PROCID");
    progress_ = rank0_ && cfg_.logging.progress != "off" &&
                (cfg_.logging.progress == "on" || (isatty(1) && !launched));
    gathers_seen_ = engine_->gathers_issued();  // the start-up probe's gathers are not step 1's
    start_ = Clock::now();
  }

  // Test hook (tests/train/launch_scenarios.py): MFSDP_TEST_MISMATCH="RANK:STEP" makes that rank
  // issue one all_gather the others do not, so that the watchdog and `diagnose` can be checked
  // against a real mismatched collective.
  void plant_mismatch_for_tests(int64_t step) {
    const char* spec = std::getenv("MFSDP_TEST_MISMATCH");
    if (!spec) return;
    int r = -1;
    long long s = -1;
    if (std::sscanf(spec, "%d:%lld", &r, &s) != 2 || r != rank_ || s != step) return;
    Communicator& c = pg_->get(MeshGroup::kWorld);
    at::Tensor small = at::zeros({4}, at::kFloat), big = at::zeros({4 * c.size()}, at::kFloat);
    FlightRecorder::instance().set_tag("planted by MFSDP_TEST_MISMATCH");
    c.all_gather(big, small);
  }

  // One line per rank: where it runs and what it does, printed by rank 0 as a table.
  void log_placement(int threads) {
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    const char* launcher = std::getenv("SLURM_JOB_ID") ? "slurm" : std::getenv("OMPI_COMM_WORLD_SIZE") ? "mpirun" : "singleton";
    const std::string line = fmt::format(
        "{:>5} {:<16} {:>5}/{:<5} {:<8} {:>7}  ({},{},{},{})  {}", rank_, host, MpiEnv::local_rank(), MpiEnv::local_size(),
        device_.str(), threads, mesh_->coord(MeshDim::kDpReplicate), mesh_->coord(MeshDim::kDpShard), mesh_->coord(MeshDim::kCp),
        mesh_->coord(MeshDim::kTp), launcher);
    std::string table = fmt::format("placement:\n{:>5} {:<16} {:>11} {:<8} {:>7}  {}  {}", "rank", "host", "local rank",
                                    "device", "threads", "(rep,shard,cp,tp)", "launcher");
    for (const auto& row : all_gather_strings(pg_->get(MeshGroup::kWorld), line)) table += "\n" + row;
    log(table);
    FlightRecorder::instance().set_hosts(all_gather_strings(pg_->get(MeshGroup::kWorld), host));
  }

  // Keeps the lines of steps <= `step` (a crashed run may have logged steps past its checkpoint).
  static void truncate_metrics(const std::string& path, int64_t step) {
    std::ifstream in(path);
    std::string kept, line;
    while (std::getline(in, line)) {
      auto pos = line.find("\"step\": ");
      if (pos != std::string::npos && std::atoll(line.c_str() + pos + 8) <= step) kept += line + "\n";
    }
    write_file_atomically(path, kept);
  }

  // training.seed, offset by this rank's place among the data- and context-parallel ranks (TP
  // ranks share it: see the constructor).
  void seed_generators() {
    torch::manual_seed(uint64_t(cfg_.training.seed) + 100003ULL * uint64_t(mesh_->group_rank(MeshGroup::kDpCp)));
  }

  // The integers an export_hf.py file records under `key` in mfsdp/hf_export.json (the config's
  // head counts, its position limits) that `off` picks, as "name value" each; none for other files.
  std::vector<std::string> hf_export_ints(const char* key, const std::function<bool(int64_t)>& off) const {
    std::vector<std::string> out;
    auto j = nlohmann::json::parse(model_->stored_hf_export(), nullptr, false);
    if (!j.is_object() || !j.contains(key) || !j[key].is_object()) return out;
    for (auto it = j[key].begin(); it != j[key].end(); ++it)
      if (it.value().is_number_integer() && off(it.value().get<int64_t>()))
        out.push_back(fmt::format("{} {}", it.key(), it.value().get<int64_t>()));
    return out;
  }

  // For the first forward's error: the config's head counts that tp_size does not divide, and its
  // position limits that training.seq_length exceeds ("" when none).
  std::string indivisible_head_counts() const {
    const auto bad = hf_export_ints("head_counts", [&](int64_t v) { return v % shape_.tp != 0; });
    if (bad.empty()) return "";
    return fmt::format("; the model's config (mfsdp/hf_config.json): {}, not divisible by tp_size {}: use a tp_size "
                       "that divides every head count (mfsdp does not replicate key/value heads over TP ranks)",
                       join(bad, ", "), shape_.tp);
  }
  std::string exceeded_positions() const {
    const auto over = hf_export_ints("max_positions", [&](int64_t v) { return v < cfg_.training.seq_length; });
    if (over.empty()) return "";
    return fmt::format(" (the model's config, mfsdp/hf_config.json: {}, shorter than training.seq_length {}: a learned "
                       "position table has no rows past it)",
                       join(over, ", "), cfg_.training.seq_length);
  }

  // One forward of one sequence before training: checks the model contract (forward(tokens,
  // position_ids) -> [B, T, V] logits) with a clear message, and learns V so that batches can be
  // checked first. The sequence is this rank's training length (seq_length / cp_size): a trace
  // may hold sizes fixed at export that only fit the lengths it will train at (DeepSeek V3.2's
  // sparse-attention indexer keeps min(index_topk, T) of the keys: a traced constant k, which a
  // two-token probe could not select).
  int64_t probe_vocabulary() {
    at::NoGradGuard ng;
    model_->train(false);
    const auto lopt = at::TensorOptions().dtype(at::kLong).device(device_);
    const int64_t T = std::max<int64_t>(2, cfg_.training.seq_length / cfg_.distributed.cp_size);
    at::Tensor tokens = at::zeros({1, T}, lopt), pos = at::arange(T, lopt).unsqueeze(0);
    at::Tensor logits;
    try {
      engine_->pre_model_forward();
      logits = model_->forward(tokens, pos);
    } catch (const UserError&) {
      throw;
    } catch (const std::exception& e) {  // c10::Error, or the interpreter's runtime_error
      const auto* c10e = dynamic_cast<const c10::Error*>(&e);
      std::string what = c10e ? c10e->what_without_backtrace() : e.what();
      // The interpreter's message starts with its traceback; the reason is on the last lines.
      if (!c10e) {
        auto pos = what.find("RuntimeError: ");
        if (pos != std::string::npos) what = what.substr(pos + 14);
      }
      // One of mfsdp's own refusals from inside an op (CP's mask check, SP's sequence dimension):
      // the model may follow the contract, and the message says what does not fit.
      if (const size_t tag = what.find(kUserErrorTag); tag != std::string::npos) {
        const std::string msg = what.substr(tag + std::strlen(kUserErrorTag));
        throw UserError(cfg_.model.path + ": " + msg.substr(0, msg.find('\n')));
      }
      throw UserError(cfg_.model.path + fmt::format(": forward(tokens [1, {0}], position_ids [1, {0}]) failed; the model must follow ", T) +
                      "the contract forward(tokens: int64 [B, T], position_ids: int64 [B, T]) -> logits [B, T, V]: " +
                      what.substr(0, what.find('\n')) + exceeded_positions() +
                      (shape_.tp > 1 ? fmt::format(" (with tp_size {} every rank holds 1/{} of each colwise output: the "
                                                   "attention's head counts, key/value heads included, must be divisible "
                                                   "by tp_size, and sizes must come from the projections' shapes{}{})",
                                                   shape_.tp, shape_.tp, indivisible_head_counts(),
                                                   tp_->sequence_parallel()
                                                       ? "; with sequence_parallel, a block that reads the sequence "
                                                         "length from its input (Hugging Face attention) needs the style "
                                                         "sequence_gathered in the plan"
                                                       : "")
                                     : std::string()));
    }
    if (logits.dim() != 3 || logits.size(0) != 1 || logits.size(1) != T || !logits.is_floating_point())
      throw UserError(fmt::format("{}: forward returned a tensor of shape [{}] and dtype {}; the model contract is "
                                  "floating-point logits [B, T, V]",
                                  cfg_.model.path, fmt::join(logits.sizes(), ", "), c10::toString(logits.scalar_type())));
    return tp_->vocab_size(logits.size(2));
  }

  // The host batch (its checks and counts taken by the reader), then its copy to the device:
  // pinned memory and a non-blocking copy on the current stream, so that the transfer is queued
  // behind the work already issued (the previous step's optimizer) and the host moves on.
  ReadyBatch make_ready(const HostBatch& host) {
    ReadyBatch r;
    r.max_token = host.max_token;
    r.tokens = host.tokens;
    if (!device_.is_cuda()) {
      r.device = host.batch;
      return r;
    }
    auto up = [&](const at::Tensor& t) { return t.pin_memory().to(device_, /*non_blocking=*/true); };
    const Batch& b = host.batch;
    r.device = {up(b.tokens), up(b.targets), up(b.loss_mask), up(b.position_ids)};
    return r;
  }

  // Every micro-batch of training step `step` (0-based), read by the prefetch thread (started at
  // the first step this run trains, kept data.prefetch_steps ahead; 0: read here) and sent on
  // their way.
  std::vector<ReadyBatch> fetch_step(int64_t step) {
    Phase phase("mfsdp::data");
    std::vector<ReadyBatch> out;
    const auto t0 = Clock::now();
    if (cfg_.data.prefetch_steps == 0) {
      for (int64_t k = 0; k < accum_; ++k) out.push_back(make_ready(host_batch(data_->train_batch(step, k))));
      data_wait_s_ += seconds_since(t0);
      return out;
    }
    if (!prefetcher_)
      prefetcher_ = std::make_unique<BatchPrefetcher>(
          [this](int64_t s, int64_t k) { return data_->train_batch(s, k); }, accum_, step, cfg_.training.max_steps,
          int(cfg_.data.prefetch_steps));
    std::vector<HostBatch> host = prefetcher_->take(step);
    data_wait_s_ += seconds_since(t0);
    for (const HostBatch& h : host) out.push_back(make_ready(h));
    return out;
  }

  // Cross entropy of one micro-batch: returns (sum of masked token losses, masked tokens) and,
  // when `backward`, runs backward on the normalised objective.
  LossSums micro_batch(const ReadyBatch& ready, bool backward) {
    // Targets are the tokens shifted by one: together they are every token of the window.
    if (ready.max_token >= vocab_)
      throw UserError(fmt::format("data: token id {} does not fit the model's vocabulary of {} ({}): the dataset was "
                                  "made with a larger vocabulary than the model",
                                  ready.max_token, vocab_, cfg_.model.path));
    // Context parallel: this rank's chunks of every sequence; the micro-batch's loss is still
    // normalised by all of its tokens.
    const Batch b = cp_->slice(ready.device);
    const double micro_tokens = ready.tokens;
    std::optional<Phase> forward(std::in_place, "mfsdp::forward");
    engine_->pre_model_forward();
    at::Tensor logits = model_->forward(b.tokens, b.position_ids);
    if (logits.dim() != 3 || logits.size(0) != b.tokens.size(0) || logits.size(1) != b.tokens.size(1))
      throw UserError(fmt::format("{}: forward returned logits of shape {}, expected [batch {}, seq {}, vocab] "
                                  "(model contract){}",
                                  cfg_.model.path, fmt::join(logits.sizes(), "x"), b.tokens.size(0), b.tokens.size(1),
                                  tp_->sequence_parallel() && logits.dim() == 3 && logits.size(1) * shape_.tp == b.tokens.size(1)
                                      ? "; with sequence parallel the logits came back split along the sequence: give "
                                        "the output head the style colwise or colwise_rep in tp_plan, which gathers it"
                                      : ""));
    const int64_t V = logits.size(2);
    // A colwise output head leaves the logits sharded over the vocabulary: the loss is computed on
    // the shards (max and sum-exp reduced across TP), never on a full [tokens, vocab] tensor.
    at::Tensor ce = tp_->logits_sharded()
                        ? vocab_parallel_cross_entropy(logits.reshape({-1, V}), b.targets.reshape({-1}), tp_->vocab_start(V),
                                                       vocab_, /*consume_logits=*/true)
                        : cross_entropy_per_token(logits.reshape({-1, V}), b.targets.reshape({-1}), nullptr, 0, -1,
                                                  /*consume_logits=*/true);
    // The loss holds the logits for its backward; this handle would keep them alive beside the
    // gradient of the output head, the largest moment of the backward (DESIGN.md section 7, step 3),
    // and would stop the loss's backward writing that gradient over them (consume_logits).
    logits = at::Tensor();
    at::Tensor mask = b.loss_mask.reshape({-1});
    at::Tensor masked_sum = (ce * mask).sum();
    LossSums out{masked_sum.detach().to(at::kDouble), micro_tokens};
    forward.reset();
    if (backward) {
      Phase phase("mfsdp::backward");
      // calculate_per_token_loss: sum now, divide by the global token count after the reduction.
      // Otherwise: this micro-batch's mean, averaged over micro-batches (and over dp by the engine).
      at::Tensor objective = cfg_.distributed.calculate_per_token_loss
                                 ? masked_sum
                                 : masked_sum / std::max(1.0, micro_tokens) / double(plant_loss_norm_ ? 1 : accum_);
      if (plant_nan_grad_ && current_step_ == 3) objective = objective * std::nan("");  // tests only
      objective.backward();
      engine_->end_micro_batch();
    }
    return out;
  }

  // Loss sum (device, reduced over dp x cp on the device communicator: CP ranks hold parts of the
  // same sequences) and token count (host, counted on whole micro-batches, reduced over dp through
  // MPI: no device round trip).
  std::pair<at::Tensor, double> global_sums(const LossSums& sums) {
    at::Tensor loss = sums.loss_sum.reshape({1}).clone();
    pg_->get(MeshGroup::kDpCp).all_reduce(loss, ReduceOp::kSum);
    at::Tensor tokens = at::full({1}, sums.tokens, at::kDouble);
    pg_->get(MeshGroup::kDp).all_reduce(tokens, ReduceOp::kSum);
    return {loss, tokens.item<double>()};
  }

  StepMetrics train_step(int64_t step) {
    Phase phase("mfsdp::step");
    const auto t0 = Clock::now();
    FlightRecorder::instance().set_step(step + 1);
    current_step_ = step + 1;
    plant_mismatch_for_tests(step + 1);
    reset_device_peak(device_);
    // This step's batches were fetched at the end of the previous one (its copies overlapped the
    // optimizer's kernels); the first step, or one after evaluation, fetches them now.
    const double waited_before = data_wait_s_;
    std::vector<ReadyBatch> batches = prefetched_step_ == step ? std::move(prefetched_) : fetch_step(step);
    prefetched_.clear();
    prefetched_step_ = -1;
    engine_->start_step();
    LossSums sums;
    for (int64_t k = 0; k < accum_; ++k) {
      engine_->start_micro_batch(k == accum_ - 1);
      sums.add(micro_batch(batches[size_t(k)], true));
    }
    // Loss and token count over the global batch (data-parallel ranks hold disjoint samples,
    // context-parallel ranks disjoint parts of them).
    auto [loss_sum, global_tokens] = global_sums(sums);
    {
      Phase sync("mfsdp::finish_grad_sync");
      engine_->finish_grad_sync(cfg_.distributed.calculate_per_token_loss ? 1.0 / std::max(1.0, global_tokens) : 1.0);
    }

    // Clipping by a coefficient computed on the device, as clip_grad_norm_ does: min(1, clip /
    // (norm + 1e-6)) multiplies the gradients whatever its value (x 1 is exact), so the host need
    // not see the norm first. The optimizer applies it as it reads each gradient (on CPU inside its
    // fused pass: no pass of its own). A step with a non-finite norm is skipped below, before any
    // weight changes.
    std::optional<Phase> norm_phase(std::in_place, "mfsdp::grad_norm");
    at::Tensor norm = engine_->grad_norm();
    at::Tensor clip_coeff;
    if (cfg_.training.clip_grad > 0) {
      at::Tensor n = plant_clip_ ? norm * norm : norm;
      clip_coeff = (cfg_.training.clip_grad / (n + 1e-6)).clamp_max(1.0);
    }
    // The step's one host synchronisation: loss and norm, read together.
    at::Tensor host = at::cat({loss_sum.reshape({1}), norm.reshape({1})}).to(at::kCPU);

    StepMetrics m;
    m.step = step + 1;
    m.loss = host[0].item<double>() / std::max(1.0, global_tokens);
    m.grad_norm = host[1].item<double>();
    norm_phase.reset();
    if (!std::isfinite(m.grad_norm)) {
      std::string names;
      if (cfg_.distributed.report_nan_in_param_grad) {
        auto bad = engine_->nonfinite_grads();
        names = fmt::format("; parameters with NaN/Inf gradients on rank {}: {}", rank_, fmt::join(bad, ", "));
      }
      if (cfg_.distributed.check_for_nan_in_grad)
        throw UserError(fmt::format("step {} on rank {}: the gradient norm is {} (NaN or Inf in gradients; loss {}){} "
                                    "(distributed.check_for_nan_in_grad)",
                                    m.step, rank_, m.grad_norm, m.loss, names));
      // As Megatron does when the gradients are not finite: no update (a NaN clip coefficient
      // would otherwise write NaN into every weight), counted, and the schedule does not advance.
      m.skipped = true;
      ++skipped_steps_;
      log(fmt::format("warning: step {}: gradient norm {}: update skipped ({} skipped so far){}", m.step, m.grad_norm,
                      skipped_steps_, names));
    }
    m.skipped_total = skipped_steps_;
    // The schedule counts applied updates (Megatron steps its scheduler only on successful ones).
    m.lr = learning_rate(cfg_.lr_scheduler, cfg_.optimizer.lr, cfg_.training.max_steps,
                         optimizer_->steps_taken() + (plant_schedule_ ? 0 : 1));
    if (!m.skipped) {
      Phase opt("mfsdp::optimizer");
      at::NoGradGuard ng;
      optimizer_->step(engine_->slots(), m.lr, clip_coeff);
      engine_->install_weights(/*trainable_only=*/true);
    }
    // The next step's batches, read by the host while the device runs the optimizer.
    if (step + 1 < cfg_.training.max_steps) {
      prefetched_ = fetch_step(step + 1);
      prefetched_step_ = step + 1;
    }
    m.data_wait_s = data_wait_s_ - waited_before;
    const int64_t gathers = engine_->gathers_issued();
    m.unit_gathers = gathers - gathers_seen_;
    gathers_seen_ = gathers;
    m.step_time_s = seconds_since(t0);
    const double tokens = double(cfg_.training.global_batch_size * cfg_.training.seq_length);
    m.tokens_per_s = tokens / m.step_time_s;
    m.tflops_per_rank = flops_per_token_ * tokens / m.step_time_s / world_ / 1e12;
    m.mfu = m.tflops_per_rank / peak_tflops_;
    m.peak_mem_mib = peak_memory_mib();
    if (device_.is_cuda()) {
      const DeviceMemory dm = device_memory(device_);
      m.on_device = true;
      m.device_allocated = dm.allocated;
      m.device_reserved = dm.reserved;
      m.device_peak = dm.peak_allocated;
    }
    m.consumed_samples = m.step * cfg_.training.global_batch_size;
    const auto mem = engine_->memory();
    m.mem_weights = mem.weights;
    m.mem_main_weights = mem.main_weights;
    m.mem_grads = mem.grads;
    for (const auto& st : optimizer_->state()) m.mem_optimizer += int64_t(st.second.nbytes());
    m.mem_fsdp_peak = engine_->take_peak_bytes() + m.mem_optimizer;
    m.mem_gathered_peak = engine_->gathered_peak_bytes();
    if (m.step == 1)
      log(fmt::format("memory on rank {}: weights {}, main weights {}, gradients {}, optimizer state {}; peak held "
                      "during step 1 {} (process peak RSS {:.0f} MiB, {:.0f} MiB before the first step)",
                      rank_, human_bytes(double(m.mem_weights)), human_bytes(double(m.mem_main_weights)),
                      human_bytes(double(m.mem_grads)), human_bytes(double(m.mem_optimizer)),
                      human_bytes(double(m.mem_fsdp_peak)), m.peak_mem_mib, setup_peak_mib_) +
          (m.on_device ? fmt::format("; {}: allocated {}, reserved {}, peak allocated during step 1 {}", device_.str(),
                                     human_bytes(double(m.device_allocated)), human_bytes(double(m.device_reserved)),
                                     human_bytes(double(m.device_peak)))
                       : std::string()));
    return m;
  }

  // Strategy 3 gathers the parameters outside every unit for the whole step, with their full
  // gradient. When they outweigh the largest unit (an embedding table and an untied output head of
  // a large vocabulary left out of configured units; the automatic units include them), say which
  // modules they are and how to make units of them (bench/results_init_from.md). A tied parameter
  // cannot leave the parameters outside units: it is not counted.
  void log_root_note() {
    std::map<std::string, int64_t> outside;  // module -> elements
    int64_t root = 0;
    std::vector<int64_t> per_unit(model_->units().size(), 0);
    for (const auto& p : model_->params()) {
      if (p.unit >= 0) {
        per_unit[p.unit] += p.tensor.numel();
        continue;
      }
      root += p.tensor.numel();
      if (!p.aliases.empty()) continue;
      auto dot = p.name.rfind('.');
      outside[dot == std::string::npos ? p.name : p.name.substr(0, dot)] += p.tensor.numel();
    }
    const int64_t largest = per_unit.empty() ? 0 : *std::max_element(per_unit.begin(), per_unit.end());
    if (largest == 0 || root <= 2 * largest) return;
    std::vector<std::string> big;
    for (const auto& [module, n] : outside)
      if (n >= largest) big.push_back(module);
    if (big.empty()) return;
    log(fmt::format("note: {} parameters outside the units ({}x the largest unit; {}) are gathered whole for each "
                    "step under zero_dp_strategy 3; units of their own lower the peak memory: "
                    "distributed.megatron_fsdp_unit_modules: [{}, {}]",
                    root, root / largest, join(big, ", "),
                    cfg_.distributed.megatron_fsdp_unit_modules ? join(*cfg_.distributed.megatron_fsdp_unit_modules, ", ")
                                                                : model_->units().front().class_name,
                    join(big, ", ")));
  }

  double evaluate() {
    if (!data_->has_valid()) return NAN;
    at::NoGradGuard ng;
    model_->train(false);
    LossSums sums;
    for (int64_t it = 0; it < cfg_.training.eval_iters; ++it)
      for (int64_t k = 0; k < accum_; ++k) sums.add(micro_batch(make_ready(host_batch(data_->valid_batch(it, k))), false));
    model_->train(true);
    auto [loss_sum, tokens] = global_sums(sums);
    return loss_sum.item<double>() / std::max(1.0, tokens);
  }

  // logging.tensorboard: the metrics.jsonl line of the step as scalars (TensorBoard's names: a
  // section, a slash, the quantity).
  void write_tensorboard(const StepMetrics& m) {
    std::vector<std::pair<std::string, double>> v = {
        {"train/loss", m.loss},
        {"train/lr", m.lr},
        {"train/grad_norm", m.grad_norm},
        {"train/tokens_per_s", m.tokens_per_s},
        {"train/tflops_per_rank", m.tflops_per_rank},
        {"train/mfu", m.mfu},
        {"train/step_time_s", m.step_time_s},
        {"train/skipped_total", double(m.skipped_total)},
        {"train/data_wait_s", m.data_wait_s},
        {"memory/peak_rss_mib", m.peak_mem_mib},
        {"memory/fsdp_peak_bytes", double(m.mem_fsdp_peak)},
        {"memory/gathered_peak_bytes", double(m.mem_gathered_peak)},
    };
    if (m.val_loss) v.push_back({"valid/loss", *m.val_loss});
    if (m.on_device) {
      v.push_back({"memory/device_allocated_bytes", double(m.device_allocated)});
      v.push_back({"memory/device_reserved_bytes", double(m.device_reserved)});
      v.push_back({"memory/device_peak_bytes", double(m.device_peak)});
    }
    tensorboard_->scalars(m.step, v);
  }

  // distributed.backend for the CUDA tensors of a GPU run (CPU runs: MPI throughout).
  Backend resolve_backend() const {
    if (!device_.is_cuda()) return Backend::kMpi;
    const std::string& want = cfg_.distributed.backend;
    const int gpus = cuda_device_count(), local = MpiEnv::local_size();
    const bool shared = local > gpus;  // two local ranks on one GPU: NCCL refuses that
    if (want == "mpi") return Backend::kMpi;
    if (want == "nccl") {
      if (!nccl_available())
        throw ConfigError(cfg_.where("distributed.backend") + ": distributed.backend is nccl but this build has no NCCL");
      if (shared)
        throw ConfigError(cfg_.where("distributed.backend") + fmt::format(
                              ": distributed.backend is nccl but {} ranks on this node share {} GPU(s), and NCCL "
                              "refuses two ranks of one communicator on a GPU; run one rank per GPU, or set backend: "
                              "mpi (or auto) to stage the collectives through host memory",
                              local, gpus));
      return Backend::kNccl;
    }
    return nccl_available() && !shared ? Backend::kNccl : Backend::kMpi;
  }

  const Config& cfg_;
  c10::Device device_{c10::kCPU};
  std::vector<ReadyBatch> prefetched_;  // batches of step prefetched_step_, already on the device
  int64_t prefetched_step_ = -1;
  int rank_ = 0, world_ = 1;
  std::vector<std::string> created_dirs_;  // by this run's make_dirs (removed if set-up fails)
  bool rank0_ = true, progress_ = false;
  MeshShape shape_;
  std::unique_ptr<DeviceMesh> mesh_;
  std::unique_ptr<ProcessGroups> pg_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<TensorParallel> tp_;
  std::unique_ptr<ContextParallel> cp_;
  bool fast_attention_ = false;  // graphs call mfsdp::sdpa (Model::use_fast_attention)
  std::unique_ptr<ParallelEngine> engine_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<DataPipeline> data_;
  std::unique_ptr<BatchPrefetcher> prefetcher_;  // declared after data_: stopped before data_ is freed
  double data_wait_s_ = 0;                       // seconds fetch_step waited for host batches, in all
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;  // rank 0 with logging.tensorboard
  std::unique_ptr<StepProfiler> profiler_;          // the ranks that record (profiling.ranks)
  std::unique_ptr<CheckpointManager> ckpt_;
  int64_t start_step_ = 0;
  int64_t skipped_steps_ = 0;  // steps whose update was skipped (non-finite gradients)
  int64_t gathers_seen_ = 0;   // engine_->gathers_issued() at the end of the previous step
  // Planted bugs for the oracle's own test (MFSDP_TEST_PLANT, tests/oracle): the schedule one
  // step late, clipping by the squared norm, micro-batch losses not averaged over accumulation.
  const bool plant_schedule_ = test_plant("schedule"), plant_clip_ = test_plant("clip"),
             plant_loss_norm_ = test_plant("loss_norm"), plant_nan_grad_ = test_plant("nan_grad");
  int64_t current_step_ = 0;  // 1-based step being trained
  int64_t accum_ = 1, n_params_ = 0, vocab_ = 0;
  double flops_per_token_ = 0, peak_tflops_ = 1;
  double setup_peak_mib_ = 0;  // process peak RSS when set-up ended (model load, sharding, init_from)
  Clock::time_point start_;
};

}  // namespace

TrainResult train(const Config& cfg) {
  Trainer t(cfg);
  return t.run();
}

void install_stop_signal_handlers() {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);
}

}  // namespace mfsdp
