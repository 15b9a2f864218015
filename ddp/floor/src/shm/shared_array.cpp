// Memory the ranks share (shared_array.h): every rank creates its part and maps every peer's,
// agreeing after each step (peers.h: agree) through an allgather of the ranks' verdicts.
#include <sys/mman.h>

#include <algorithm>
#include <cstring>

#include "ddp/floor/src/shm/communicator.h"

namespace ddp::detail::shm {

// Every rank asks for the same size (DDP's buckets, say, differ between ranks that disagree on
// them); ShmUnavailable on every rank alike when they do not.
void Communicator::check_same_size(std::size_t bytes) {
  std::vector<std::uint64_t> sizes(size());
  const std::uint64_t asked = bytes;
  allgather(&asked, sizeof asked, sizes.data());
  for (int r = 0; r < size(); ++r) {
    if (sizes[r] != sizes[0]) {
      throw ShmUnavailable(peers_.name(0) + " asks for shared memory for an array of " + std::to_string(sizes[0]) + " bytes, " +
                           peers_.name(r) + " for one of " + std::to_string(sizes[r]));
    }
  }
}

std::shared_ptr<SharedArray> Communicator::share(std::size_t bytes) {
  peers_.throw_if_failed();
  std::shared_ptr<SharedArray> array(new SharedArray);
  array->rank_ = rank();
  array->bytes_ = bytes;
  array->id_ = ++arrays_shared_;
  array->segments_.resize(size());
  check_same_size(bytes);
  const auto name_of = [&](int r) { return peers_.prefix() + "-a" + std::to_string(array->id_) + "-" + std::to_string(r); };
  const std::size_t segment_bytes = std::max<std::size_t>(bytes, 64);
  // Each rank's verdict on a step, gathered: empty when it went well, else why not (cut short).
  constexpr std::size_t kVerdictBytes = 256;
  std::vector<char> verdicts(static_cast<std::size_t>(size()) * kVerdictBytes);
  const auto tell = [&](const std::string& mine) {
    char verdict[kVerdictBytes] = {};
    mine.copy(verdict, kVerdictBytes - 1);
    allgather(verdict, kVerdictBytes, verdicts.data());
  };
  const auto hear = [&](int r) {
    const char* theirs = verdicts.data() + static_cast<std::size_t>(r) * kVerdictBytes;
    return std::string(theirs, strnlen(theirs, kVerdictBytes));
  };
  const auto blame = [&](const char* failed_to) {
    return [&, failed_to](int r, const std::string& why) {
      return peers_.name(r) + " could not " + failed_to + " shared memory for an array of " + std::to_string(bytes) +
             " bytes: " + why;
    };
  };
  try {
    // 1. Create my part (zeroed, its pages allocated now); learn whether every rank could.
    agree(rank(), size(), verdict_of([&] { array->segments_[rank()] = Segment::create(name_of(rank()), segment_bytes); }),
          tell, hear, blame("create"));
    // 2. Map every peer's part; learn whether every rank could. Then nobody needs a name any more.
    const std::string mapping = verdict_of([&] {
      for (int p = 0; p < size(); ++p) {
        if (p != rank()) array->segments_[p] = Segment::open(name_of(p), segment_bytes);
      }
    });
    agree(rank(), size(), mapping, tell, hear, blame("map"));
    array->segments_[rank()].unlink();
  } catch (const PeerError&) {
    // A peer failed inside the agreement (it died, say): it may not remove its own name any more.
    for (int p = 0; p < size(); ++p) ::shm_unlink(name_of(p).c_str());
    throw;
  }
  // On ShmUnavailable the segments go with `array`, each rank's name with its creator.
  return array;
}

}  // namespace ddp::detail::shm
