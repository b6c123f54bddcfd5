// model.init_from: initial weights from safetensors, each rank reading only its own slots.
#pragma once
#include <string>

namespace mfsdp {

struct Config;
class Model;
class ParallelEngine;
class ProcessGroups;

// Fills this rank's main weights from cfg.model.init_from (a .safetensors file, or a directory with
// model.safetensors or model.safetensors.index.json, as Hugging Face writes them), matching the
// model's parameters by name (any alias of a tied weight) after cfg.model.init_from_rename. The files
// are memory-mapped and each rank copies only the elements of its slots (its TP slice, its shard),
// converting the dtype; then the engine installs them into the compute weights. Missing, unexpected
// and mis-shaped tensors are one UserError listing them all, raised on every rank. Returns a line
// for the log.
std::string init_weights_from(const Config& cfg, ProcessGroups& pg, Model& model, ParallelEngine& engine);

}  // namespace mfsdp
