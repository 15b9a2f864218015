#pragma once
// Memory every rank of a group can read and write, and the allreduce that reduces an array where
// it lies in it (Communicator::share, Communicator::allreduce_shared; shared_array.cpp,
// allreduce_shared.cpp). Torch-free.
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "ddp/floor/src/shm/reduce_kernels.h"
#include "ddp/floor/src/shm/segment.h"

namespace ddp::detail::shm {

// One array: each rank has `bytes` of its own, and every peer maps it too. Made by
// Communicator::share(); DDP's gradient buckets live in one each, so allreduce_shared() reduces
// them where they are - each rank reads its 1/W slice from every rank's memory and writes the
// result back into every rank's memory: two passes over the array per rank instead of the five of
// an allreduce through the data buffers. It lives as long as its last holder (a tensor over it may
// outlive the Communicator); nothing of it is left in /dev/shm once share() has returned.
class SharedArray {
 public:
  void* mine() const noexcept { return segments_[rank_].data(); }
  void* of(int rank) const noexcept { return segments_[rank].data(); }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  friend class Communicator;
  SharedArray() = default;
  std::vector<Segment> segments_;  // by rank
  int rank_ = 0;
  std::size_t bytes_ = 0;
  std::uint32_t id_ = 0;  // the n-th share() of the group: the same on every rank
};

// This rank's share of one allreduce_shared, between the round trip that starts it (every rank's
// part holds its data: Communicator::start_shared) and the one that ends it (every rank's slice is
// in every part: Communicator::finish_shared). In between, the rank reduces its slice of the
// range and copies it into the peers' parts, in pieces of its choosing, each piece reduced before
// it is copied - and may do more with a piece in between (hierarchical.cpp reduces it across the
// hosts). Only this rank reads or writes its slice of any part meanwhile: nobody waits for anyone.
// Element indices count from the start of the range (the offset given to start_shared).
class SharedSlice {
 public:
  // This rank's slice: elements [begin, end) of the range (Communicator::part()).
  std::size_t begin() const noexcept { return begin_; }
  std::size_t end() const noexcept { return end_; }
  // Elements [first, first + n) of this rank's part become their reduction over every rank's part,
  // in rank order, times the scale.
  void reduce(std::size_t first, std::size_t n);
  // Elements [first, first + n) of this rank's part, copied into every peer's part.
  void copy_to_peers(std::size_t first, std::size_t n) const;
  // Where element `first` lies in this rank's part.
  unsigned char* mine(std::size_t first) const noexcept { return at(rank_) + first * element_; }

 private:
  friend class Communicator;
  SharedSlice(const SharedArray& array, std::size_t offset, DType dtype, Op op, double scale, int rank, int size,
              const void** sources);
  unsigned char* at(int rank) const noexcept { return static_cast<unsigned char*>(array_->of(rank)) + offset_; }

  const SharedArray* array_;
  std::size_t offset_;
  std::size_t element_;
  DType dtype_;
  Op op_;
  double scale_;
  int rank_;
  int size_;
  const void** sources_;  // the group's scratch, one per rank
  std::size_t begin_ = 0;
  std::size_t end_ = 0;
};

}  // namespace ddp::detail::shm
