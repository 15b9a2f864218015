// The all-gather across hosts (hierarchical.h): the ranks of each local rank exchange their pieces
// across the hosts, then each host's ranks share what they received in shared memory.
#ifndef _WIN32  // no POSIX shared memory: channel.cpp never makes one

#include <algorithm>
#include <deque>
#include <vector>

#include <ATen/ATen.h>

#include "ddp/floor/src/shm/hierarchical.h"

namespace ddp::detail::shm {
namespace {

// A slice [first, first + n) of every rank's piece, crossing the hosts into its slot (one block per
// host: the slice of my partner's piece there).
struct CrossingPieces {
  std::size_t first, n;
  unsigned char* received;
  c10::intrusive_ptr<c10d::Work> work;
};

}  // namespace

void Hierarchical::allgather(const void* in, std::size_t bytes, void* out) {
  run_across({kAllgather, static_cast<int64_t>(bytes), 0, 0}, [&] {
    const int hosts = layout_.hosts();
    // Per slot, my slice once for every host (Gloo's all-to-all sends block h to host h), then the
    // slices received. The slice in the host is shared before the slot is filled again.
    const std::size_t half = std::min(kPieceBytes, bytes) * hosts, slots = kPiecesInFlight;
    at::Tensor buffer = crossing_buffer(2 * half * slots);
    auto* gathered = static_cast<unsigned char*>(out);
    std::deque<CrossingPieces> crossing;
    const auto land_oldest = [&] {
      const CrossingPieces& oldest = crossing.front();
      land(oldest.work, "all-gather");
      // 2. Host h's block lands in the places of host h's ranks, from every local rank's slot.
      for (int h = 0; h < hosts; ++h) {
        std::vector<void*> places;
        for (int r : layout_.ranks_on_host(h)) places.push_back(gathered + r * bytes + oldest.first);
        local_->allgather(oldest.received + h * oldest.n, oldest.n, places);
      }
      crossing.pop_front();
    };
    std::size_t index = 0;
    for (std::size_t first = 0; first < bytes; first += kPieceBytes, ++index) {
      const std::size_t n = std::min(kPieceBytes, bytes - first);
      if (crossing.size() == static_cast<std::size_t>(kPiecesInFlight)) land_oldest();
      const auto offset = static_cast<int64_t>((index % slots) * 2 * half);
      unsigned char* mine = buffer.data_ptr<uint8_t>() + offset;
      for (int h = 0; h < hosts; ++h) copy_bytes(mine + h * n, static_cast<const unsigned char*>(in) + first, n);
      // 1. My slice to every host; my partners' back.
      at::Tensor sent = buffer.narrow(0, offset, static_cast<int64_t>(hosts * n));
      at::Tensor received = buffer.narrow(0, offset + static_cast<int64_t>(half), static_cast<int64_t>(hosts * n));
      crossing.push_back({first, n, mine + half, exchange(received, sent)});
    }
    while (!crossing.empty()) land_oldest();
  });
}

}  // namespace ddp::detail::shm

#endif  // _WIN32
