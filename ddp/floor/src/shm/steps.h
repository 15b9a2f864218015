#pragma once
// What the shared-memory collectives' files share (communicator.cpp holds the machinery; each
// algorithm beyond it has a file of its own: reduce_scatter.cpp, all_gather.cpp): the kinds of
// collective, the descriptor every rank publishes for the desync check, where a wait is (for error
// messages), and run(), through which every collective goes. Internal to the core.
#include <cstdint>

#include "communicator.h"

namespace ddp::detail::shm {

enum class Kind : std::uint32_t {
  kAllreduce = 1, kBroadcast, kAllgather, kBarrier, kAllreduceShared, kReduceScatter
};

// A collective as one rank sees it; compared across ranks (the desync check).
struct Communicator::Descriptor {
  std::uint32_t sequence = 0;  // collectives this rank began, this one included
  Kind kind = Kind::kBarrier;
  std::uint64_t count = 0;     // allreduce: elements; reduce_scatter: elements per rank; broadcast, allgather: bytes (per rank)
  DType dtype = DType::kUInt8;
  Op op = Op::kSum;
  std::int32_t root = -1;      // allreduce_shared: the array's id
  std::uint64_t offset = 0;    // allreduce_shared: bytes into the array
  double scale = 1.0;          // allreduce: what the sum is multiplied by

  // allreduce's, allreduce_shared's and reduce_scatter's.
  static Descriptor reduction(Kind kind, std::uint64_t count, DType dtype, Op op, double scale) {
    Descriptor descriptor;
    descriptor.kind = kind;
    descriptor.count = count;
    descriptor.dtype = dtype;
    descriptor.op = op;
    descriptor.scale = scale;
    return descriptor;
  }

  bool operator==(const Descriptor& other) const {
    return sequence == other.sequence && kind == other.kind && count == other.count && dtype == other.dtype && op == other.op &&
           root == other.root && offset == other.offset && scale == other.scale;
  }
};

// Where a wait is, for error messages.
struct Communicator::Step {
  const char* waiting_for;
  std::size_t chunk = 0;
  std::size_t chunks = 1;
};

// Every collective goes through run(): it refuses to start after a failure, and turns any
// failure inside into this rank's failure, which its peers see at once.
template <typename Body>
void Communicator::run(const Descriptor& descriptor, Body&& body) {
  if (error_) throw *error_;
  try {
    begin(descriptor);
    body();
  } catch (const PeerError& e) {
    fail(e);
    throw;
  } catch (const std::exception& e) {
    const PeerError error(rank_, name(rank_) + " failed in " + describe(current()) + ": " + e.what());
    fail(error);
    throw error;
  }
}

}  // namespace ddp::detail::shm
