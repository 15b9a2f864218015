#pragma once
// The caller's data as the shared-memory collectives see it: pieces of memory taken as one array
// (a DDP bucket's gradients where they are), and the walk over a range of that array.
#include <algorithm>
#include <cstddef>
#include <vector>

namespace ddp::detail::shm {

// `count` elements of the collective's dtype at `data`.
struct Span {
  void* data;
  std::size_t count;
};

// A part of a buffer: `bytes` bytes from byte `offset` (an all-to-all's piece for, or from, one rank).
struct Piece {
  std::size_t offset;
  std::size_t bytes;
};

// Calls part(pointer, at, n) for each piece of elements [first, first + count) of the spans taken
// as one array, in order: `pointer` is the piece's first byte, `at` its index counted from `first`.
template <typename Part>
inline void for_each_piece(const std::vector<Span>& spans, std::size_t element, std::size_t first, std::size_t count,
                           Part&& part) {
  const std::size_t last = first + count;
  std::size_t begin = 0;  // the current span's first element in the whole array
  for (const Span& span : spans) {
    const std::size_t end = begin + span.count;
    if (span.count > 0 && end > first && begin < last) {
      const std::size_t from = std::max(begin, first), to = std::min(end, last);
      part(static_cast<unsigned char*>(span.data) + (from - begin) * element, from - first, to - from);
    }
    if (end >= last) return;
    begin = end;
  }
}

}  // namespace ddp::detail::shm
