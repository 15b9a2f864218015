// The allreduce of an array where it lies, in memory the ranks share (shared_array.h,
// algorithms.h): each rank waits until every part holds its data, reduces its slice from all W
// parts into its own and copies it into every peer's part, then waits until every slice is
// everywhere. No data buffers: two passes over the array per rank.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <tuple>

#include "ddp/floor/src/shm/communicator.h"
#include "ddp/floor/src/shm/slices.h"
#include "ddp/floor/src/shm/steps.h"

namespace ddp::detail::shm {
namespace {

// The slice is reduced and copied in blocks of this many bytes: a block stays in L1 between its
// reads and its write, and between its reduction and its copy.
constexpr std::size_t kSliceBlockBytes = std::size_t{16} << 10;

}  // namespace

SharedSlice::SharedSlice(const SharedArray& array, std::size_t offset, DType dtype, Op op, double scale, int rank, int size,
                         const void** sources)
    : array_(&array), offset_(offset), element_(dtype_size(dtype)), dtype_(dtype), op_(op), scale_(scale), rank_(rank),
      size_(size), sources_(sources) {}

void SharedSlice::reduce(std::size_t first, std::size_t n) {
  if (size_ == 1 && scale_ == 1.0) return;  // the reduction of one part is itself
  const std::size_t block = std::max<std::size_t>(1, kSliceBlockBytes / element_);
  for (std::size_t from = first; from < first + n; from += block) {
    for (int q = 0; q < size_; ++q) sources_[q] = at(q) + from * element_;
    reduce_into(at(rank_) + from * element_, sources_, size_, std::min(block, first + n - from), dtype_, op_, scale_);
  }
}

void SharedSlice::copy_to_peers(std::size_t first, std::size_t n) const {
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) copy_bytes(at(q) + first * element_, mine(first), n * element_);
  }
}

SharedSlice Communicator::start_shared(const SharedArray& array, std::size_t offset, std::size_t count, DType dtype, Op op,
                                       double scale, bool away) {
  check_reduction("allreduce_shared", dtype, op, scale);
  const std::size_t element = dtype_size(dtype);
  if (offset % element != 0 || offset + count * element > array.bytes() || array.rank_ != rank() ||
      array.segments_.size() != static_cast<std::size_t>(size())) {
    throw std::invalid_argument("shm::Communicator::allreduce_shared: " + std::to_string(count) + " x " + dtype_name(dtype) +
                                " at byte " + std::to_string(offset) + " is not inside this group's shared array of " +
                                std::to_string(array.bytes()) + " bytes");
  }
  peers_.throw_if_failed();
  SharedSlice slice(array, offset, dtype, op, scale, rank(), size(), peers_.sources());
  std::tie(slice.begin_, slice.end_) = part(rank(), count, dtype);
  if (size() == 1) return slice;
  Descriptor descriptor = Descriptor::reduction(Kind::kAllreduceShared, count, dtype, op, scale);
  descriptor.root = static_cast<std::int32_t>(array.id_);
  descriptor.offset = offset;
  peers_.run(descriptor, [&] {
    // 1. My part holds my data (the caller wrote it): post, so the peers may read it. Once every
    //    part is in, the slices are the caller's (SharedSlice).
    peers_.post();
    peers_.wait_all(peers_.posted(), {"the peers' data"});
    if (away) peers_.set_away(true);
  });
  return slice;
}

void Communicator::finish_shared() {
  if (size() == 1) return;
  peers_.resume([&] {
    // 3. Post that my slice is everywhere; once every peer has, my part holds the whole result.
    peers_.set_away(false);
    peers_.post();
    peers_.wait_all(peers_.posted(), {"the peers' reduced slices"});
  });
}

void Communicator::allreduce_shared(const SharedArray& array, std::size_t offset, std::size_t count, DType dtype, Op op,
                                    double scale) {
  SharedSlice slice = start_shared(array, offset, count, dtype, op, scale, false);
  // 2. Reduce my slice and copy it into every peer's part, block by block, each copied while it
  //    is still in cache. Only this rank reads or writes this slice of any part: nobody waits.
  const std::size_t block = std::max<std::size_t>(1, kSliceBlockBytes / dtype_size(dtype));
  for (std::size_t first = slice.begin(); first < slice.end(); first += block) {
    const std::size_t n = std::min(block, slice.end() - first);
    slice.reduce(first, n);
    slice.copy_to_peers(first, n);
  }
  finish_shared();
}

}  // namespace ddp::detail::shm
