// Errors that carry their context (file:line:col, key, rank) in the message itself, so that
// main() can print exactly one line per failure and no handler has to reassemble context.
#pragma once
#include <stdexcept>
#include <string>

namespace mfsdp {

// A mistake in what the user gave us (YAML, CLI, data files, checkpoints, world size).
// main() prints these without a stack trace and exits with status 2.
class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& what) : std::runtime_error(what) {}
};

// A user error raised inside a custom op reaches the caller through the TorchScript interpreter,
// which rethrows it as a c10::Error with its own traceback around the text: the text carries this
// tag so that main can still report it as the user's error (exit 2), without the traceback.
inline constexpr const char* kUserErrorTag = "[mfsdp user error] ";

// Configuration errors are user errors whose message already starts with "file:line:col: ".
class ConfigError : public UserError {
 public:
  explicit ConfigError(const std::string& what) : UserError(what) {}
};

}  // namespace mfsdp
