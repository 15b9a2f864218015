// The reduce-scatter across hosts (hierarchical.h): each host's ranks sum in shared memory what each
// sends across, then each rank reduces the hosts' sums of its own piece.
#ifndef _WIN32  // no POSIX shared memory: channel.cpp never makes one

#include <algorithm>
#include <deque>
#include <vector>

#include <ATen/ATen.h>

#include "ddp/floor/src/shm/hierarchical.h"

namespace ddp::detail::shm {
namespace {

// A slice [first, first + n) of every rank's piece, crossing the hosts: its slot holds the host's
// sums sent (one block per host) and, after them, the sums received.
struct CrossingSums {
  std::size_t first, n;
  unsigned char* received;
  c10::intrusive_ptr<c10d::Work> work;
};

}  // namespace

void Hierarchical::reduce_scatter(const void* in, std::size_t count, void* out, DType dtype, Op op) {
  run_across({kReduceScatter, static_cast<int64_t>(count), static_cast<int64_t>(dtype), static_cast<int64_t>(op)}, [&] {
    const std::size_t element = dtype_size(dtype), piece = std::max<std::size_t>(1, kPieceBytes / element);
    const int hosts = layout_.hosts();
    // AVG: summed everywhere, and scaled once at the end (floating types only: supported()).
    const Op sum_op = op == Op::kAvg ? Op::kSum : op;
    const double scale = op == Op::kAvg ? 1.0 / layout_.size() : 1.0;
    // One slot per slice crossing, and one for the slice being summed in the host meanwhile.
    const std::size_t half = std::min(piece, count) * element * hosts, slots = kPiecesInFlight + 1;
    at::Tensor buffer = crossing_buffer(2 * half * slots);
    const auto* pieces = static_cast<const unsigned char*>(in);
    std::vector<const void*> sources(hosts);
    std::deque<CrossingSums> crossing;
    const auto land_oldest = [&] {
      const CrossingSums& oldest = crossing.front();
      land(oldest.work, "reduce-scatter");
      for (int h = 0; h < hosts; ++h) sources[h] = oldest.received + h * oldest.n * element;
      reduce_into(static_cast<unsigned char*>(out) + oldest.first * element, sources.data(), hosts, oldest.n, dtype,
                  sum_op, scale);
      crossing.pop_front();
    };
    std::size_t index = 0;
    for (std::size_t first = 0; first < count; first += piece, ++index) {
      const std::size_t n = std::min(piece, count - first), bytes = n * element;
      const auto offset = static_cast<int64_t>((index % slots) * 2 * half);
      unsigned char* sums = buffer.data_ptr<uint8_t>() + offset;
      // 1. Block h: my host's sum of this slice of the piece of my partner on host h.
      for (int h = 0; h < hosts; ++h) {
        std::vector<const void*> host_pieces;
        for (int r : layout_.ranks_on_host(h)) host_pieces.push_back(pieces + (r * count + first) * element);
        local_->reduce_scatter(host_pieces, n, sums + h * bytes, dtype, sum_op);
      }
      if (crossing.size() == static_cast<std::size_t>(kPiecesInFlight)) land_oldest();
      // 2. Each block to its host; every host's sum of my slice back.
      at::Tensor sent = buffer.narrow(0, offset, static_cast<int64_t>(hosts * bytes));
      at::Tensor received = buffer.narrow(0, offset + static_cast<int64_t>(half), static_cast<int64_t>(hosts * bytes));
      crossing.push_back({first, n, sums + half, exchange(received, sent)});
    }
    while (!crossing.empty()) land_oldest();
  });
}

}  // namespace ddp::detail::shm

#endif  // _WIN32
