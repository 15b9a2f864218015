#pragma once
// The shared-memory channel of a Gloo group whose ranks all run on one host - or on several hosts
// with the same number (two or more) on each, where it runs the allreduce, reduce-scatter and
// all-gather hierarchically (hierarchical.h: shared memory inside each host, Gloo across them):
// c10d's asynchronous collectives (a Work per call, finished later) over a Communicator (communicator.h), which is
// synchronous and single-threaded. The collectives run in the order they were issued, one at a
// time; a Work completes when its collective has, so DDP keeps launching buckets while backward
// runs, and comm hooks chain on the Work's future as on Gloo's. A small collective issued while
// the channel is idle runs at once on the caller's thread, which would otherwise only hand it to
// the channel's thread and sleep until it is back (two thread switches: most of a 4 KB
// allreduce's time); anything else, and anything issued behind it, runs on the channel's thread.
//
// What it serves (serves_*): dense, contiguous CPU tensors of float32, float64, bfloat16,
// float16 (summed in float32), int32, int64 or uint8; allreduce of one tensor or of a list of one
// dtype taken as one array (c10d's allreduce_coalesced; DDP's buckets reduced where the gradients
// lie) with SUM, AVG, MAX, MIN, PRODUCT (AVG only of floating types; a floating SUM may be scaled
// in the same pass); reduce-scatter of one tensor into one (c10d's _reduce_scatter_base) with the
// same reductions; broadcast; allgather into same-shaped outputs or into one tensor
// (_allgather_base); all-to-all of one tensor into one (c10d's alltoall_base), any dtype, equal or
// uneven splits; point-to-point send and receive (from one rank or any, with tags) of one tensor
// of any dtype - through the group's Mailbox (mailbox.h), whose own thread moves every message,
// so a receive that waits never holds up the collectives of the queue, nor they it, and sends never
// wait for their receives (sends first both ways cannot deadlock). Hierarchical: the
// allreduce of float32, float64, int32 and int64, and the reduce-scatter and all-gather into one
// tensor as on one host. The owner (owned_group.h) sends everything else to Gloo.
//
// Thread-safety: the collectives may be issued from any thread; the channel serializes them in
// the order of the calls, which every rank must make in the same order (as with any backend).
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace gloo::transport {
class Device;
}

namespace ddp::detail::shm {

class Communicator;
class Hierarchical;
class Mailbox;
class SharedArray;

class Channel {
 public:
  // Collective: every rank of the group calls it with the same arguments but its rank. Returns
  // the channel, or null on every rank alike - when `wanted` is false on any rank (the group's
  // recipe: InitOptions and TORCHDDP_SHM); when the ranks span several hosts (hostname, boot id and
  // /dev/shm mount, compared through the store) and `hierarchical` is false on any rank (InitOptions
  // and TORCHDDP_HIERARCHICAL), or the
  // hosts run different numbers of ranks, or one each (said once per process on rank 0's stderr);
  // when any rank's set-up fails (no /dev/shm, full, ...; said once on stderr) - and the group
  // then runs on Gloo alone. `store` is the group's own (prefixed) store; `device` is the group's
  // Gloo device, which the hierarchical allreduce's Gloo groups across the hosts share.
  static std::unique_ptr<Channel> open(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                       std::chrono::milliseconds timeout, const std::string& run_id, bool wanted,
                                       bool hierarchical, const std::shared_ptr<::gloo::transport::Device>& device);
  ~Channel();  // runs what was issued, then stops the thread
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // "shm", or "shm hierarchical (2 hosts x 2)".
  std::string name() const;

  // Broadcast of these (one tensor); barrier.
  bool serves(const std::vector<at::Tensor>& tensors) const;
  bool serves_barrier() const;
  // A non-empty list of one dtype (the caller decides whether a list means "coalesced").
  bool serves_allreduce(const std::vector<at::Tensor>& tensors, c10d::ReduceOp op) const;
  // Whether a SUM of these may be scaled (serves_allreduce, of a floating dtype).
  bool serves_scaled_sum(const std::vector<at::Tensor>& tensors) const;
  bool serves_allgather(const std::vector<std::vector<at::Tensor>>& outputs,
                        const std::vector<at::Tensor>& inputs) const;
  // c10d's _reduce_scatter_base: dense CPU tensors of one dtype and a reduction allreduce serves,
  // input size() times output's elements, output this rank's piece of input or apart from it.
  bool serves_reduce_scatter(const at::Tensor& output, const at::Tensor& input, c10d::ReduceOp op) const;
  // c10d's _allgather_base: dense CPU tensors of one dtype (any), output size() times input's
  // elements, input this rank's piece of output or apart from it.
  bool serves_allgather_into(const at::Tensor& output, const at::Tensor& input) const;

  // Point to point, one tensor (c10d's send, recv, recvAnysource), on one host.
  bool serves_point_to_point(const std::vector<at::Tensor>& tensors) const;
  // c10d's alltoall_base: dense CPU tensors of one dtype, apart; splits (rows of dimension 0) empty
  // for equal blocks, else one per rank summing to the tensor's rows.
  bool serves_all_to_all(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_splits,
                         const std::vector<int64_t>& input_splits) const;

  // Every tensor becomes its part of the reduction of the list taken as one array; `scale` (other
  // than 1 only for SUM of floating tensors) multiplies the sum in the same pass.
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, c10d::ReduceOp op, double scale = 1.0);
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, int root);
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs);
  // output becomes the reduction over the ranks of this rank's piece of input; output receives
  // every rank's input, in rank order. Straight between the tensors and the shared buffers.
  c10::intrusive_ptr<c10d::Work> reduce_scatter(at::Tensor& output, at::Tensor& input, c10d::ReduceOp op);
  c10::intrusive_ptr<c10d::Work> allgather_into(at::Tensor& output, at::Tensor& input);
  c10::intrusive_ptr<c10d::Work> barrier();
  // Rank q's block of input (rows input_splits[q], or an equal share) lands in rank q's output, in
  // its block for this rank; in the queue's order, like the collectives.
  c10::intrusive_ptr<c10d::Work> all_to_all(at::Tensor& output, at::Tensor& input, const std::vector<int64_t>& output_splits,
                                            const std::vector<int64_t>& input_splits);
  // The Work completes once the tensor is in shared memory (send) or holds the message (recv);
  // `src` -1 receives from any rank, and the Work's sourceRank() says which sent it.
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag);
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag);

  // Memory every rank of the group maps (communicator.h, SharedArray) - across hosts, every rank of
  // its host (hierarchical.h) - for DDP's gradient buckets (gradient_buffers.h), reduced where they
  // are. Collective, in order with the other collectives: `bytes` of zeroed memory, or null on every
  // rank alike when the channel cannot share it (ranks asking for different sizes; /dev/shm too
  // small on any host: said once on stderr).
  std::shared_ptr<SharedArray> share(std::size_t bytes);
  // This rank's part of a shared array.
  static void* mine(const SharedArray& array);
  // Whether shared_sum reduces elements of this dtype.
  bool serves_shared_sum(c10::ScalarType dtype) const;
  // allreduce SUM, times `scale` in the same pass, of the `count` elements of `dtype` at byte
  // `offset` of every rank's part of `array`, where they lie. `tensor` (those elements) is the
  // Work's result.
  c10::intrusive_ptr<c10d::Work> shared_sum(std::shared_ptr<SharedArray> array, std::size_t offset,
                                            const at::Tensor& tensor, double scale);

 private:
  class Work;
  // Where a collective may run: a small one on the caller's thread when nothing runs or waits.
  enum class Where { kChannelThread, kCallerIfIdle };
  static Where where_for(std::size_t bytes);
  Channel(std::unique_ptr<Communicator> communicator, std::unique_ptr<Hierarchical> hierarchical);
  // This rank's place in the group, on one host or several.
  int group_size() const;
  int group_rank() const;
  // Runs `body` (where `where` allows, else queued for the channel's thread) and returns the Work
  // it completes.
  c10::intrusive_ptr<c10d::Work> issue(c10d::OpType type, std::vector<at::Tensor> result, Where where,
                                       std::function<void()> body);
  void run();

  // One of the two: every rank of the group on this host, or several hosts.
  std::unique_ptr<Communicator> communicator_;
  std::unique_ptr<Hierarchical> hierarchical_;
  std::unique_ptr<Mailbox> mailbox_;  // on one host: point to point (its own thread)
  mutable std::mutex mutex_;  // guards the queue, running_ and stopping_
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool running_ = false;  // a collective runs (on the channel's thread or a caller's): the next waits
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace ddp::detail::shm
