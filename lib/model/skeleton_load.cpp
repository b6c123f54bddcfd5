// The meta-device load (DESIGN.md section 13). torch::jit::load onto the meta device is not enough:
// its unpickler reads every tensor record into CPU memory before moving it to the device, glibc
// keeps most of those freed blocks (1.1 GiB still resident after loading a 1.2 GiB file, measured),
// and a traced Hugging Face model does not load at all (its constants are compared with
// aten::equal, which has no meta kernel) and needs its rotary buffers' values anyway.
//
// The trick: the loader reads through a ReadAdapterInterface, and a stored (uncompressed) zip
// record is read by one call straight into the storage the unpickler allocated with the CPU
// allocator. So for the duration of the load the CPU allocator hands out fresh anonymous mappings
// for large blocks, and the read adapter, asked for exactly a large tensor record's bytes into
// exactly such a block, does not read them. The pages stay untouched (no resident memory: the
// kernel maps them on first write). What is not a parameter (buffers, tensor attributes) is read
// after the load from the recorded file range; parameters keep the unread storage until the
// caller replaces them. A record that does not match (a compressed archive, another allocator of
// higher priority) is simply read: slower, never wrong.
#include "model/skeleton_load.h"

#include <c10/core/CPUAllocator.h>             // GetCPUAllocator / SetCPUAllocator
#include <caffe2/serialize/inline_container.h>  // PyTorchStreamReader: record offsets and sizes
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/csrc/jit/serialization/import.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

namespace mfsdp {
namespace {

constexpr size_t kLazyMin = 64 << 10;  // smaller records are read: not worth a mapping each

struct Mapping {
  void* p;
  size_t n;
};

void unmap(void* ctx) {
  auto* m = static_cast<Mapping*>(ctx);
  munmap(m->p, m->n);
  delete m;
}

// Large blocks as their own anonymous mappings; small ones from the allocator it replaces. A
// DataPtr carries its own deleter, so blocks outlive the swap back.
class LazyAllocator final : public c10::Allocator {
 public:
  explicit LazyAllocator(c10::Allocator* fallback) : fallback_(fallback) {}
  c10::DataPtr allocate(size_t n) override {
    if (n < kLazyMin) return fallback_->allocate(n);
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_[p] = n;
    }
    return c10::DataPtr(p, new Mapping{p, n}, &unmap, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  bool owns(const void* p, size_t n) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(p);
    return it != blocks_.end() && it->second == n;
  }

 private:
  c10::Allocator* fallback_;
  mutable std::mutex mu_;
  std::map<const void*, size_t> blocks_;
};

// The file through pread, skipping the reads described above.
class SkippingReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  SkippingReader(const std::string& path, std::map<uint64_t, size_t> records, const LazyAllocator* alloc)
      : records_(std::move(records)), alloc_(alloc) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw std::runtime_error("open failed: " + std::string(std::strerror(errno)));
    struct stat st {};
    if (fstat(fd_, &st) != 0) throw std::runtime_error("stat failed: " + std::string(std::strerror(errno)));
    size_ = static_cast<size_t>(st.st_size);
  }
  ~SkippingReader() override { ::close(fd_); }
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    auto it = records_.find(pos);
    if (it != records_.end() && it->second == n && alloc_->owns(buf, n)) {
      skipped_[buf] = {pos, n};
      return n;
    }
    return read_at(pos, buf, n);
  }
  size_t read_at(uint64_t pos, void* buf, size_t n) const {
    size_t done = 0;
    while (done < n) {
      ssize_t r = ::pread(fd_, static_cast<char*>(buf) + done, n - done, static_cast<off_t>(pos + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      done += static_cast<size_t>(r);
    }
    return done;
  }
  // Storage address -> (file offset, bytes) of every record left unread.
  std::map<const void*, std::pair<uint64_t, size_t>>& skipped() const { return skipped_; }

 private:
  int fd_ = -1;
  size_t size_ = 0;
  std::map<uint64_t, size_t> records_;
  const LazyAllocator* alloc_;
  mutable std::map<const void*, std::pair<uint64_t, size_t>> skipped_;
};

// Swaps the CPU allocator for the load and back, also when the load throws.
struct AllocatorSwap {
  c10::Allocator* prev;
  explicit AllocatorSwap(c10::Allocator* next) : prev(c10::GetCPUAllocator()) { c10::SetCPUAllocator(next, 0); }
  ~AllocatorSwap() { c10::SetCPUAllocator(prev, 0); }
};

}  // namespace

torch::jit::Module load_skeleton(const std::string& path, torch::jit::ExtraFilesMap& extra, SkeletonStats* stats) {
  // The tensor records ("data/N" under the archive's folder) and where their bytes start.
  std::map<uint64_t, size_t> records;
  {
    caffe2::serialize::PyTorchStreamReader zip(path);
    for (const auto& name : zip.getAllRecords()) {
      if (name.rfind("data/", 0) != 0) continue;
      size_t n = zip.getRecordSize(name);
      if (n >= kLazyMin) records[zip.getRecordOffset(name)] = n;
    }
  }
  static LazyAllocator* lazy = nullptr;  // one per process; the fallback is the allocator at first use
  if (!lazy) lazy = new LazyAllocator(c10::GetCPUAllocator());
  auto reader = std::make_shared<SkippingReader>(path, std::move(records), lazy);
  torch::jit::Module module;
  {
    AllocatorSwap swap(lazy);
    module = torch::jit::load(reader, c10::Device(c10::kCPU), extra);
  }
  auto& skipped = reader->skipped();
  SkeletonStats st;
  st.records_skipped = static_cast<int64_t>(skipped.size());
  for (const auto& s : skipped) st.bytes_skipped += static_cast<int64_t>(s.second.second);
  // Buffers and other tensor attributes: read now, once per storage.
  for (const auto& sub : module.modules()) {
    auto type = sub.type();
    for (size_t i = 0; i < type->numAttributes(); ++i) {
      if (type->is_parameter(i)) continue;
      c10::IValue v = sub._ivalue()->getSlot(i);
      if (!v.isTensor()) continue;
      at::Tensor t = v.toTensor();
      if (!t.defined() || !t.has_storage() || t.device().type() != c10::kCPU) continue;
      auto it = skipped.find(t.storage().data());
      if (it == skipped.end()) continue;
      auto [pos, n] = it->second;
      if (reader->read_at(pos, t.storage().mutable_data(), n) != n)
        throw std::runtime_error(path + ": short read of a tensor record at offset " + std::to_string(pos));
      st.tensors_read_back += 1;
      st.bytes_read_back += static_cast<int64_t>(n);
      skipped.erase(it);
    }
  }
  if (stats) *stats = st;
  return module;
}

}  // namespace mfsdp
