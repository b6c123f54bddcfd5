// The Communicator interface: the collectives FSDP needs, each synchronous and asynchronous.
// An asynchronous call returns a Work whose wait() makes its result visible to the caller (c10d's
// contract: the input must not be modified and the output not read until wait() returns).
// Backends: MPI for CPU tensors (mpi_communicator.cpp), NCCL for CUDA tensors (nccl_communicator.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

namespace mfsdp {

enum class ReduceOp { kSum, kAvg, kMax };
const char* to_string(ReduceOp op);

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective finished (MPI) or until the caller's stream is ordered after it
  // (NCCL). Rethrows a failure of the collective.
  virtual void wait() = 0;
  // Non-blocking: has the collective finished?
  virtual bool is_completed() = 0;
};
using WorkHandle = std::shared_ptr<Work>;

enum class Backend { kMpi, kNccl };
const char* to_string(Backend b);

class Communicator {
 public:
  Communicator(std::string name, int rank, int size, std::vector<int> world_ranks)
      : name_(std::move(name)), rank_(rank), size_(size), world_ranks_(std::move(world_ranks)) {}
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  // World rank of every member, by group rank.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  virtual Backend backend() const = 0;

  // out (size() * in.numel() elements, contiguous) receives rank r's `in` at [r*n, (r+1)*n).
  virtual WorkHandle all_gather_async(const at::Tensor& out, const at::Tensor& in) = 0;
  // in has size() * out.numel() elements; rank r receives the reduction of block r.
  virtual WorkHandle reduce_scatter_async(const at::Tensor& out, const at::Tensor& in, ReduceOp op) = 0;
  // In place.
  virtual WorkHandle all_reduce_async(const at::Tensor& t, ReduceOp op) = 0;
  virtual WorkHandle broadcast_async(const at::Tensor& t, int root) = 0;
  // Point-to-point: sends `send` to group rank `dst` while receiving `recv` (same element count and
  // dtype as the peer's send) from group rank `src` -- one step of a ring when dst = rank + 1 and
  // src = rank - 1 on every member.
  virtual WorkHandle send_recv_async(const at::Tensor& send, int dst, const at::Tensor& recv, int src) = 0;
  virtual WorkHandle barrier_async() = 0;

  // NCCL user-buffer registration (distributed.nccl_ub) of a persistent device buffer that this
  // communicator's all-gathers write into; other backends say why they cannot.
  virtual void register_buffer(const at::Tensor& t);

  void all_gather(const at::Tensor& out, const at::Tensor& in) { all_gather_async(out, in)->wait(); }
  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) {
    reduce_scatter_async(out, in, op)->wait();
  }
  void all_reduce(const at::Tensor& t, ReduceOp op) { all_reduce_async(t, op)->wait(); }
  void broadcast(const at::Tensor& t, int root) { broadcast_async(t, root)->wait(); }
  void send_recv(const at::Tensor& send, int dst, const at::Tensor& recv, int src) {
    send_recv_async(send, dst, recv, src)->wait();
  }
  void barrier() { barrier_async()->wait(); }

 protected:
  // Shape/dtype/device checks shared by the backends; throw with the communicator's name.
  void check_tensor(const at::Tensor& t, const char* what, const char* op) const;
  void check_gather_pair(const at::Tensor& big, const at::Tensor& small, const char* op) const;

 private:
  std::string name_;
  int rank_, size_;
  std::vector<int> world_ranks_;
};

// Every member's string, on every member (all-gather of lengths, then of the padded bytes).
std::vector<std::string> all_gather_strings(Communicator& c, const std::string& s);

// A communicator over the members of `comm` (an MPI communicator this object takes ownership of,
// unless it is MPI_COMM_WORLD). For kNccl the NCCL unique id is made on group rank 0 and broadcast
// over `comm`; requires a build with NCCL (nccl_available()).
std::unique_ptr<Communicator> make_communicator(Backend backend, MPI_Comm comm, std::string name);
bool nccl_available();

// GPU runs (DESIGN.md section 11). A group's communicator routes each call by the device of its
// tensors: CPU tensors (control values: stop flags, strings, checkpoint agreement, loss sums read
// by the host) to `host`, an MPI communicator, and CUDA tensors to `device`. They never mix: a
// control value never goes through NCCL on a host tensor, a gradient never through the host
// unless the device communicator is the staged one. backend() is the device communicator's.
std::unique_ptr<Communicator> make_routing_communicator(std::unique_ptr<Communicator> host,
                                                        std::unique_ptr<Communicator> device);
// CUDA tensors over MPI: each collective copies its input into pinned host memory on the caller's
// stream, runs the MPI collective on the progress thread once that copy is done, and copies the
// result back on the caller's stream in wait(). For several ranks on one GPU (NCCL refuses two
// ranks of a communicator on a GPU). `host` must outlive it. CUDA builds only.
std::unique_ptr<Communicator> make_staged_communicator(Communicator& host);
// NCCL communicators: the first (the world) from a unique id broadcast over MPI_COMM_WORLD, the
// others split from it (ncclCommSplit: no second bootstrap, shared resources), each rank in the
// group of `color` with rank order `key`. `members` are the group's world ranks.
std::unique_ptr<Communicator> make_nccl_world(std::string name);
std::unique_ptr<Communicator> make_nccl_split(Communicator& world, int color, int key, std::string name,
                                              std::vector<int> members);

}  // namespace mfsdp
