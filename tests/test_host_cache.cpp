// The host memory cache (device/host_cache.h): reuse of a freed block for the same size class,
// small blocks left to the system, LibTorch's raw allocation interface, the bound that keeps
// live + idle within the live peak, alignment, and concurrent use from several threads.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#include <cstdlib>
#include <thread>
#include <vector>

#include "catch.h"
#include "device/host_cache.h"

using namespace mfsdp;

namespace {
// The cache itself is under test: installed whatever MFSDP_HOST_CACHE says (scripts/sanitize.sh
// turns it off for the other tests).
struct Installed {
  Installed() {
    unsetenv("MFSDP_HOST_CACHE");
    REQUIRE(install_host_cache());
  }
};
}  // namespace

TEST_CASE("host cache: a freed large block serves the next allocation of its size class") {
  Installed on;
  const HostCacheStats before = host_cache_stats();
  void* first;
  {
    at::Tensor t = at::empty({1 << 18});  // 1 MiB
    first = t.data_ptr();
  }
  at::Tensor again = at::empty({(1 << 18) - 100});  // same size class (granule 64 KiB at 1 MiB)
  const HostCacheStats after = host_cache_stats();
  CHECK(again.data_ptr() == first);
  CHECK(after.hits >= before.hits + 1);
  CHECK(reinterpret_cast<uintptr_t>(again.data_ptr()) % 64 == 0);
  // Small blocks go to the system allocator: no hit, no miss.
  { at::Tensor small = at::empty({1000}); }
  CHECK(host_cache_stats().hits + host_cache_stats().misses == after.hits + after.misses);
}

TEST_CASE("host cache: LibTorch's raw_allocate / raw_deallocate (oneDNN's scratch memory) go through it") {
  Installed on;
  c10::Allocator* a = c10::GetCPUAllocator();
  void* p = a->raw_allocate(size_t(3) << 20);
  REQUIRE(p != nullptr);
  std::memset(p, 1, size_t(3) << 20);
  a->raw_deallocate(p);
  void* q = a->raw_allocate(size_t(3) << 20);
  CHECK(q == p);
  a->raw_deallocate(q);
  void* s = a->raw_allocate(100);  // a small block through the same deleter
  a->raw_deallocate(s);
}

TEST_CASE("host cache: a miss returns idle blocks so that live + idle stays within the live peak") {
  Installed on;
  const HostCacheStats s0 = host_cache_stats();
  {
    at::Tensor a = at::empty({int64_t(2) << 20}), b = at::empty({int64_t(2) << 20});  // 8 MiB each
  }
  const HostCacheStats s1 = host_cache_stats();
  CHECK(s1.idle_bytes >= (int64_t(16) << 20));  // (older idle blocks may have gone back to make room)
  // 12 MiB, a size class not idle: the 8 MiB blocks go back until the footprint fits the peak.
  at::Tensor c = at::empty({int64_t(3) << 20});
  const HostCacheStats s2 = host_cache_stats();
  CHECK(s2.released >= s1.released + 1);
  CHECK(s2.live_bytes + s2.idle_bytes <= s2.peak_live_bytes);
}

TEST_CASE("host cache: threads allocating and freeing at once") {
  Installed on;
  const HostCacheStats s0 = host_cache_stats();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t] {
      for (int i = 0; i < 300; ++i) {
        at::Tensor x = at::full({int64_t(1) << (15 + (i + t) % 5)}, float(i));
        if (x[0].item<float>() != float(i)) throw std::runtime_error("corrupted block");
      }
    });
  for (auto& th : threads) th.join();
  const HostCacheStats s1 = host_cache_stats();
  CHECK(s1.live_bytes == s0.live_bytes);  // everything made here was given back
  CHECK(s1.hits > s0.hits);
}
