// Small string and file helpers shared by the config parser, the CLI and the trainer (no torch, no yaml).
#pragma once
#include <string>
#include <vector>

namespace mfsdp {

std::vector<std::string> split(const std::string& s, char sep);
bool ends_with(const std::string& s, const std::string& tail);
std::string join(const std::vector<std::string>& parts, const std::string& sep);
// Levenshtein distance, for "did you mean" suggestions.
size_t edit_distance(const std::string& a, const std::string& b);
// The candidate closest to `word`, or "" when none is close enough to be a plausible typo.
std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);
// Shell-style glob with '*' and '?' (used for module paths such as "blocks.*").
bool glob_match(const std::string& pattern, const std::string& text);
// Writes `text` to path + ".tmp" and renames it over `path`: the file is whole or absent (the
// temporary is removed when writing fails). Throws UserError naming the file.
void write_file_atomically(const std::string& path, const std::string& text);
// Human-readable byte count: 1.5 KiB, 3.0 MiB.
std::string human_bytes(double bytes);
// Test hook (tests/oracle): MFSDP_TEST_PLANT=optimizer|schedule|clip|loss_norm|nan_grad plants a known bug
// in that part of training, so that the PyTorch oracle is shown to catch it. True when `what` is
// planted in this process.
bool test_plant(const char* what);

}  // namespace mfsdp
