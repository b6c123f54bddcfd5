// A tiktoken rank file (then encoding with cl100k's pattern), and the same bytes as a Tekken file.
#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {
  static const std::string path = fuzz::scratch(".tiktoken");
  static const std::string tek = fuzz::scratch("_tekken.json");
  fuzz::write_file(path, d, n);
  mfsdp::TokenizerOptions o;
  o.tiktoken_encoding = "cl100k_base";
  std::vector<int32_t> ids;
  fuzz::expect_user_errors_only([&] {
    auto t = mfsdp::tok_detail::load_tiktoken(path, o);
    t->session()->encode("Hello world, it's 2026!\n  x", ids);
  });
  fuzz::write_file(tek, d, n);
  fuzz::expect_user_errors_only([&] {
    auto t = mfsdp::tok_detail::load_tekken(tek, o);
    t->session()->encode("Hello world, it's 2026!\n  x", ids);
  });
  return 0;
}
