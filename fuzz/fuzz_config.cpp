// The experiment YAML and key=value overrides: input = YAML, then optionally a NUL byte and one
// override per line. Load, validate, and print the resolved config back as YAML.
#include "config/config.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {
  std::string s(reinterpret_cast<const char*>(d), n);
  std::vector<std::string> overrides;
  size_t nul = s.find('\0');
  if (nul != std::string::npos) {
    std::string rest = s.substr(nul + 1);
    s.resize(nul);
    size_t pos = 0;
    while (pos <= rest.size()) {
      size_t e = rest.find('\n', pos);
      if (e == std::string::npos) e = rest.size();
      if (e > pos) overrides.push_back(rest.substr(pos, e - pos));
      pos = e + 1;
    }
  }
  fuzz::expect_user_errors_only([&] {
    mfsdp::Config c = mfsdp::load_config_string(s, "fuzz.yaml", overrides);
    (void)mfsdp::to_yaml(c);
  });
  return 0;
}
