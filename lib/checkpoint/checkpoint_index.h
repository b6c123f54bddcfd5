// A checkpoint's index.json, checked before anything reads it (DESIGN.md section 6). Without
// LibTorch, so that the fuzzer can drive it (fuzz/fuzz_checkpoint_index.cpp).
//
// The readers in checkpoint.cpp index the JSON directly (.at(), .get<>(), a piece's "tp" by
// position, shapes multiplied out, element ranges narrowed). nlohmann's get<int64_t>() of a float,
// const operator[] of a missing key, or a range past a tensor's end would be undefined behaviour
// or an internal error there; parse_checkpoint_index accepts only what they can read safely, and
// says which key of which file is wrong otherwise. What it guarantees:
//   format        "mfsdp-checkpoint-1"
//   trainer       {step >= 0, consumed_samples >= 0}
//   world_size    >= 1; mesh {dp_replicate, dp_shard, cp, tp} >= 1 whose product is world_size
//   zero_dp_strategy, compute_dtype: strings; model {path, fingerprint}: strings
//   optimizer     {name: string, steps >= 0, state: [string]}
//   files         {NAME: {bytes >= 0, checksum: string}}, NAME a plain file name (no '/', no "..")
//   params        {NAME: {shape: [int >= 0] (product < 2^62), aliases: [string], frozen: bool
//                  (optional), pieces: [{file: a key of files, begin, end, tp (optional)}]}}
//                 names and aliases all distinct; a piece without tp has 0 <= begin <= end <= numel;
//                 tp = [dim, size, rank, parts...] with 0 <= dim < rank of shape, size >= 2,
//                 0 <= rank < size, parts > 0 summing to shape[dim], and then 0 <= begin <= end
//                 <= numel / shape[dim] * sum(ceil(part / size)) (the TP slice's elements, padding
//                 rows included: TpSplit).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/tp_split.h"

namespace mfsdp {

inline constexpr const char* kCheckpointFormat = "mfsdp-checkpoint-1";

// Parses index.json's text; `path` names the file in every error (UserError).
nlohmann::json parse_checkpoint_index(const std::string& text, const std::string& path);

// A piece's tensor-parallel split ("tp", absent: not split) over the parameter's global shape.
// The piece must come from an index that parse_checkpoint_index accepted.
TpSplit checkpoint_piece_split(const nlohmann::json& piece, const std::vector<int64_t>& global_shape);

}  // namespace mfsdp
