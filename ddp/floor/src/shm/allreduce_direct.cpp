// allreduce, every rank reducing the whole chunk (algorithms.h): from all buffers straight into
// its output, one round trip per chunk and no copy out. Each element is read W times instead of
// about twice, which pays at two ranks (5 passes over the chunk per rank instead of 5.5) and for
// tensors of a few KiB (the second round trip costs more than the extra reads).
#include "ddp/floor/src/shm/algorithms.h"
#include "ddp/floor/src/shm/steps.h"

namespace ddp::detail::shm::algorithm {

unsigned char* stage_chunk(Peers& peers, const std::vector<Span>& spans, std::size_t element, const Chunk& chunk) {
  unsigned char* staged = peers.buffer(peers.rank(), chunk.buffer);
  for_each_piece(spans, element, chunk.first, chunk.n, [&](unsigned char* piece, std::size_t at, std::size_t len) {
    copy_bytes(staged + at * element, piece, len * element);
  });
  peers.post();
  return staged;
}

void allreduce_direct(Peers& peers, const std::vector<Span>& spans, std::size_t count, DType dtype, Op op, double scale) {
  const std::size_t element = dtype_size(dtype);
  const int rank = peers.rank(), size = peers.size();
  const void** sources = peers.sources();
  peers.for_each_chunk(count, peers.options().chunk_bytes / element, true, [&](const Chunk& chunk) {
    // 1. Copy my chunk into a free buffer of mine; post.
    stage_chunk(peers, spans, element, chunk);
    // 2. Once every peer's chunk is in: reduce all of them, in rank order, into my output (mine read
    //    in place: the same bytes as my buffer's copy). Every rank reduces the same bytes in the same
    //    order: the same bits everywhere.
    peers.wait_all(peers.posted(), chunk.waiting_for("the peers' chunks"));
    for_each_piece(spans, element, chunk.first, chunk.n, [&](unsigned char* piece, std::size_t at, std::size_t len) {
      for (int q = 0; q < size; ++q) sources[q] = q == rank ? piece : peers.buffer(q, chunk.buffer) + at * element;
      reduce_into(piece, sources, size, len, dtype, op, scale);
    });
    // 3. Post that I am done reading the peers' buffers.
    peers.post();
  });
}

}  // namespace ddp::detail::shm::algorithm
