#pragma once
// The shared-memory collectives' algorithms, one file each, as functions over the group's context
// (peers.h). Communicator (communicator.cpp) checks the arguments, handles a group of one, and runs
// each inside Peers::run with the collective's descriptor; each below is the steps alone, for a
// group of at least two. Internal to the core.
//
// The allreduces, per chunk of at most chunk_bytes (Peers::for_each_chunk):
//   sliced (allreduce_sliced.cpp):
//   1. copy my chunk into my buffer; post       (peers may now read it)
//   2. wait for every peer's step 1; reduce my 1/W slice of the chunk from all W buffers, in rank
//      order, into my own buffer's slice; post  (my slice of the result is ready)
//   3. wait for every peer's step 2; copy every slice from its owner's buffer to my output; post
//      (I am done reading everyone's buffer)
//   direct (allreduce_direct.cpp), at two ranks and for tensors of at most one_step_bytes: no
//   slices; after step 1 every rank reduces the whole chunk from all buffers straight into its
//   output (one round trip instead of two, no copy out; the same bits on every rank).
// reduce_scatter is step 1 and 2 alone (each rank stages only what the peers reduce, and reduces
// its own piece into its output); allgather is step 1 and 3 alone (each rank stages its piece and
// copies every peer's out); broadcast is the root's step 1 and the others' step 3.
// allreduce_shared (allreduce_shared.cpp) reduces an array where it lies, in memory every rank
// maps (shared_array.cpp): no buffers, one round trip before and one after.
#include <cstddef>
#include <vector>

#include "ddp/floor/src/shm/peers.h"
#include "ddp/floor/src/shm/reduce_kernels.h"
#include "ddp/floor/src/shm/spans.h"

namespace ddp::detail::shm::algorithm {

// `count` elements of `dtype` over the spans (count in all) become their reduction over the ranks.
void allreduce_direct(Peers& peers, const std::vector<Span>& spans, std::size_t count, DType dtype, Op op, double scale);
void allreduce_sliced(Peers& peers, const std::vector<Span>& spans, std::size_t count, DType dtype, Op op, double scale);
// Both allreduces' step 1: elements [first, first + n) of the spans copied into this rank's
// buffer (a free one: the other may still be read by peers on the previous chunk), then a post -
// the peers may read them. Returns the buffer.
unsigned char* stage_chunk(Peers& peers, const std::vector<Span>& spans, std::size_t element, const Chunk& chunk);
void broadcast(Peers& peers, void* data, std::size_t bytes, int root);
// places[q]: where rank q's piece lands. pieces[q]: the piece (count elements) rank q reduces.
void allgather(Peers& peers, const void* in, std::size_t bytes_per_rank, void* const* places);
void reduce_scatter(Peers& peers, const void* const* pieces, std::size_t count, void* out, DType dtype, Op op);
void barrier(Peers& peers);
// sends[q]: the part of `in` for rank q; receives[p]: the part of `out` rank p's piece for this
// rank lands in (this rank's own piece is copied within the rank). Every piece must be the size
// its receiver expects: all_to_all checks that on every rank (the same first mismatch named
// everywhere). `in` and `out` must not overlap. Without `own_piece`, the caller copies this rank's
// piece for itself (on another thread, meanwhile). (all_to_all.cpp)
void all_to_all(Peers& peers, const void* in, const std::vector<Piece>& sends, void* out, const std::vector<Piece>& receives,
                bool own_piece);

// reduce_scatter's bytes per staging slot: a buffer holds W - 1 of them, each a whole number of
// elements and, where there is room, of cache lines (whole vectors for the reduction). 0 when not
// even one element fits.
std::size_t reduce_scatter_slot_bytes(const Peers& peers, std::size_t element);
// all_to_all's bytes per staging slot: a buffer holds every rank's sizes, then W - 1 slots of whole
// cache lines. 0 when the buffer is too small for that.
std::size_t all_to_all_slot_bytes(const Peers& peers);

}  // namespace ddp::detail::shm::algorithm
