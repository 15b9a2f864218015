// All-gather through the shared segments (communicator.h): the second half of the sliced
// allreduce on its own - every rank publishes its piece, then copies every peer's piece out.
#include <algorithm>
#include <cstring>

#include "communicator.h"
#include "steps.h"

namespace ddp::detail::shm {

void Communicator::allgather(const void* in, std::size_t bytes_per_rank, void* out) {
  if (error_) throw *error_;
  auto* gathered = static_cast<unsigned char*>(out);
  const auto* piece = static_cast<const unsigned char*>(in);
  unsigned char* my_place = gathered + rank_ * bytes_per_rank;
  if (size_ == 1) {
    if (bytes_per_rank > 0 && piece != my_place) std::memmove(my_place, piece, bytes_per_rank);
    return;
  }
  Descriptor descriptor;
  descriptor.kind = Kind::kAllgather;
  descriptor.count = bytes_per_rank;
  run(descriptor, [&] {
    // A chunk of every piece per step: one buffer holds my piece's chunk, which each peer reads.
    const std::size_t chunks = std::max<std::size_t>(1, (bytes_per_rank + options_.chunk_bytes - 1) / options_.chunk_bytes);
    for (std::size_t k = 0; k < chunks; ++k) {
      const std::size_t offset = k * options_.chunk_bytes, n = std::min(options_.chunk_bytes, bytes_per_rank - offset);
      // 1. Copy my piece's chunk into a free buffer of mine (the other one may still be read by
      //    peers on the previous chunk); post: the peers may read it.
      const int b = acquire_buffer({"the peers to finish reading this buffer", k, chunks}, true);
      if (n > 0) copy_bytes(buffer(rank_, b), piece + offset, n);
      post();
      // 2. While the peers copy theirs: my piece's chunk into its place, straight from `in` (unless
      //    `in` is its place already).
      if (n > 0 && piece != my_place) std::memmove(my_place + offset, piece + offset, n);
      // 3. Once every piece is in: copy each peer's into its place; post that I am done reading the
      //    peers' buffers.
      wait_all(posted_, {"the peers' pieces", k, chunks});
      for (int q = 0; q < size_ && n > 0; ++q) {
        if (q != rank_) copy_bytes(gathered + q * bytes_per_rank + offset, buffer(q, b), n);
      }
      post();
      release_buffer(b);
    }
  });
}

}  // namespace ddp::detail::shm
