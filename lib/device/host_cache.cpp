// The host memory cache (device/host_cache.h). Every block, small or large, carries a 64-byte
// header in front of its data with its size class (0: not cached), so that one deleter frees any
// block this allocator made: LibTorch's raw_allocate/raw_deallocate (oneDNN's scratch memory goes
// through them) need the data pointer to be the context and one raw deleter for all blocks.
#include "device/host_cache.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace mfsdp {
namespace {

constexpr size_t kHeader = 64;             // keeps the data 64-byte aligned, as c10's allocator does
constexpr size_t kCacheMin = size_t(64) << 10;  // smaller blocks: the malloc (jemalloc) does them well

struct Header {
  size_t size_class;  // bytes of data the block holds; 0 for a block that is not cached
};

// The size class of n bytes: n rounded up to a granule of 1/16 of its power of two (at least 4 KiB),
// so near sizes share blocks and rounding wastes under 1/16.
size_t size_class(size_t n) {
  size_t p = 1;
  while (p < n) p <<= 1;
  const size_t granule = std::max<size_t>(4096, p / 16);
  return (n + granule - 1) / granule * granule;
}

// nullptr when the system has no memory for it.
void* system_alloc_or_null(size_t data_bytes) {
  void* base = nullptr;
  return posix_memalign(&base, kHeader, kHeader + data_bytes) == 0 ? base : nullptr;
}

// Out of memory in the words of LibTorch's own CPU allocator ("can't allocate memory: you tried to
// allocate N bytes"), which the CLI turns into advice on what to change (apps/mfsdp/main.cpp); a
// std::bad_alloc would reach the user as an internal error through the TorchScript interpreter.
[[noreturn]] void out_of_memory(size_t n) {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "mfsdp host memory cache: can't allocate memory: you tried to allocate ",
                   n, " bytes.");
  std::abort();  // not reached
}

void* system_alloc(size_t data_bytes) {
  void* base = system_alloc_or_null(data_bytes);
  if (!base) out_of_memory(data_bytes);
  return base;
}

class HostCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* data = raw_alloc(n);
    return {data, data, &HostCache::free_block, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &HostCache::free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  HostCacheStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  void* raw_alloc(size_t n) {
    if (n < kCacheMin) {
      void* base = system_alloc(n);
      static_cast<Header*>(base)->size_class = 0;
      return static_cast<char*>(base) + kHeader;
    }
    const size_t c = size_class(n);
    void* base = nullptr;
    std::vector<void*> release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = idle_.find(c);
      if (it != idle_.end() && !it->second.empty()) {
        base = it->second.back();
        it->second.pop_back();
        stats_.idle_bytes -= int64_t(c);
        ++stats_.hits;
      } else {
        ++stats_.misses;
        // Keep live + idle within the larger of the live peak and what this allocation makes live:
        // idle blocks of other sizes go back to the system first, the largest first.
        const int64_t after = stats_.live_bytes + int64_t(c);
        const int64_t allowed = std::max(stats_.peak_live_bytes, after);
        for (auto b = idle_.rbegin(); b != idle_.rend() && after + stats_.idle_bytes > allowed; ++b) {
          while (!b->second.empty() && after + stats_.idle_bytes > allowed) {
            release.push_back(b->second.back());
            b->second.pop_back();
            stats_.idle_bytes -= int64_t(b->first);
            ++stats_.released;
          }
        }
      }
      stats_.live_bytes += int64_t(c);
      stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
    }
    for (void* r : release) std::free(r);
    if (!base) {
      base = system_alloc_or_null(c);
      if (!base) {  // every idle block back to the system, then once more
        release_all_idle();
        base = system_alloc_or_null(c);
      }
      if (!base) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          stats_.live_bytes -= int64_t(c);
        }
        out_of_memory(n);
      }
      static_cast<Header*>(base)->size_class = c;
    }
    return static_cast<char*>(base) + kHeader;
  }

  void release_all_idle() {
    std::vector<void*> release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& b : idle_) {
        for (void* p : b.second) release.push_back(p);
        stats_.released += int64_t(b.second.size());
        b.second.clear();
      }
      stats_.idle_bytes = 0;
    }
    for (void* p : release) std::free(p);
  }

  void give_back(void* base) {
    const size_t c = static_cast<Header*>(base)->size_class;
    if (c == 0) {
      std::free(base);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    stats_.live_bytes -= int64_t(c);
    stats_.idle_bytes += int64_t(c);
    idle_[c].push_back(base);
  }

  static void free_block(void* data);

  std::mutex mu_;
  std::map<size_t, std::vector<void*>> idle_;  // size class -> idle blocks (their bases)
  HostCacheStats stats_;
};

HostCache* the_cache = nullptr;  // made once, never destroyed: blocks may be freed at exit

void HostCache::free_block(void* data) {
  if (data) the_cache->give_back(static_cast<char*>(data) - kHeader);
}

}  // namespace

bool install_host_cache() {
  const char* knob = std::getenv("MFSDP_HOST_CACHE");
  if (knob && std::string(knob) == "off") return false;
  if (!the_cache) {
    the_cache = new HostCache();
    c10::SetCPUAllocator(the_cache, /*priority=*/0);
  }
  return true;
}

HostCacheStats host_cache_stats() { return the_cache ? the_cache->stats() : HostCacheStats{}; }

std::string describe_host_cache() {
  if (!the_cache) return "";
  const HostCacheStats s = the_cache->stats();
  const int64_t all = s.hits + s.misses;
  return fmt::format("host memory cache: {} of {} large allocations reused ({:.1f}%), {} blocks returned, "
                     "peak live {:.1f} MiB",
                     s.hits, all, all ? 100.0 * double(s.hits) / double(all) : 0.0, s.released,
                     double(s.peak_live_bytes) / 1048576.0);
}

}  // namespace mfsdp
