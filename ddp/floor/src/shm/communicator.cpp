// The shared-memory collectives' entry points (communicator.h): each checks its arguments,
// handles a group of one, and runs its algorithm (algorithms.h) in the group's context with the
// collective's descriptor.
#include "ddp/floor/src/shm/communicator.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "ddp/floor/src/shm/algorithms.h"
#include "ddp/floor/src/shm/slices.h"
#include "ddp/floor/src/shm/steps.h"

namespace ddp::detail::shm {

Communicator::Communicator(Rendezvous& rendezvous, const std::string& name_prefix, int rank, int size, Options options)
    : peers_(rendezvous, name_prefix, rank, size, options) {}

Communicator::~Communicator() = default;

// The reductions allreduce, allreduce_shared and reduce_scatter accept; throws
// std::invalid_argument for others.
void Communicator::check_reduction(const char* collective, DType dtype, Op op, double scale) {
  if (!supported(dtype, op)) {
    throw std::invalid_argument(std::string("shm::Communicator::") + collective + ": " + op_name(op) + " of " +
                                dtype_name(dtype) + " is not supported");
  }
  if (scale != 1.0 && !scales(dtype, op)) {
    throw std::invalid_argument(std::string("shm::Communicator::") + collective + ": " + op_name(op) + " of " +
                                dtype_name(dtype) + " cannot be scaled");
  }
}

void Communicator::allreduce(void* data, std::size_t count, DType dtype, Op op) {
  allreduce(std::vector<Span>{{data, count}}, dtype, op);
}

void Communicator::allreduce(const std::vector<Span>& spans, DType dtype, Op op, double scale) {
  check_reduction("allreduce", dtype, op, scale);
  peers_.throw_if_failed();
  std::size_t count = 0;
  for (const Span& span : spans) count += span.count;
  if (size() == 1) {  // the reduction of one array is itself (AVG divides by 1), scaled
    if (scale != 1.0) {
      for (const Span& span : spans) {
        const void* source = span.data;
        reduce_into(span.data, &source, 1, span.count, dtype, op, scale);
      }
    }
    return;
  }
  peers_.run(Descriptor::reduction(Kind::kAllreduce, count, dtype, op, scale), [&] {
    // Two ranks, or a small array: every rank reduces everything. Otherwise each reduces only its
    // slice, and copies the others' slices.
    if (size() == 2 || count * dtype_size(dtype) <= options().one_step_bytes) {
      algorithm::allreduce_direct(peers_, spans, count, dtype, op, scale);
    } else {
      algorithm::allreduce_sliced(peers_, spans, count, dtype, op, scale);
    }
  });
}

void Communicator::broadcast(void* data, std::size_t bytes, int root) {
  if (root < 0 || root >= size()) {
    throw std::invalid_argument("shm::Communicator::broadcast: root " + std::to_string(root) + " is not a rank");
  }
  peers_.throw_if_failed();
  if (size() == 1) return;
  peers_.run(Descriptor::of_bytes(Kind::kBroadcast, bytes, root), [&] { algorithm::broadcast(peers_, data, bytes, root); });
}

void Communicator::allgather(const void* in, std::size_t bytes_per_rank, void* out) {
  std::vector<void*> places(static_cast<std::size_t>(size()));
  for (int q = 0; q < size(); ++q) places[q] = static_cast<unsigned char*>(out) + q * bytes_per_rank;
  allgather(in, bytes_per_rank, places);
}

void Communicator::allgather(const void* in, std::size_t bytes_per_rank, const std::vector<void*>& places) {
  if (places.size() != static_cast<std::size_t>(size())) {
    throw std::invalid_argument("shm::Communicator::allgather: " + std::to_string(places.size()) + " places for " +
                                std::to_string(size()) + " ranks");
  }
  peers_.throw_if_failed();
  if (size() == 1) {
    if (bytes_per_rank > 0 && in != places[0]) std::memmove(places[0], in, bytes_per_rank);
    return;
  }
  peers_.run(Descriptor::of_bytes(Kind::kAllgather, bytes_per_rank),
             [&] { algorithm::allgather(peers_, in, bytes_per_rank, places.data()); });
}

void Communicator::reduce_scatter(const void* in, std::size_t count, void* out, DType dtype, Op op) {
  std::vector<const void*> pieces(static_cast<std::size_t>(size()));
  for (int q = 0; q < size(); ++q) pieces[q] = static_cast<const unsigned char*>(in) + q * count * dtype_size(dtype);
  reduce_scatter(pieces, count, out, dtype, op);
}

void Communicator::reduce_scatter(const std::vector<const void*>& pieces, std::size_t count, void* out, DType dtype,
                                  Op op) {
  check_reduction("reduce_scatter", dtype, op, 1.0);
  if (pieces.size() != static_cast<std::size_t>(size())) {
    throw std::invalid_argument("shm::Communicator::reduce_scatter: " + std::to_string(pieces.size()) + " pieces for " +
                                std::to_string(size()) + " ranks");
  }
  peers_.throw_if_failed();
  const std::size_t element = dtype_size(dtype);
  if (size() == 1) {  // the reduction of one piece is itself (AVG divides by 1)
    if (count > 0 && pieces[0] != out) std::memmove(out, pieces[0], count * element);
    return;
  }
  if (algorithm::reduce_scatter_slot_bytes(peers_, element) == 0) {
    throw std::invalid_argument("shm::Communicator::reduce_scatter: chunk_bytes " + std::to_string(options().chunk_bytes) +
                                " cannot hold one " + dtype_name(dtype) + " for each of " + std::to_string(size() - 1) +
                                " peers");
  }
  peers_.run(Descriptor::reduction(Kind::kReduceScatter, count, dtype, op, 1.0),
             [&] { algorithm::reduce_scatter(peers_, pieces.data(), count, out, dtype, op); });
}

void Communicator::all_to_all(const void* in, const std::vector<Piece>& sends, void* out,
                              const std::vector<Piece>& receives, bool own_piece) {
  const auto n = static_cast<std::size_t>(size());
  if (sends.size() != n || receives.size() != n) {
    throw std::invalid_argument("shm::Communicator::all_to_all: " + std::to_string(sends.size()) + " pieces to send and " +
                                std::to_string(receives.size()) + " to receive for " + std::to_string(n) + " ranks");
  }
  peers_.throw_if_failed();
  if (size() == 1) {
    if (sends[0].bytes != receives[0].bytes) {
      throw std::invalid_argument("shm::Communicator::all_to_all: rank 0 sends " + std::to_string(sends[0].bytes) +
                                  " bytes to itself, and expects " + std::to_string(receives[0].bytes));
    }
    if (sends[0].bytes > 0 && own_piece) {
      std::memmove(static_cast<unsigned char*>(out) + receives[0].offset, static_cast<const unsigned char*>(in) + sends[0].offset,
                   sends[0].bytes);
    }
    return;
  }
  if (algorithm::all_to_all_slot_bytes(peers_) == 0) {
    throw std::invalid_argument("shm::Communicator::all_to_all: chunk_bytes " + std::to_string(options().chunk_bytes) +
                                " cannot hold the sizes and a slot for each of " + std::to_string(size() - 1) + " peers");
  }
  peers_.run(Descriptor::of_bytes(Kind::kAllToAll, 0),
             [&] { algorithm::all_to_all(peers_, in, sends, out, receives, own_piece); });
}

void Communicator::barrier() {
  peers_.throw_if_failed();
  if (size() == 1) return;
  peers_.run(Descriptor::of_bytes(Kind::kBarrier, 0), [&] { algorithm::barrier(peers_); });
}

std::pair<std::size_t, std::size_t> Communicator::part(int rank, std::size_t count, DType dtype) const {
  return slice(rank, size(), count, dtype_size(dtype));
}

}  // namespace ddp::detail::shm
