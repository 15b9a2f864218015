// Reduce-scatter through the shared segments (communicator.h): the first half of the sliced
// allreduce on its own - every rank publishes what each peer reduces, then reduces its own piece
// from every rank's contribution, in rank order. Each rank writes only the peers' pieces into
// shared memory (its own is read where it is), and reads only its own piece back: about half the
// memory traffic of an allreduce of the whole input.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "communicator.h"
#include "steps.h"

namespace ddp::detail::shm {
namespace {

// Which of `owner`'s W - 1 staging slots holds what `reader` reduces (owner keeps no slot for itself).
std::size_t slot(int owner, int reader) { return static_cast<std::size_t>(reader < owner ? reader : reader - 1); }

}  // namespace

// Bytes per slot: a buffer holds W - 1 of them, each a whole number of elements and, where there
// is room, of cache lines (whole vectors for the reduction). 0 when not even one element fits.
std::size_t Communicator::reduce_scatter_slot_bytes(std::size_t element) const {
  const std::size_t share = options_.chunk_bytes / static_cast<std::size_t>(size_ - 1);
  return share >= 64 ? share / 64 * 64 : share / element * element;
}

void Communicator::reduce_scatter(const void* in, std::size_t count, void* out, DType dtype, Op op) {
  check_reduction("reduce_scatter", dtype, op, 1.0);
  if (error_) throw *error_;
  const std::size_t element = dtype_size(dtype);
  const auto* pieces = static_cast<const unsigned char*>(in);
  auto* result = static_cast<unsigned char*>(out);
  if (size_ == 1) {  // the reduction of one piece is itself (AVG divides by 1)
    if (count > 0 && result != pieces) std::memmove(result, pieces, count * element);
    return;
  }
  const std::size_t slot_bytes = reduce_scatter_slot_bytes(element);
  if (slot_bytes == 0) {
    throw std::invalid_argument("shm::Communicator::reduce_scatter: chunk_bytes " + std::to_string(options_.chunk_bytes) +
                                " cannot hold one " + dtype_name(dtype) + " for each of " + std::to_string(size_ - 1) +
                                " peers");
  }
  run(Descriptor::reduction(Kind::kReduceScatter, count, dtype, op, 1.0), [&] {
    // Per step, `per_step` elements of every piece: each peer's in a slot of one buffer of mine.
    const std::size_t per_step = slot_bytes / element;
    const std::size_t steps = std::max<std::size_t>(1, (count + per_step - 1) / per_step);
    const auto of_piece = [&](int q, std::size_t first) { return pieces + (q * count + first) * element; };
    for (std::size_t k = 0; k < steps; ++k) {
      const std::size_t first = k * per_step, n = std::min(per_step, count - first);
      // 1. Copy into a free buffer of mine (the other one may still be read by peers on the
      //    previous step) each peer's elements [first, first + n), one slot each; post: the peers
      //    may read them.
      const int b = acquire_buffer({"the peers to finish reading this buffer", k, steps}, true);
      for (int q = 0; q < size_ && n > 0; ++q) {
        if (q != rank_) copy_bytes(buffer(rank_, b) + slot(rank_, q) * slot_bytes, of_piece(q, first), n * element);
      }
      post();
      // 2. Once every peer's slots are in: reduce my piece's elements from all W ranks, in rank
      //    order (mine where it is), into `out` - the allreduce's bits exactly; post that I am done
      //    reading the peers' buffers.
      wait_all(posted_, {"the peers' pieces", k, steps});
      for (int q = 0; q < size_; ++q) {
        sources_[q] = q == rank_ ? of_piece(rank_, first) : buffer(q, b) + slot(q, rank_) * slot_bytes;
      }
      if (n > 0) reduce_into(result + first * element, sources_.data(), size_, n, dtype, op);
      post();
      release_buffer(b);
    }
  });
}

}  // namespace ddp::detail::shm
