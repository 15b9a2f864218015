// The shared-memory core's reduce_scatter and allgather (reduce_scatter.cpp, all_gather.cpp),
// across forked processes like communicator_test.cpp: every dtype and reduction at sizes around
// the steps' boundaries against the reference computed independently, bit for bit against the
// allreduce of the same input, in place, apart (each piece in memory of its own) and not;
// mismatched collectives named on both ranks; a peer that leaves or never comes named within the
// bounds.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "ddp/floor/src/shm/communicator.h"
#include "ddp/floor/src/shm/test_support.h"

namespace {

using namespace shm_test;

// Each piece in memory of its own, allocated in reverse order: what the forms that take the pieces
// (reduce_scatter) and the places (allgather) one by one get from a hierarchical reduce-scatter.
void reduce_scatter_apart(shm::Communicator& comm, const std::vector<unsigned char>& input, std::size_t count, void* out,
                          const Format& format, shm::Op op) {
  const std::size_t bytes = count * shm::dtype_size(format.dtype);
  std::vector<std::vector<unsigned char>> own(comm.size());
  std::vector<const void*> pieces(comm.size());
  for (int q = comm.size() - 1; q >= 0; --q) {
    own[q].assign(input.begin() + q * bytes, input.begin() + (q + 1) * bytes);
    own[q].resize(std::max<std::size_t>(1, bytes));
    pieces[q] = own[q].data();
  }
  comm.reduce_scatter(pieces, count, out, format.dtype, op);
}

void allgather_apart(shm::Communicator& comm, const void* in, std::size_t bytes, unsigned char* whole) {
  std::vector<std::vector<unsigned char>> landed(comm.size(), std::vector<unsigned char>(std::max<std::size_t>(1, bytes)));
  std::vector<void*> places(comm.size());
  for (int q = 0; q < comm.size(); ++q) places[q] = landed[q].data();
  comm.allgather(in, bytes, places);
  for (int q = 0; q < comm.size(); ++q) std::memcpy(whole + q * bytes, landed[q].data(), bytes);
}

// Reduce-scatters one test input of world x `count` elements; checks this rank's piece against the
// reference and against the allreduce of the same input (the same bits), then all-gathers the
// pieces (checking every piece arrives) and reports the whole result's hash. Odd seeds reduce and
// gather in place (the output is this rank's piece of the input), seeds 2 mod 4 with every piece
// in memory of its own, the others into other memory.
std::string check_halves(shm::Communicator& comm, const Format& format, shm::Op op, std::size_t count, std::uint64_t seed,
                         double scale, std::string& hashes) {
  if (scale != 1.0) return "";  // reduce_scatter has no scale
  const int world = comm.size(), rank = comm.rank();
  const std::size_t element = shm::dtype_size(format.dtype), bytes = count * element;
  std::vector<unsigned char> input(std::max<std::size_t>(1, world * bytes)), other(std::max<std::size_t>(1, bytes));
  for (std::size_t i = 0; i < world * count; ++i) make_element(format, op, seed, rank, i, input.data());
  std::vector<unsigned char> allreduced = input;
  comm.allreduce(allreduced.data(), world * count, format.dtype, op);
  const bool in_place = seed % 2 == 1, apart = seed % 4 == 2;
  unsigned char* mine = in_place ? input.data() + rank * bytes : other.data();
  if (apart) {
    reduce_scatter_apart(comm, input, count, mine, format, op);
  } else {
    comm.reduce_scatter(input.data(), count, mine, format.dtype, op);
  }

  const std::string what = std::string(shm::dtype_name(format.dtype)) + " " + shm::op_name(op) + " x " +
                           std::to_string(count) + " per rank" + (in_place ? ", in place" : "") +
                           (apart ? ", pieces apart" : "");
  std::vector<unsigned char> whole(std::max<std::size_t>(1, world * bytes));
  std::memcpy(whole.data() + rank * bytes, mine, bytes);
  std::string errors = compare_with_reference(format, op, seed, world, 1.0, whole.data(), rank * count, (rank + 1) * count);
  if (std::memcmp(mine, allreduced.data() + rank * bytes, bytes) != 0) errors += "  not the allreduce's bits\n";
  if (apart) {
    allgather_apart(comm, mine, bytes, whole.data());
  } else {
    comm.allgather(in_place ? whole.data() + rank * bytes : mine, bytes, whole.data());
  }
  if (whole != allreduced && bytes > 0) errors += "  the all-gathered pieces are not the allreduce's result\n";
  hashes += "HASH " + what + " " + std::to_string(fnv1a(whole.data(), world * bytes)) + "\n";
  return errors.empty() ? "" : what + " at " + std::to_string(world) + " ranks:\n" + errors;
}

// Per-rank sizes around a step (a buffer holds world - 1 slots, each a step of one peer's piece),
// around a whole chunk, and across several steps.
void run_halves(int world) {
  run_numerics(world, check_halves, [world](std::size_t) {
    const std::size_t w = static_cast<std::size_t>(world), chunk = test_options().chunk_bytes;
    const std::size_t slot = chunk / (w - 1) / 64 * 64;
    std::vector<std::size_t> sizes = {0, 1, w - 1, 3 * w + 1, 100003};
    for (std::size_t bytes : {slot, chunk}) {
      for (std::size_t element : {1, 2, 4, 8}) {  // the step in elements of each size
        for (std::size_t n : {bytes / element - 1, bytes / element, bytes / element + 1}) sizes.push_back(n);
      }
    }
    return sizes;
  });
}

TEST(ShmHalves, ReduceScatterAndAllgatherMatchTheReferenceAtTwoRanks) { run_halves(2); }
TEST(ShmHalves, ReduceScatterAndAllgatherMatchTheReferenceAtThreeRanks) { run_halves(3); }
TEST(ShmHalves, ReduceScatterAndAllgatherMatchTheReferenceAtFourRanks) { run_halves(4); }

// Runs `body` on two ranks; each must throw PeerError naming the other, and then the same error
// again; returns their reports ("THREW <text>").
std::vector<Outcome> both_throw(const std::function<void(shm::Communicator&, int)>& body, Scratch& scratch) {
  return run_ranks(2, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    shm::Options options = test_options();
    options.timeout = 10s;
    shm::Communicator comm(rendezvous, scratch.prefix, rank, 2, options);
    std::string first;
    try {
      body(comm, rank);
      return "did not throw";
    } catch (const shm::PeerError& e) {
      if (e.peer() != 1 - rank) return "names rank " + std::to_string(e.peer());
      first = e.what();
    }
    try {
      comm.barrier();
      return "the failed communicator worked again";
    } catch (const shm::PeerError& e) {
      if (e.what() != first) return std::string("the next call threw another error: ") + e.what();
    }
    return "THREW " + first;
  });
}

// A rank in reduce_scatter while the other is in allgather of as many bytes is named on both,
// never paired; so is a reduce_scatter with another op.
TEST(ShmHalves, MismatchedCollectivesAreNamedOnBothRanks) {
  struct Case {
    const char* name;
    std::function<void(shm::Communicator&, int)> run;
    const char* rank0_runs;
    const char* rank1_runs;
  };
  const std::vector<Case> cases = {
      {"kinds",
       [](shm::Communicator& comm, int rank) {
         std::vector<float> input(200000, 1.0f), output(100000);
         if (rank == 0) {
           comm.reduce_scatter(input.data(), output.size(), output.data(), shm::DType::kFloat32, shm::Op::kSum);
         } else {
           comm.allgather(output.data(), output.size() * sizeof(float), input.data());
         }
       },
       "reduce_scatter #1 (100000 x float32 per rank, SUM)", "allgather #1 (400000 bytes per rank)"},
      {"ops",
       [](shm::Communicator& comm, int rank) {
         std::vector<double> input(10, 1.0), output(5);
         comm.reduce_scatter(input.data(), 5, output.data(), shm::DType::kFloat64, rank == 0 ? shm::Op::kMax : shm::Op::kMin);
       },
       "reduce_scatter #1 (5 x float64 per rank, MAX)", "reduce_scatter #1 (5 x float64 per rank, MIN)"},
  };
  for (const Case& c : cases) {
    Scratch scratch;
    const auto outcomes = both_throw(c.run, scratch);
    for (int rank = 0; rank < 2; ++rank) {
      ASSERT_TRUE(outcomes[rank].finished) << c.name << " rank " << rank << ": " << outcomes[rank].exit;
      const std::string& report = outcomes[rank].report;
      EXPECT_EQ(report.rfind("THREW ", 0), 0u) << c.name << " rank " << rank << ": " << report;
      EXPECT_NE(report.find("not running the same collective"), std::string::npos) << report;
      EXPECT_NE(report.find(std::string("rank 0 runs ") + c.rank0_runs), std::string::npos) << report;
      EXPECT_NE(report.find(std::string("rank 1 runs ") + c.rank1_runs), std::string::npos) << report;
    }
    EXPECT_TRUE(leftovers(scratch.prefix).empty());
  }
}

// A peer that closes its communicator is named at once; one that never comes, at the timeout.
TEST(ShmHalves, APeerThatLeavesOrNeverComesIsNamed) {
  for (const bool closes : {true, false}) {
    Scratch scratch;
    const auto outcomes = run_ranks(2, scratch, [&](int rank) -> std::string {
      FileRendezvous rendezvous(scratch.folder);
      shm::Options options = test_options();
      options.timeout = 1500ms;
      auto comm = std::make_unique<shm::Communicator>(rendezvous, scratch.prefix, rank, 2, options);
      comm->barrier();
      if (rank == 1) {
        if (closes) comm.reset();
        std::this_thread::sleep_for(4s);  // alive, but never in the collective
        return "";
      }
      std::vector<float> input(400000, 1.0f), output(200000);
      const auto start = Clock::now();
      try {
        comm->reduce_scatter(input.data(), output.size(), output.data(), shm::DType::kFloat32, shm::Op::kSum);
        return std::string("reduce_scatter returned without rank 1");
      } catch (const shm::PeerError& e) {
        const std::string what = e.what();
        const auto waited = Clock::now() - start;
        const char* expected = closes ? "closed its communicator" : "did not arrive within 1500 ms";
        if (e.peer() != 1 || what.find(expected) == std::string::npos || what.find("reduce_scatter #2") == std::string::npos) {
          return "unexpected error: " + what;
        }
        if (closes ? waited > 1s : waited < 1400ms || waited > 3500ms) return "named after an unexpected wait: " + what;
      }
      return "";
    });
    expect_all_good(outcomes);
    EXPECT_TRUE(leftovers(scratch.prefix).empty());
  }
}

// What allreduce refuses, reduce_scatter refuses before communicating; the group stays usable.
TEST(ShmHalves, AnUnsupportedReductionIsRefusedBeforeCommunicating) {
  Scratch scratch;
  const auto outcomes = run_ranks(2, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    shm::Communicator comm(rendezvous, scratch.prefix, rank, 2, test_options());
    std::vector<std::int32_t> input = {1, 2, 3, 4}, output(2);
    try {
      comm.reduce_scatter(input.data(), 2, output.data(), shm::DType::kInt32, shm::Op::kAvg);
      return std::string("AVG of int32 was accepted");
    } catch (const std::invalid_argument& e) {
      if (std::string(e.what()) != "shm::Communicator::reduce_scatter: AVG of int32 is not supported") return std::string(e.what());
    }
    comm.reduce_scatter(input.data(), 2, output.data(), shm::DType::kInt32, shm::Op::kSum);
    const std::vector<std::int32_t> expected = rank == 0 ? std::vector<std::int32_t>{2, 4} : std::vector<std::int32_t>{6, 8};
    return output == expected ? "" : "the group did not reduce-scatter afterwards";
  });
  expect_all_good(outcomes);
}

}  // namespace
