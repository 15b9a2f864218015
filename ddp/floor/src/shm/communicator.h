#pragma once
// Collectives between the processes of one group on one host, through POSIX shared memory: no
// kernel network stack; each rank copies its data into shared memory once and reads the others'
// from there. Torch-free.
//
// The parts, each in its own file:
//   peers.h           the group's context: setup, the agreement every set-up step ends with,
//                     posts and waits, the data buffers, failure and whom it blames, the desync
//                     check (how a collective runs, step by step, is described there)
//   algorithms.h      the algorithms over that context, one file each: allreduce_direct.cpp,
//                     allreduce_sliced.cpp, broadcast.cpp, all_gather.cpp, reduce_scatter.cpp,
//                     all_to_all.cpp, barrier.cpp
//   shared_array.h    memory the ranks share (shared_array.cpp) and the allreduce of an array
//                     where it lies there (allreduce_shared.cpp)
//   communicator.cpp  this class: checks the arguments, handles a group of one, chooses the
//                     allreduce's algorithm and runs each collective in the context
//
// Thread-safety: a Communicator is used by one thread at a time (calls from several threads must
// be serialized by the caller). Collectives must be called in the same order with matching
// arguments on every rank of the group. A child forked after setup must not use it (destroying
// it there is harmless).
#include <cstddef>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ddp/floor/src/shm/peers.h"
#include "ddp/floor/src/shm/reduce_kernels.h"
#include "ddp/floor/src/shm/segment.h"
#include "ddp/floor/src/shm/shared_array.h"
#include "ddp/floor/src/shm/spans.h"

namespace ddp::detail::shm {

class Communicator {
 public:
  // Sets up the group (peers.h). `name_prefix` names the segments ("<prefix>-<rank>") and the
  // rendezvous keys: one leading '/', no other, short enough for a 255-character name, and unique
  // to this group of this job (carry the run id and the group's index) and to this Communicator
  // (the rendezvous keys are set once). All ranks pass the same prefix, size and options. A group
  // of one uses no shared memory.
  // Throws ShmUnavailable if this rank or any peer could not set up (no /dev/shm, full, a stale
  // object of that name, a peer that reported a failure, a rendezvous timeout); nothing of this
  // rank is left in /dev/shm then. Ranks that throw should agree, through the caller's store, to
  // use another transport for the whole group: a peer may have failed after this rank succeeded.
  // Throws std::invalid_argument for a bad rank, size or options.
  Communicator(Rendezvous& rendezvous, const std::string& name_prefix, int rank, int size, Options options = {});
  // Unmaps the group's memory. Peers that still wait for this rank fail at once, naming it.
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // In place: data (count elements of dtype) becomes the reduction over all ranks, in rank order,
  // bit-identical on every rank. Throws std::invalid_argument (before communicating, leaving the
  // communicator usable) for an unsupported dtype/op pair (AVG of integers).
  void allreduce(void* data, std::size_t count, DType dtype, Op op);
  // The same over several pieces of memory taken as one array, in order (a rank's pieces may be
  // cut differently from a peer's: only the total counts): DDP reduces a bucket's gradients where
  // they are, without gathering them into one tensor first. `scale` (SUM of floating types only;
  // see reduce_into) multiplies the sum before it is stored; it is part of the collective, so
  // ranks that would average differently fail the desync check instead of diverging.
  void allreduce(const std::vector<Span>& spans, DType dtype, Op op, double scale = 1.0);
  // `bytes` bytes from rank `root`'s data into everyone's. Throws std::invalid_argument (before
  // communicating) for a root that is not a rank.
  void broadcast(void* data, std::size_t bytes, int root);
  // out (size() * bytes_per_rank bytes) receives every rank's `in`, in rank order. `in` may be
  // this rank's part of `out`; otherwise the two must not overlap.
  void allgather(const void* in, std::size_t bytes_per_rank, void* out);
  // The same with rank q's piece landing at places[q] (one per rank, none overlapping; `in` may
  // be places[rank()]).
  void allgather(const void* in, std::size_t bytes_per_rank, const std::vector<void*>& places);
  // `in` holds size() pieces of `count` elements of dtype; `out` (count elements) becomes the
  // reduction over the ranks of piece rank(), in rank order: the bits allreduce gives those
  // elements. `out` may be this rank's piece of `in`; otherwise the two must not overlap. Throws
  // std::invalid_argument (before communicating) for what allreduce refuses.
  void reduce_scatter(const void* in, std::size_t count, void* out, DType dtype, Op op);
  // The same with piece q at pieces[q] (one per rank): a hierarchical reduce-scatter's pieces lie
  // apart in its input. `out` may be pieces[rank()].
  void reduce_scatter(const std::vector<const void*>& pieces, std::size_t count, void* out, DType dtype, Op op);
  // Every rank's piece for every rank: sends[q] is the part of `in` for rank q, receives[p] the
  // part of `out` that rank p's piece for this rank lands in (one of each per rank; pieces may
  // differ in size from rank to rank - uneven splits - but each must be the size its receiver
  // expects: the ranks compare them, and throw PeerError naming the first that differs). `in` and
  // `out` must not overlap. Throws std::invalid_argument (before communicating) for lists that are
  // not one per rank. Without `own_piece`, this rank's piece for itself is left to the caller (who
  // copies it on another thread meanwhile: one copy fewer on this one); its sizes are checked all
  // the same.
  void all_to_all(const void* in, const std::vector<Piece>& sends, void* out, const std::vector<Piece>& receives,
                  bool own_piece = true);
  // Returns once every rank has called barrier().
  void barrier();

  // Collective: `bytes` of zeroed memory for this rank that every peer maps, and theirs (see
  // SharedArray). Throws ShmUnavailable on every rank alike when the ranks ask for different sizes,
  // or any rank could not create or map its part (/dev/shm full: its size is the tmpfs mount's or
  // the container's --shm-size); the communicator stays usable then, and nothing is left in
  // /dev/shm.
  std::shared_ptr<SharedArray> share(std::size_t bytes);
  // In place, like allreduce: the `count` elements of `dtype` at byte `offset` of every rank's
  // part of `array` (a multiple of the element size) become their reduction over the ranks, in
  // rank order, times `scale`, bit-identical on every rank. Every rank passes the same array,
  // offset and count (the desync check names a rank that does not). The caller writes its part
  // before the call and leaves all of it alone until the call returns.
  void allreduce_shared(const SharedArray& array, std::size_t offset, std::size_t count, DType dtype, Op op,
                        double scale = 1.0);
  // allreduce_shared in steps, for an algorithm that does more with this rank's slice between
  // reducing it and copying it to the peers (hierarchical.cpp: it crosses the hosts): the same
  // arguments, checks and descriptor. start_shared returns once every rank's part holds its data;
  // the caller then reduces its whole slice and copies it to the peers through the SharedSlice,
  // and calls finish_shared, which returns once every rank's slice is in this rank's part. With
  // `away`, peers waiting for this rank meanwhile give it one more timeout (peers.h: it waits for
  // something outside the group, bounded by a timeout of its own). A failure in between is this
  // rank's: the caller passes it to fail_with.
  SharedSlice start_shared(const SharedArray& array, std::size_t offset, std::size_t count, DType dtype, Op op,
                           double scale, bool away);
  void finish_shared();
  // While `away`, this rank waits for something outside the group (a step across the hosts, bounded
  // by a timeout of its own): peers waiting for it give it one more timeout (peers.h, set_away).
  void set_away(bool away) noexcept { peers_.set_away(away); }

  // Rank `rank`'s slice of an array of `count` elements of `dtype` in allreduce_shared (the part of
  // the array it reduces, and in a hierarchical allreduce sends across the hosts): elements
  // [first, second). The parts are consecutive in rank order and cover the array; each starts at a
  // multiple of 64 bytes and holds at most 1/size of the array plus 128 bytes (some are empty for
  // arrays under 64 bytes per rank). The same on every rank of the group.
  std::pair<std::size_t, std::size_t> part(int rank, std::size_t count, DType dtype) const;

  // The collectives above throw PeerError when a peer fails them (peers.h); after that every call
  // throws the same error again.
  bool failed() const noexcept { return peers_.failed(); }
  void throw_if_failed() const { peers_.throw_if_failed(); }
  // This rank fails with `error`, which happened outside the communicator (a hierarchical
  // allreduce's step across hosts): every later call throws it, and peers waiting for this rank
  // fail at once with its text. Only the first failure is kept.
  void fail(const PeerError& error) noexcept { peers_.fail(error); }
  // The same for an error raised between start_shared and finish_shared: a PeerError as it is,
  // anything else as this rank's own failure in that allreduce_shared. Returns the PeerError this
  // rank failed with, for the caller to throw.
  PeerError fail_with(const std::exception& error) { return peers_.fail_with(error); }
  // The error a peer failed with (its text), or "" while none has: what a rank whose work outside
  // the communicator failed names first, when its host's peers already know the cause.
  std::string peer_failure() const { return peers_.peer_failure(); }
  int rank() const noexcept { return peers_.rank(); }
  int size() const noexcept { return peers_.size(); }
  const Options& options() const noexcept { return peers_.options(); }

 private:
  static void check_reduction(const char* collective, DType dtype, Op op, double scale);
  void check_same_size(std::size_t bytes);

  Peers peers_;
  std::uint32_t arrays_shared_ = 0;  // share() calls made
};

}  // namespace ddp::detail::shm
