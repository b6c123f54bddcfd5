// A caching allocator for CPU tensors (DESIGN.md section 7, "Host memory cache"): blocks of 64 KiB
// and more are kept when freed and handed out again for the same size class, so that a training
// step, which allocates the same activations, gradients and gathered units every step, stops going
// through glibc's bins (malloc_consolidate, unlinking, splitting) and the kernel's page faults for
// freshly mapped memory. The cache never holds more than the process already used at its peak:
// a miss first returns idle blocks to the system until live + idle + the new block fit in the
// largest live total seen, so peak RSS stays what the step needs (plus size-class rounding, under
// 1/16 of a block).
#pragma once
#include <cstdint>
#include <string>

namespace mfsdp {

struct HostCacheStats {
  int64_t hits = 0, misses = 0, released = 0;  // allocations served from the cache / not; blocks freed by the cache
  int64_t live_bytes = 0, idle_bytes = 0, peak_live_bytes = 0;
};

// Makes the cache LibTorch's CPU allocator for the rest of the process (idempotent). Returns false
// when MFSDP_HOST_CACHE=off asks for the default allocator.
bool install_host_cache();
HostCacheStats host_cache_stats();
// "host memory cache: 97.3% of large allocations reused, 412 MiB idle at most" or "".
std::string describe_host_cache();

}  // namespace mfsdp
