// The shared-memory all-to-all (all_to_all.cpp) at W = 2, 3, 4: equal and uneven pieces, sizes
// around the staging slots (64 KiB chunks here) and past 1 MiB at odd offsets, every byte compared with the piece its sender
// wrote (a function of sender, receiver and position, computed here); pieces of sizes the
// receivers do not expect, and a rank in another collective, named on every rank.
#include "ddp/floor/src/shm/test_support.h"

namespace {

using namespace shm_test;

unsigned char piece_byte(int from, int to, std::size_t i) {
  return static_cast<unsigned char>(random_bits(77, from, static_cast<std::size_t>(to) * 1000003 + i));
}

using PieceSizes = std::function<std::size_t(int from, int to)>;

// Rank `rank`'s all-to-all with the pieces `bytes` gives: "" when every byte is where it belongs.
std::string exchange(shm::Communicator& comm, const PieceSizes& bytes) {
  const int rank = comm.rank(), world = comm.size();
  std::vector<shm::Piece> sends, receives;
  std::size_t in_bytes = 0, out_bytes = 0;
  for (int q = 0; q < world; ++q) {
    sends.push_back({in_bytes, bytes(rank, q)});
    in_bytes += bytes(rank, q);
    receives.push_back({out_bytes, bytes(q, rank)});
    out_bytes += bytes(q, rank);
  }
  std::vector<unsigned char> in(in_bytes), out(out_bytes, 0xee);
  for (int q = 0; q < world; ++q) {
    for (std::size_t i = 0; i < sends[q].bytes; ++i) in[sends[q].offset + i] = piece_byte(rank, q, i);
  }
  comm.all_to_all(in.data(), sends, out.data(), receives);
  for (int p = 0; p < world; ++p) {
    for (std::size_t i = 0; i < receives[p].bytes; ++i) {
      if (out[receives[p].offset + i] != piece_byte(p, rank, i)) {
        return "byte " + std::to_string(i) + " of rank " + std::to_string(p) + "'s piece differs";
      }
    }
  }
  return "";
}

TEST(AllToAll, EqualAndUnevenPiecesLandWhereTheyBelong) {
  const std::vector<PieceSizes> cases = {
      [](int, int) { return std::size_t{0}; },
      [](int, int) { return std::size_t{1}; },
      [](int, int) { return std::size_t{4096}; },
      [](int, int) { return std::size_t{21824}; },   // one slot at four ranks
      [](int, int) { return std::size_t{65472}; },   // one slot at two ranks
      [](int, int) { return std::size_t{65473}; },
      [](int from, int to) { return static_cast<std::size_t>(((from + 2 * to) % 5) * 30011 + (from == to ? 5 : 0)); },
      [](int from, int to) { return static_cast<std::size_t>(from == 0 ? 200000 + to : to); },
      // Pieces past 1 MiB (streamed into the output) at odd offsets.
      [](int from, int to) { return static_cast<std::size_t>((from + to) % 2 == 1 ? 1500001 + from : 3 + to); },
  };
  for (int world : {2, 3, 4}) {
    Scratch scratch;
    const auto outcomes = run_ranks(world, scratch, [&](int rank) -> std::string {
      FileRendezvous rendezvous(scratch.folder);
      shm::Communicator comm(rendezvous, scratch.prefix, rank, world, test_options());
      for (std::size_t c = 0; c < cases.size(); ++c) {
        const std::string failure = exchange(comm, cases[c]);
        if (!failure.empty()) return "case " + std::to_string(c) + ": " + failure;
      }
      return "";
    });
    expect_all_good(outcomes);
  }
}

// Rank 2 expects 8 bytes from rank 0, which sends 16: every rank names that pair.
TEST(AllToAll, PiecesOfSizesTheReceiverDoesNotExpectAreNamedOnEveryRank) {
  constexpr int kWorld = 3;
  Scratch scratch;
  const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    shm::Communicator comm(rendezvous, scratch.prefix, rank, kWorld, test_options());
    try {
      exchange(comm, [&](int from, int to) {
        return std::size_t{from == 0 && to == 2 && rank == 2 ? 8u : 16u};
      });
      return "mismatched pieces were exchanged";
    } catch (const shm::PeerError& error) {
      const std::string what = error.what();
      if (what.find("all_to_all: rank 0 sends 16 bytes to rank 2, which expects 8 bytes from it") == std::string::npos) {
        return "the error: " + what;
      }
    }
    return "";
  });
  expect_all_good(outcomes);
}

// A rank in all_to_all while the other is in allgather: both named, never paired.
TEST(AllToAll, ARankInAnotherCollectiveIsNamed) {
  Scratch scratch;
  const auto outcomes = run_ranks(2, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    shm::Communicator comm(rendezvous, scratch.prefix, rank, 2, test_options());
    try {
      if (rank == 0) {
        exchange(comm, [](int, int) { return std::size_t{16}; });
      } else {
        std::vector<unsigned char> in(16), out(32);
        comm.allgather(in.data(), in.size(), out.data());
      }
      return "different collectives were paired";
    } catch (const shm::PeerError& error) {
      const std::string what = error.what();
      if (what.find("rank 0 runs all_to_all #1") == std::string::npos || what.find("rank 1 runs allgather #1") == std::string::npos) {
        return "the error: " + what;
      }
    }
    return "";
  });
  expect_all_good(outcomes);
}

}  // namespace
