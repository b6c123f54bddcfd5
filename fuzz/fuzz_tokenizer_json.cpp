// A tokenizer.json (or GPT-2 vocab.json when it is an object of ids): load it and, when it loads,
// encode a few texts that reach the normalizers, pre-tokenizers, added tokens and the BPE merges.
#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {
  static const std::string path = fuzz::scratch("_tokenizer.json");
  fuzz::write_file(path, d, n);
  fuzz::expect_user_errors_only([&] {
    auto t = mfsdp::tok_detail::load_hf_json(path, {});
    auto s = t->session();
    std::vector<int32_t> ids;
    for (const char* text : {"Hello world", "  it's 12345 naïve café\n\n\tend", "<s>x</s> <|endoftext|>", "東京 😀", ""}) {
      ids.clear();
      s->encode(text, ids);
    }
  });
  return 0;
}
