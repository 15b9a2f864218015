#pragma once
// The collectives of a group whose ranks run on several hosts, the same number L >= 2 on each
// (HostLayout::hierarchical()): the reduce-scatter and all-gather into one tensor (below, at their
// declarations), and the allreduce. Only step 2 crosses the hosts' links, carrying 1/L of
// the array per rank, the L local ranks' streams at once:
//   1. inside the host, over shared memory: local rank l reduces slice l of the array from every
//      local rank's copy
//   2. across the hosts over Gloo: local rank l allreduces slice l with the ranks of local rank l on
//      every host (one Gloo group per local rank, made once, from the group's store), in pieces of
//      1 MiB, two in flight, so that a piece crosses while the next one is reduced
//   3. inside the host: local rank l writes each piece of slice l back into every local rank's copy
//      as it lands
// all three in allreduce_shared's own loop over the pieces of the slice, between the host's
// Communicator::start_shared and finish_shared (the SharedSlice reduces a piece inside the host and
// copies it to the host's peers): the array lies in memory the host's ranks share, and they wait
// for each other only before step 1 and after step 3. DDP's buckets live there (share()); any other tensor is copied into a scratch array of
// the host's and back, a window at a time (allreduce()). Every rank ends with the same bits: step 2
// gives every member of a Gloo group the same slice, step 3 copies it. They differ from flat
// Gloo's only in the order of the additions (fp32 rounding). Keeping DDP's buckets where the
// host's ranks share them is what brings a DDP step near the allreduce alone (benchmarks/README.md,
// "Flat Gloo against hierarchical across hosts").
//
// Failures: every wait is bounded by the group's timeout (the Communicator's and the Gloo group's).
// A rank that dies is named by its host's peers (the Communicator watches their pids; errors name
// the group's ranks); its partners across the hosts see their Gloo allreduce fail and name the
// ranks they were reducing with, and fail their own host's Communicator, so their host's peers stop
// at once with that message instead of waiting for the timeout. The first rank to fail also
// writes its error under the group's store ("failure"), which a rank waiting in Gloo looks at
// every quarter second (and for a second more once Gloo failed): a partner of a rank that stopped
// because of another rank's death or stop names that rank first, not only the partner that left.
// Its host's peers, which wait for it meanwhile, wait for that verdict too (peers.h: set_away).
//
// Thread-safety: one thread at a time (the channel's), collectives in the same order on every rank.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "ddp/floor/src/shm/communicator.h"
#include "ddp/floor/src/shm/host_layout.h"

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
  // `scratch` is the host's first scratch array (local->share(kScratchBytes)).
  Hierarchical(HostLayout layout, int rank, std::unique_ptr<Communicator> local, std::shared_ptr<SharedArray> scratch,
               const c10::intrusive_ptr<c10d::Store>& store, const std::shared_ptr<::gloo::transport::Device>& device,
               std::chrono::milliseconds timeout);
  // Bytes of each rank's scratch array, where tensors that are not in shared memory are reduced in
  // two windows, one crossing while the other is copied out and in (allreduce()): at first (made
  // with the group, which every group keeps in /dev/shm beside the Communicator's 1 MiB - DDP
  // makes one of its own), and at most (made when a larger tensor comes: two windows of 4 MiB).
  // Each window ends with a round trip inside the host while the link waits, so windows must not be
  // small: 4 MiB came out best (benchmarks/README.md has the sizes tried).
  static constexpr std::size_t kScratchBytes = std::size_t{2} << 20;
  static constexpr std::size_t kLargestScratchBytes = std::size_t{8} << 20;
  ~Hierarchical();
  Hierarchical(const Hierarchical&) = delete;
  Hierarchical& operator=(const Hierarchical&) = delete;

  // The dtypes and reductions it takes (those both shared memory and Gloo reduce alike: float32,
  // float64, int32, int64; SUM, AVG of floating types, MAX, MIN, PRODUCT).
  static bool serves(DType dtype, Op op);
  // Every tensor (dense, contiguous, CPU, of `dtype`) becomes its part of the reduction over the
  // group of the list taken as one array (through the scratch array); `scale` (SUM of floating
  // types only) multiplies the sum. Throws PeerError naming the rank that caused a failure; after
  // one, every call throws.
  void allreduce(const std::vector<at::Tensor>& tensors, DType dtype, Op op, double scale);
  // "hierarchical (2 hosts x 2)".
  std::string name() const;

  // DDP's buckets in shared memory across hosts. Collective over the group: `bytes` of
  // memory this host's ranks share (Communicator::share), or ShmUnavailable on every rank of every
  // host alike, when a host could not make it or the hosts ask for different sizes.
  std::shared_ptr<SharedArray> share(std::size_t bytes);
  // allreduce (as above) of the `count` elements at byte `offset` of `array` (share() made it),
  // where they lie. `meanwhile`, if given, runs once on this thread while pieces cross the hosts
  // (or at the end when none of this rank's does).
  void allreduce_shared(const std::shared_ptr<SharedArray>& array, std::size_t offset, std::size_t count, DType dtype,
                        Op op, double scale, std::function<void()> meanwhile = nullptr);
  // The pieces this rank's slice crosses the hosts in, and how many cross at a time.
  static constexpr std::size_t kPieceBytes = std::size_t{1} << 20;
  static constexpr int kPiecesInFlight = 2;

  // c10d's _reduce_scatter_base across the hosts (hierarchical_reduce_scatter.cpp). `in` holds
  // size() pieces of `count` elements, one per rank in rank order; `out` (count elements; it may be
  // this rank's piece of `in`) becomes the reduction of piece rank() over every rank:
  //   1. inside the host, over shared memory: local rank l reduces, over its host's ranks, the
  //      pieces of the ranks of local rank l on every host (one reduce-scatter per host)
  //   2. across the hosts, with the ranks of local rank l (a Gloo all-to-all): each sends every
  //      partner its host's sum of that partner's piece, and reduces the sums it receives, in host
  //      order, into `out`
  // by slices of kPieceBytes of each piece, kPiecesInFlight crossing while the next is reduced in
  // the host. Only (H - 1) / H of this rank's piece leaves the host, per rank. Every dtype and
  // reduction the host takes (reduce_kernels.h, supported()); AVG is the sum times 1/size().
  void reduce_scatter(const void* in, std::size_t count, void* out, DType dtype, Op op);
  // c10d's _allgather_base across the hosts (hierarchical_all_gather.cpp): `out` (size() pieces of
  // `bytes`, in rank order) receives every rank's `in` (which may be this rank's piece of `out`):
  //   1. across the hosts: the ranks of local rank l exchange their pieces (a Gloo all-to-all)
  //   2. inside the host: each local rank's H pieces into their places in every local rank's `out`
  // by slices of kPieceBytes, the next crossing while one is shared inside the host.
  // Both check first, across the hosts, that the ranks of this local rank run the same collective
  // (a small Gloo allgather; inside the host the Communicator's desync check does): a partner that
  // runs another is named, never paired. Failures as the allreduce's (above).
  void allgather(const void* in, std::size_t bytes, void* out);
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return layout_.size(); }

 private:
  // What a reduce-scatter or all-gather across the hosts runs, compared across the hosts first.
  struct Across {
    int64_t kind;   // kReduceScatter or kAllgather
    int64_t count;  // elements per rank (reduce-scatter), bytes per rank (all-gather)
    int64_t dtype;
    int64_t op;
  };
  static constexpr int64_t kReduceScatter = 1, kAllgather = 2;
  static std::string describe(const Across& what);
  // Checks `what` across the hosts, then runs body(); any failure fails my host's Communicator
  // (my host's peers stop at once) and is told to the other hosts.
  void run_across(const Across& what, const std::function<void()>& body);
  void check_same_across(const Across& what);
  // A byte tensor of at least `bytes`, kept for the next collective: the pieces crossing the hosts
  // lie there (Gloo holds a view of it, so it outlives a failure).
  at::Tensor crossing_buffer(std::size_t bytes);
  // Waits for a Gloo step of a reduce-scatter or all-gather (finish_part), saying meanwhile to my
  // host's peers that I am away.
  void land(const c10::intrusive_ptr<c10d::Work>& work, const char* collective);
  c10::intrusive_ptr<c10d::Work> exchange(at::Tensor& received, at::Tensor& sent);  // Gloo's all-to-all
  void cross(SharedSlice& slice, const std::shared_ptr<SharedArray>& array, DType dtype, Op op,
             std::function<void()>& meanwhile);
  void grow_scratch(std::size_t bytes);
  // A Gloo allreduce across the hosts: started in the background, then waited for (its failure
  // named, my host's Communicator failed with it).
  c10::intrusive_ptr<c10d::Work> start_part(const at::Tensor& part, Op op);
  void finish_part(const c10::intrusive_ptr<c10d::Work>& work, const char* collective = "allreduce");
  std::string wait_watching(const c10::intrusive_ptr<c10d::Work>& work) const;
  std::string partners() const;
  void tell_other_hosts(const std::string& what) noexcept;
  std::string failure_told() const noexcept;
  std::string failure_told_within(std::chrono::milliseconds grace) const noexcept;
  // How long a rank whose step across the hosts failed looks for a failure another rank tells.
  static constexpr std::chrono::milliseconds kTellingGrace{1000};

  HostLayout layout_;
  int rank_;
  std::unique_ptr<Communicator> local_;
  std::shared_ptr<SharedArray> scratch_;
  std::size_t scratch_limit_ = kLargestScratchBytes;  // scratch_'s size, once a host could not grow it
  c10::intrusive_ptr<c10d::Store> store_;  // the group's: where a failing rank tells the others
  c10::intrusive_ptr<c10d::ProcessGroupGloo> across_;
  at::Tensor crossing_;  // crossing_buffer()
  bool told_other_hosts_ = false;
};

}  // namespace ddp::detail::shm
