// Megatron .idx (+ a .bin of the size the input asks for) and llm.c token files: open, walk every
// sequence and read its first and last tokens. Input: byte 0 picks the format; for Megatron bytes
// 1..4 give the .bin size; the rest is the .idx (or the whole llm.c file).
#include "data/token_source.h"
#include "fuzz_util.h"

#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {
  if (n < 5) return 0;
  static const std::string prefix = fuzz::scratch("_ds");
  const bool megatron = d[0] & 1;
  fuzz::expect_user_errors_only([&] {
    std::unique_ptr<mfsdp::TokenSource> src;
    if (megatron) {
      uint32_t bin_size = (uint32_t(d[1]) | uint32_t(d[2]) << 8 | uint32_t(d[3]) << 16) % (1 << 16);
      std::vector<uint8_t> bin(bin_size, 7);
      fuzz::write_file(prefix + ".bin", bin.data(), bin.size());
      fuzz::write_file(prefix + ".idx", d + 5, n - 5);
      src = mfsdp::TokenSource::open(prefix, "megatron");
    } else {
      fuzz::write_file(prefix + ".llmc.bin", d + 1, n - 1);
      src = mfsdp::TokenSource::open(prefix + ".llmc.bin", "llmc");
    }
    int64_t tok = 0;
    for (int64_t s = 0; s < src->num_sequences() && s < 4096; ++s) {
      const int64_t len = src->seq_length(s);
      if (len <= 0) continue;
      src->read(src->seq_offset(s), 1, &tok);
      src->read(src->seq_offset(s) + len - 1, 1, &tok);
    }
    (void)src->doc_bounds();
  });
  return 0;
}
