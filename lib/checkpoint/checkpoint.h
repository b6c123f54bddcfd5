// Sharded checkpoints that never lie (DESIGN.md section 6).
//
//   <checkpoint.dir>/step_00000100/   rank_00000.safetensors ...  this rank's slices of every
//                                     parameter's main weights and optimizer state, its RNG
//                                     index.json                  global shapes, which file holds
//                                     which flat element range of each parameter, a checksum
//                                     per file, trainer state, the model's fingerprint
//                                     config.yaml                 the resolved config
//   <checkpoint.dir>/latest           the newest complete step directory's name
//
// A step directory is written under a hidden temporary name and renamed only after every rank has
// written and fsynced its file; `latest` is then replaced atomically and older directories beyond
// keep_last are deleted. A crash at any moment leaves the previous checkpoint complete and no
// directory that resume would take for complete. Loading maps any saved layout onto the current
// one (world size, zero_dp_strategy, bucketing), so a run resumes at another world size.
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "config/config.h"

namespace mfsdp {

class Model;
class Optimizer;
class ParallelEngine;
class ProcessGroups;

struct TrainerState {
  int64_t step = 0;              // optimizer steps done
  int64_t consumed_samples = 0;  // the sampler's position
  std::string note;              // load: what was not carried over (optimizer state of unfrozen parameters)
};

class CheckpointManager {
 public:
  CheckpointManager(const Config& cfg, ProcessGroups& pg, Model& model, ParallelEngine& engine, Optimizer& optimizer);
  ~CheckpointManager();

  // The directory to resume from per checkpoint.resume (auto: the latest complete one, if any),
  // agreed on by every rank. Collective.
  std::optional<std::string> resume_dir();
  // Loads main weights, optimizer state and RNG into the current layout after verifying the
  // checksums of the files it reads; installs the weights. Collective.
  TrainerState load(const std::string& step_dir);
  // Writes step directory `state.step`. Collective; with checkpoint.async the files are written by
  // a background thread from host copies and the checkpoint is completed at a later poll().
  void save(const TrainerState& state);
  // With async saves: completes a finished background save (collective: call on every rank at the
  // same points, e.g. after every step). Blocking when `wait` is true.
  void poll(bool wait = false);
  std::string step_dir_name(int64_t step) const;

 private:
  struct Pending;
  void finalize(Pending& p);
  void check_shared_dir();  // collective: every rank sees what rank 0 writes in checkpoint.dir
  const Config& cfg_;
  ProcessGroups& pg_;
  Model& model_;
  ParallelEngine& engine_;
  Optimizer& optimizer_;
  std::unique_ptr<Pending> pending_;
  int64_t loaded_step_ = -1;  // the step load() restored (saved already), -1 before
};

// `mfsdp inspect`: prints a checkpoint's metadata and verifies every file's checksum. Returns the
// number of problems found.
int inspect_checkpoint(const std::string& step_dir, bool verbose);
// `mfsdp export`: consolidated weights under the model's own parameter names (every alias of a
// tied weight too). format: safetensors | torchscript (needs the TorchScript model: `model_path`
// or the one recorded in the checkpoint). `state`: "main" (the weights) or one of the optimizer's
// state kinds (exp_avg, exp_avg_sq, momentum_buffer) under the same names, safetensors only.
void export_checkpoint(const std::string& step_dir, const std::string& out, const std::string& format,
                       const std::string& model_path, const std::string& state = "main", bool only_trainable = false);
// `mfsdp export --format hf`: a Hugging Face model directory `out` (new, or empty): config.json
// (the model file's mfsdp/hf_config.json, written by scripts/export_hf.py) and model.safetensors,
// or shards of at most max_shard_bytes with model.safetensors.index.json, in `dtype` (float32,
// bfloat16, float16; empty: the config's torch_dtype). Streams one parameter at a time; written
// under a temporary name and renamed, so a failed export leaves nothing.
// A LoRA model (scripts/export_hf.py --lora-r / --adapter-dir): the base weights with the adapters
// merged in (W + scaling * B A, PEFT's merge_and_unload) under the transformers model's names; with
// only_trainable, PEFT's adapter directory instead: adapter_model.safetensors (the trained
// adapters, PEFT's key names) and adapter_config.json, which peft's PeftModel.from_pretrained loads.
void export_checkpoint_hf(const std::string& step_dir, const std::string& out, const std::string& model_path,
                          const std::string& dtype, int64_t max_shard_bytes, bool only_trainable = false);

}  // namespace mfsdp
