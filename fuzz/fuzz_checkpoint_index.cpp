// A checkpoint's index.json. What the parser accepts must be safe for checkpoint.cpp's readers:
// every piece's element runs, mapped through its tensor-parallel split, lie inside the parameter,
// and its file is one the index lists (checkpoint_index.h).
#include "checkpoint/checkpoint_index.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {
  fuzz::expect_user_errors_only([&] {
    auto idx = mfsdp::parse_checkpoint_index(std::string(reinterpret_cast<const char*>(d), n), "fuzz/index.json");
    for (auto it = idx["params"].begin(); it != idx["params"].end(); ++it) {
      const auto shape = it.value()["shape"].get<std::vector<int64_t>>();
      int64_t numel = 1;
      for (int64_t s : shape) numel *= s;
      for (const auto& pc : it.value()["pieces"]) {
        if (!idx["files"].contains(pc["file"].get<std::string>())) __builtin_trap();
        const int64_t b = pc["begin"].get<int64_t>(), e = pc["end"].get<int64_t>();
        int64_t covered = 0;
        mfsdp::checkpoint_piece_split(pc, shape).for_each_run(b, e, [&](int64_t g, int64_t l, int64_t len) {
          if (len <= 0 || g < 0 || g + len > numel || l < b || l + len > e) __builtin_trap();
          covered += len;
        });
        if (covered != e - b) __builtin_trap();  // every local element has its place
      }
    }
  });
  return 0;
}
