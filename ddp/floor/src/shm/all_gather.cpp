// All-gather through the shared segments (algorithms.h): the second half of the sliced allreduce
// on its own - every rank publishes its piece, then copies every peer's piece out.
#include <cstring>

#include "ddp/floor/src/shm/algorithms.h"
#include "ddp/floor/src/shm/steps.h"

namespace ddp::detail::shm::algorithm {

void allgather(Peers& peers, const void* in, std::size_t bytes_per_rank, void* const* places) {
  const int rank = peers.rank(), size = peers.size();
  const auto place_of = [&](int q) { return static_cast<unsigned char*>(places[q]); };
  const auto* piece = static_cast<const unsigned char*>(in);
  unsigned char* my_place = place_of(rank);
  // A chunk of every piece per step: one buffer holds my piece's chunk, which each peer reads.
  peers.for_each_chunk(bytes_per_rank, peers.options().chunk_bytes, true, [&](const Chunk& chunk) {
    const std::size_t offset = chunk.first, n = chunk.n;
    // 1. Copy my piece's chunk into a free buffer of mine (the other one may still be read by
    //    peers on the previous chunk); post: the peers may read it.
    if (n > 0) copy_bytes(peers.buffer(rank, chunk.buffer), piece + offset, n);
    peers.post();
    // 2. While the peers copy theirs: my piece's chunk into its place, straight from `in` (unless
    //    `in` is its place already).
    if (n > 0 && piece != my_place) std::memmove(my_place + offset, piece + offset, n);
    // 3. Once every piece is in: copy each peer's into its place; post that I am done reading the
    //    peers' buffers.
    peers.wait_all(peers.posted(), chunk.waiting_for("the peers' pieces"));
    for (int q = 0; q < size && n > 0; ++q) {
      if (q != rank) copy_bytes(place_of(q) + offset, peers.buffer(q, chunk.buffer), n);
    }
    peers.post();
  });
}

}  // namespace ddp::detail::shm::algorithm
