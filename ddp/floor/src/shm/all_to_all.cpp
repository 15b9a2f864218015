// All-to-all through the shared segments (algorithms.h): each rank stages a part of its piece for
// every peer in that peer's slot of its buffer; then each copies its parts out of every peer's
// buffer. The first round carries every rank's sizes too (a header in front of the slots), so that
// every rank knows all of them: each checks that every piece has the size its receiver expects
// (naming the same first mismatch on every rank), and all agree on how many rounds the largest
// piece takes.
#include <algorithm>
#include <cstdint>
#include <string>

#include "ddp/floor/src/shm/algorithms.h"
#include "ddp/floor/src/shm/steps.h"

namespace ddp::detail::shm::algorithm {
namespace {

// The header: the bytes each rank sends to every rank, then those it expects from every rank.
std::size_t all_to_all_header_bytes(int size) { return (2 * static_cast<std::size_t>(size) * sizeof(std::uint64_t) + 63) / 64 * 64; }

// Where `owner`'s part for rank `to` lies in its data buffer `buffer`.
unsigned char* all_to_all_slot(Peers& peers, int owner, int to, int buffer, std::size_t slot) {
  const int index = to < owner ? to : to - 1;
  return peers.buffer(owner, buffer) + all_to_all_header_bytes(peers.size()) + static_cast<std::size_t>(index) * slot;
}

// Bytes [first, first + slot) of each of this rank's pieces for the peers (what of them there is)
// into their slots.
void stage_pieces(Peers& peers, const unsigned char* in, const std::vector<Piece>& sends, std::size_t first,
                  std::size_t slot, int buffer) {
  for (int q = 0; q < peers.size(); ++q) {
    if (q == peers.rank() || first >= sends[q].bytes) continue;
    copy_bytes(all_to_all_slot(peers, peers.rank(), q, buffer, slot), in + sends[q].offset + first,
               std::min(slot, sends[q].bytes - first));
  }
}

// `n` bytes of a piece of `piece_bytes` into the caller's output: streamed past the cache
// (stream_bytes) for a large piece - written once, read later, it would only evict what comes
// next - and copied plainly for one that fits in cache (its reader finds it there).
constexpr std::size_t kStreamPieceBytes = std::size_t{1} << 20;
void copy_to_output(unsigned char* dst, const unsigned char* src, std::size_t n, std::size_t piece_bytes) {
  if (piece_bytes < kStreamPieceBytes) return copy_bytes(dst, src, n);
  stream_bytes(dst, src, n);
}

// The same bytes of each peer's piece for this rank, out of the peer's slot into their place.
void collect_pieces(Peers& peers, unsigned char* out, const std::vector<Piece>& receives, std::size_t first,
                    std::size_t slot, int buffer) {
  for (int p = 0; p < peers.size(); ++p) {
    if (p == peers.rank() || first >= receives[p].bytes) continue;
    copy_to_output(out + receives[p].offset + first, all_to_all_slot(peers, p, peers.rank(), buffer, slot),
                   std::min(slot, receives[p].bytes - first), receives[p].bytes);
  }
}

// Every rank's header, read from its buffer: throws PeerError at the first piece (in rank order of
// sender, then receiver: the same on every rank; a rank's piece for itself too) whose size its
// receiver does not expect. Returns
// the largest piece between two ranks.
std::size_t check_sizes(Peers& peers, int buffer) {
  const int size = peers.size();
  std::size_t largest = 0;
  for (int from = 0; from < size; ++from) {
    const auto* sender = reinterpret_cast<const std::uint64_t*>(peers.buffer(from, buffer));
    for (int to = 0; to < size; ++to) {
      const std::uint64_t sent = sender[to];
      const std::uint64_t expected = reinterpret_cast<const std::uint64_t*>(peers.buffer(to, buffer))[size + from];
      if (sent != expected) {
        throw PeerError(from == peers.rank() ? to : from,
                        "all_to_all: " + peers.name(from) + " sends " + std::to_string(sent) + " bytes to " + peers.name(to) +
                            ", which expects " + std::to_string(expected) + " bytes from it");
      }
      if (from != to) largest = std::max<std::size_t>(largest, sent);
    }
  }
  return largest;
}

// Bytes [first, first + n) of this rank's piece for itself into their place (as much of them as
// both sides of the piece hold: before the sizes are checked, a wrong one must not write past
// its place).
void copy_own_piece(int rank, const unsigned char* in, const std::vector<Piece>& sends, unsigned char* out,
                    const std::vector<Piece>& receives, std::size_t first, std::size_t n) {
  if (rank < 0) return;  // the caller copies it
  const std::size_t bytes = std::min(sends[rank].bytes, receives[rank].bytes);
  if (first >= bytes) return;
  copy_to_output(out + receives[rank].offset + first, in + sends[rank].offset + first, std::min(n, bytes - first), bytes);
}

}  // namespace

std::size_t all_to_all_slot_bytes(const Peers& peers) {
  const std::size_t header = all_to_all_header_bytes(peers.size()), chunk = peers.options().chunk_bytes;
  if (chunk <= header) return 0;
  return (chunk - header) / static_cast<std::size_t>(peers.size() - 1) / 64 * 64;
}

void all_to_all(Peers& peers, const void* in, const std::vector<Piece>& sends, void* out, const std::vector<Piece>& receives,
                bool own_piece) {
  const int rank = peers.rank(), size = peers.size();
  const int own = own_piece ? rank : -1;  // the rank whose piece for itself this call copies (-1: none)
  const auto* source = static_cast<const unsigned char*>(in);
  auto* target = static_cast<unsigned char*>(out);
  const std::size_t slot = all_to_all_slot_bytes(peers);
  std::size_t largest = 0;
  // Round 1: my sizes and the first slot of each piece.
  peers.for_each_chunk(1, 1, true, [&](const Chunk& chunk) {
    auto* header = reinterpret_cast<std::uint64_t*>(peers.buffer(rank, chunk.buffer));
    for (int q = 0; q < size; ++q) {
      header[q] = sends[q].bytes;
      header[size + q] = receives[q].bytes;
    }
    stage_pieces(peers, source, sends, 0, slot, chunk.buffer);
    peers.post();
    // While the peers stage theirs: the same bytes of my piece for myself.
    copy_own_piece(own, source, sends, target, receives, 0, slot);
    // Once every peer's header and slots are in: check the sizes, copy my parts out; post that I
    // am done reading the peers' buffers.
    peers.wait_all(peers.posted(), chunk.waiting_for("the peers' pieces"));
    largest = check_sizes(peers, chunk.buffer);
    collect_pieces(peers, target, receives, 0, slot, chunk.buffer);
    peers.post();
  });
  // The rest, a slot of every piece per round, as many rounds on every rank (the sizes are known).
  if (largest > slot) {
    peers.for_each_chunk(largest - slot, slot, true, [&](const Chunk& chunk) {
      const std::size_t first = slot + chunk.first;
      stage_pieces(peers, source, sends, first, slot, chunk.buffer);
      peers.post();
      copy_own_piece(own, source, sends, target, receives, first, slot);
      peers.wait_all(peers.posted(), chunk.waiting_for("the peers' pieces"));
      collect_pieces(peers, target, receives, first, slot, chunk.buffer);
      peers.post();
    });
  }
  // My piece for myself beyond the rounds (when it is larger than every piece between two ranks).
  const std::size_t rounds_cover = std::max(largest, slot);
  if (own_piece) copy_own_piece(own, source, sends, target, receives, rounds_cover, sends[rank].bytes);
}

}  // namespace ddp::detail::shm::algorithm
