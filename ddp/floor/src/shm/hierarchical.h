#pragma once
// The allreduce of a group whose ranks run on several hosts, the same number L >= 2 on each
// (issue 29; HostLayout::hierarchical()). Only step 2 crosses the hosts' links, carrying 1/L of
// the array per rank, the L local ranks' streams at once:
//   1. reduce-scatter inside the host, over shared memory: local rank l holds part l of the
//      host's sum                                              (Communicator::reduce_scatter)
//   2. allreduce part l across the hosts over Gloo, among the ranks of local rank l on every host
//      (one Gloo group per local rank, made once, from the group's store)
//   3. allgather the parts inside the host, over shared memory (Communicator::allgather_parts)
// in chunks of 4 MiB as a pipeline: chunk k crosses the link while chunk k+1 is reduced and chunk
// k-1 gathered inside the host.
// Every rank ends with the same bits: step 2 gives every member of a Gloo group the same part,
// step 3 copies it. They differ from flat Gloo's only in the order of the additions (fp32
// rounding).
//
// Failures: every wait is bounded by the group's timeout (the Communicator's and the Gloo group's).
// A rank that dies is named by its host's peers (the Communicator watches their pids; errors name
// the group's ranks); its partners across the hosts see their Gloo allreduce fail and name the
// ranks they were reducing with, and fail their own host's Communicator, so their host's peers stop
// at once with that message instead of waiting for the timeout. The first rank to fail also
// writes its error under the group's store ("failure"), which a rank waiting in Gloo looks at
// every quarter second: a partner of a rank that stopped because of another rank's death names
// that death, not only the partner that left.
//
// Thread-safety: one thread at a time (the channel's), collectives in the same order on every rank.
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "shm/communicator.h"
#include "shm/host_layout.h"

namespace gloo::transport {
class Device;
}
namespace c10d {
class ProcessGroupGloo;
}

namespace ddp::detail::shm {

class Hierarchical {
 public:
  // Collective over the group: makes this rank's Gloo group across the hosts (the ranks of its
  // local rank on every host, numbered by host) over `store` under a prefix of its local rank, on
  // `device`, with `timeout`. `local` is this host's Communicator (ranks numbered by local rank,
  // Options::rank_names set to their group ranks), already agreed on by every rank of the group.
  // Throws what Gloo throws when its group cannot connect.
  Hierarchical(HostLayout layout, int rank, std::unique_ptr<Communicator> local,
               const c10::intrusive_ptr<c10d::Store>& store, const std::shared_ptr<::gloo::transport::Device>& device,
               std::chrono::milliseconds timeout);
  ~Hierarchical();
  Hierarchical(const Hierarchical&) = delete;
  Hierarchical& operator=(const Hierarchical&) = delete;

  // The dtypes and reductions it takes (those both shared memory and Gloo reduce alike: float32,
  // float64, int32, int64; SUM, AVG of floating types, MAX, MIN, PRODUCT).
  static bool serves(DType dtype, Op op);
  // Every tensor (dense, contiguous, CPU, of `dtype`) becomes its part of the reduction over the
  // group of the list taken as one array; `scale` (SUM of floating types only) multiplies the sum.
  // Throws PeerError naming the rank that caused a failure; after one, every call throws.
  void allreduce(const std::vector<at::Tensor>& tensors, DType dtype, Op op, double scale);
  // "hierarchical (2 hosts x 2)".
  std::string name() const;

 private:
  // Chunks of the array pipelined through the three steps (hierarchical.cpp says how).
  static constexpr std::size_t kChunkBytes = std::size_t{4} << 20;
  void run(const std::vector<at::Tensor>& tensors, DType dtype, Op op, double scale);
  // Step 2 of a chunk: started in the background, then waited for (its failure named, my host's
  // Communicator failed with it).
  c10::intrusive_ptr<c10d::Work> start_part(const at::Tensor& part, Op op);
  void finish_part(const c10::intrusive_ptr<c10d::Work>& work);
  std::string wait_watching(const c10::intrusive_ptr<c10d::Work>& work) const;
  void tell_other_hosts(const std::string& what) noexcept;
  std::string failure_told() const noexcept;

  HostLayout layout_;
  int rank_;
  std::unique_ptr<Communicator> local_;
  c10::intrusive_ptr<c10d::Store> store_;  // the group's: where a failing rank tells the others
  c10::intrusive_ptr<c10d::ProcessGroupGloo> across_;
  bool told_other_hosts_ = false;
};

}  // namespace ddp::detail::shm
