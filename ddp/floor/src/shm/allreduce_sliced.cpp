// allreduce, each rank reducing its slice of every chunk (algorithms.h) and copying the others'
// slices: each element read about twice, whatever the number of ranks.
#include "ddp/floor/src/shm/algorithms.h"
#include "ddp/floor/src/shm/slices.h"
#include "ddp/floor/src/shm/steps.h"

namespace ddp::detail::shm::algorithm {

void allreduce_sliced(Peers& peers, const std::vector<Span>& spans, std::size_t count, DType dtype, Op op, double scale) {
  const std::size_t element = dtype_size(dtype);
  const int rank = peers.rank(), size = peers.size();
  const void** sources = peers.sources();
  peers.for_each_chunk(count, peers.options().chunk_bytes / element, true, [&](const Chunk& chunk) {
    // 1. Copy my chunk into a free buffer of mine; post.
    unsigned char* staged = stage_chunk(peers, spans, element, chunk);
    // 2. Once every peer's chunk is in: reduce my slice from all W buffers, in rank order, into my
    //    own buffer's slice (reduce_into reads a block of every source before writing it); post.
    peers.wait_all(peers.posted(), chunk.waiting_for("the peers' chunks"));
    const auto [begin, end] = slice(rank, size, chunk.n, element);
    for (int q = 0; q < size; ++q) sources[q] = peers.buffer(q, chunk.buffer) + begin * element;
    reduce_into(staged + begin * element, sources, size, end - begin, dtype, op, scale);
    peers.post();
    // 3. Once every slice is reduced: copy each from its owner's buffer into my output; post that I
    //    am done reading the peers' buffers.
    peers.wait_all(peers.posted(), chunk.waiting_for("the peers' reduced slices"));
    for (int q = 0; q < size; ++q) {
      const auto [from, to] = slice(q, size, chunk.n, element);
      const unsigned char* reduced = peers.buffer(q, chunk.buffer) + from * element;
      for_each_piece(spans, element, chunk.first + from, to - from, [&](unsigned char* piece, std::size_t at, std::size_t len) {
        copy_bytes(piece, reduced + at * element, len * element);
      });
    }
    peers.post();
  });
}

}  // namespace ddp::detail::shm::algorithm
