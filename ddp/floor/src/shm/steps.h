#pragma once
// What the algorithms' files share (peers.h holds the context; algorithms.h lists the
// algorithms): the kinds of collective, the descriptor every rank publishes for the desync check,
// where a wait is (for error messages), a chunk of a collective's data, and the templates through
// which every collective runs. Internal to the core.
#include <algorithm>
#include <cstdint>

#include "ddp/floor/src/shm/peers.h"
#include "ddp/floor/src/shm/reduce_kernels.h"

namespace ddp::detail::shm {

enum class Kind : std::uint32_t {
  kAllreduce = 1, kBroadcast, kAllgather, kBarrier, kAllreduceShared, kReduceScatter, kAllToAll
};

// A collective as one rank sees it; compared across ranks (the desync check).
struct Descriptor {
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
  // broadcast's, allgather's and barrier's.
  static Descriptor of_bytes(Kind kind, std::uint64_t bytes, std::int32_t root = -1) {
    Descriptor descriptor;
    descriptor.kind = kind;
    descriptor.count = bytes;
    descriptor.root = root;
    return descriptor;
  }

  bool operator==(const Descriptor& other) const {
    return sequence == other.sequence && kind == other.kind && count == other.count && dtype == other.dtype && op == other.op &&
           root == other.root && offset == other.offset && scale == other.scale;
  }
};

// Where a wait is, for error messages.
struct Step {
  const char* waiting_for;
  std::size_t chunk = 0;
  std::size_t chunks = 1;
};

// The part of a collective's data one round of steps moves: elements (or bytes) [first, first + n)
// of the whole, the index-th of `chunks`, staged in data buffer `buffer` of every rank.
struct Chunk {
  std::size_t index;
  std::size_t chunks;
  std::size_t first;
  std::size_t n;
  int buffer;

  Step waiting_for(const char* what) const { return {what, index, chunks}; }
};

template <typename Body>
void Peers::run(const Descriptor& descriptor, Body&& body) {
  resume([&] {
    begin(descriptor);
    body();
  });
}

template <typename Body>
void Peers::resume(Body&& body) {
  throw_if_failed();
  try {
    body();
  } catch (const std::exception& e) {
    throw fail_with(e);
  }
}

// `total` units (elements or bytes) in chunks of `per_chunk`: at least one chunk, an empty one
// for no data, so that every rank posts and the desync check runs. Each chunk goes into the next
// data buffer of the two. A buffer is written again only after every peer has posted its last step
// on the previous contents (`writes`: this rank writes its buffer this time), which with two
// buffers lets a fast rank copy chunk k + 1 in while others still work on chunk k; body(chunk)
// ends with this rank's last post on the buffer.
template <typename Body>
void Peers::for_each_chunk(std::size_t total, std::size_t per_chunk, bool writes, Body&& body) {
  const std::size_t chunks = std::max<std::size_t>(1, (total + per_chunk - 1) / per_chunk);
  for (std::size_t k = 0; k < chunks; ++k) {
    const std::size_t first = k * per_chunk;
    const int buffer = acquire_buffer({"the peers to finish reading this buffer", k, chunks}, writes);
    body(Chunk{k, chunks, first, std::min(per_chunk, total - first), buffer});
    release_buffer(buffer);
  }
}

}  // namespace ddp::detail::shm
