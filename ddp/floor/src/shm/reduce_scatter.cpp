// Reduce-scatter through the shared segments (algorithms.h): the first half of the sliced
// allreduce on its own - every rank publishes what each peer reduces, then reduces its own piece
// from every rank's contribution, in rank order. Each rank writes only the peers' pieces into
// shared memory (its own is read where it is), and reads only its own piece back: about half the
// memory traffic of an allreduce of the whole input.
#include "ddp/floor/src/shm/algorithms.h"
#include "ddp/floor/src/shm/steps.h"

namespace ddp::detail::shm::algorithm {
namespace {

// Which of `owner`'s W - 1 staging slots holds what `reader` reduces (owner keeps no slot for itself).
std::size_t slot_of(int owner, int reader) { return static_cast<std::size_t>(reader < owner ? reader : reader - 1); }

}  // namespace

std::size_t reduce_scatter_slot_bytes(const Peers& peers, std::size_t element) {
  const std::size_t share = peers.options().chunk_bytes / static_cast<std::size_t>(peers.size() - 1);
  return share >= 64 ? share / 64 * 64 : share / element * element;
}

void reduce_scatter(Peers& peers, const void* const* pieces, std::size_t count, void* out, DType dtype, Op op) {
  const std::size_t element = dtype_size(dtype), slot_bytes = reduce_scatter_slot_bytes(peers, element);
  const int rank = peers.rank(), size = peers.size();
  const void** sources = peers.sources();
  auto* result = static_cast<unsigned char*>(out);
  const auto of_piece = [&](int q, std::size_t first) { return static_cast<const unsigned char*>(pieces[q]) + first * element; };
  // Per step, slot_bytes / element elements of every piece: each peer's in a slot of one buffer of mine.
  peers.for_each_chunk(count, slot_bytes / element, true, [&](const Chunk& chunk) {
    const std::size_t first = chunk.first, n = chunk.n;
    // 1. Copy into a free buffer of mine (the other one may still be read by peers on the
    //    previous step) each peer's elements [first, first + n), one slot each; post: the peers
    //    may read them.
    for (int q = 0; q < size && n > 0; ++q) {
      if (q != rank) copy_bytes(peers.buffer(rank, chunk.buffer) + slot_of(rank, q) * slot_bytes, of_piece(q, first), n * element);
    }
    peers.post();
    // 2. Once every peer's slots are in: reduce my piece's elements from all W ranks, in rank
    //    order (mine where it is), into `out` - the allreduce's bits exactly; post that I am done
    //    reading the peers' buffers.
    peers.wait_all(peers.posted(), chunk.waiting_for("the peers' pieces"));
    for (int q = 0; q < size; ++q) {
      sources[q] = q == rank ? of_piece(rank, first) : peers.buffer(q, chunk.buffer) + slot_of(q, rank) * slot_bytes;
    }
    if (n > 0) reduce_into(result + first * element, sources, size, n, dtype, op);
    peers.post();
  });
}

}  // namespace ddp::detail::shm::algorithm
