// gzip / zstd / plain input streams read line by line (what prepare-data does with its inputs).
#include "data/text_input.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {
  static const std::string path = fuzz::scratch(".in");
  fuzz::write_file(path, d, n);
  fuzz::expect_user_errors_only([&] {
    mfsdp::InputStream in(path);
    mfsdp::LineReader lines(in, size_t(1) << 20);
    std::string line;
    uint64_t total = 0;
    while (lines.next(line) && total < (64u << 20)) total += line.size() + 1;
  });
  return 0;
}
