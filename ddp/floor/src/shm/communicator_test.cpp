// The shared-memory collectives' core (ddp/floor/src/shm), across real processes: every test
// forks its ranks first, each builds a Communicator over a file-based rendezvous in a fresh
// temporary folder and writes a report to a file; the parent checks the reports. References are
// computed independently (in double, in rank order; the 16-bit formats decoded with ldexp), never
// with the code under test. Every wait is bounded; a child that hangs is killed and reported.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "ddp/floor/src/shm/communicator.h"
#include "ddp/floor/src/shm/reduce_kernels.h"
#include "ddp/floor/src/shm/segment.h"
#include "ddp/floor/src/shm/test_support.h"

namespace shm = ddp::detail::shm;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

using namespace shm_test;

// Allreduces one test tensor of `count` elements on this rank and checks it against the
// reference over all ranks' inputs. Returns "" or what went wrong; appends the result's hash.
// With `scattered`, the tensor is handed over as pieces in separate allocations, cut differently
// on every rank (sizes 0 to 2 chunks), and the result is the sum times `scale`.
std::string check_allreduce(shm::Communicator& comm, const Format& format, shm::Op op, std::size_t count, std::uint64_t seed,
                            std::string& hashes, bool scattered = false, double scale = 1.0) {
  const int world = comm.size();
  const std::size_t element = shm::dtype_size(format.dtype);
  std::vector<unsigned char> mine(std::max<std::size_t>(1, count * element));
  for (std::size_t i = 0; i < count; ++i) make_element(format, op, seed, comm.rank(), i, mine.data());
  if (!scattered) {
    comm.allreduce(mine.data(), count, format.dtype, op);
  } else {
    std::mt19937_64 cuts(seed * 131 + static_cast<std::uint64_t>(comm.rank()));
    const std::size_t chunk = comm.options().chunk_bytes / element;
    std::vector<std::vector<unsigned char>> pieces;
    std::vector<shm::Span> spans;
    for (std::size_t done = 0; done < count || pieces.empty();) {
      const std::size_t n = std::min<std::size_t>(count - done, cuts() % 3 == 0 ? 0 : cuts() % (2 * chunk + 1));
      pieces.emplace_back(mine.begin() + done * element, mine.begin() + (done + n) * element);
      pieces.back().reserve(1);  // a real allocation even for an empty piece
      spans.push_back({pieces.back().data(), n});
      done += n;
    }
    comm.allreduce(spans, format.dtype, op, scale);
    std::size_t done = 0;
    for (const auto& piece : pieces) {
      std::copy(piece.begin(), piece.end(), mine.begin() + done * element);
      done += piece.size() / element;
    }
  }

  const std::string errors = compare_with_reference(format, op, seed, world, scale, mine.data(), 0, count);
  const std::string what = std::string(shm::dtype_name(format.dtype)) + " " + shm::op_name(op) + " x " + std::to_string(count) +
                           (scattered ? " in pieces, scaled by " + std::to_string(scale) : "");
  hashes += "HASH " + what + " " + std::to_string(fnv1a(mine.data(), count * element)) + "\n";
  return errors.empty() ? "" : what + " at " + std::to_string(world) + " ranks:\n" + errors;
}

// ---- Single-process tests of the kernels ----------------------------------------------------------

TEST(ShmKernels, SixteenBitFormatsRoundTripEveryValue) {
  for (std::uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float half = shm::half_to_float(h), bf16 = shm::bf16_to_float(h);
    if (std::isnan(decode_half(h))) {
      ASSERT_TRUE(std::isnan(half)) << std::hex << bits;
      ASSERT_TRUE(std::isnan(shm::half_to_float(shm::float_to_half(half)))) << std::hex << bits;
    } else {
      ASSERT_EQ(static_cast<double>(half), decode_half(h)) << std::hex << bits;
      ASSERT_EQ(shm::float_to_half(half), h) << std::hex << bits;
    }
    if (std::isnan(decode_bf16(h))) {
      ASSERT_TRUE(std::isnan(bf16)) << std::hex << bits;
      ASSERT_TRUE(std::isnan(shm::bf16_to_float(shm::float_to_bf16(bf16)))) << std::hex << bits;
    } else {
      ASSERT_EQ(static_cast<double>(bf16), decode_bf16(h)) << std::hex << bits;
      ASSERT_EQ(shm::float_to_bf16(bf16), h) << std::hex << bits;
    }
  }
}

// Round to nearest, ties to even, by comparing distances to the two neighbours in double.
std::uint16_t reference_round(float x, double (*decode)(std::uint16_t), std::uint16_t toward_zero) {
  const std::uint16_t away = static_cast<std::uint16_t>(toward_zero + 1);
  const double below = std::fabs(x - decode(toward_zero)), above = std::fabs(decode(away) - x);
  if (below < above) return toward_zero;
  if (above < below) return away;
  return (toward_zero & 1) ? away : toward_zero;
}

TEST(ShmKernels, NarrowingRoundsToNearestEven) {
  std::vector<float> values = {0.0f, -0.0f, 1.0f, 65504.0f, 65519.996f, 65520.0f, 65536.0f, 1e-8f, 2.98e-8f, 5.96e-8f, 6.1e-5f,
                               std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), 3.4e38f};
  for (std::size_t i = 0; i < 200000; ++i) {
    float x;
    const auto bits = static_cast<std::uint32_t>(random_bits(7, 0, i));
    std::memcpy(&x, &bits, sizeof x);
    if (!std::isnan(x)) values.push_back(x);
  }
  for (const float x : values) {
    // bfloat16: truncation is toward zero; beyond the largest finite value it rounds to infinity.
    std::uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const auto truncated = static_cast<std::uint16_t>(bits >> 16);
    if (std::isinf(x)) {
      EXPECT_EQ(shm::float_to_bf16(x), truncated);
    } else if ((truncated & 0x7fff) == 0x7f7f) {
      EXPECT_TRUE(shm::float_to_bf16(x) == truncated || std::isinf(shm::bf16_to_float(shm::float_to_bf16(x)))) << x;
    } else {
      ASSERT_EQ(shm::float_to_bf16(x), reference_round(x, decode_bf16, truncated)) << x;
    }
    // float16: find the half at or below |x| by bisection over the ordered bit patterns.
    const double magnitude = std::fabs(static_cast<double>(x));
    const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    std::uint16_t expected;
    if (magnitude >= 65520.0) {
      expected = static_cast<std::uint16_t>(sign | 0x7c00);
    } else {
      std::uint16_t low = 0, high = 0x7bff;  // largest finite
      while (low < high) {
        const auto mid = static_cast<std::uint16_t>((low + high + 1) / 2);
        if (decode_half(mid) <= magnitude) low = mid; else high = static_cast<std::uint16_t>(mid - 1);
      }
      // Below 65520 the largest finite value is the nearest.
      expected = low == 0x7bff ? low : reference_round(static_cast<float>(magnitude), decode_half, low);
      expected = static_cast<std::uint16_t>(expected | sign);
    }
    ASSERT_EQ(shm::float_to_half(x), expected) << x;
#ifdef __FLT16_MAX__
    // The compiler's own conversion agrees.
    const _Float16 compiler = static_cast<_Float16>(x);
    std::uint16_t compiler_bits;
    std::memcpy(&compiler_bits, &compiler, sizeof compiler_bits);
    ASSERT_EQ(shm::float_to_half(x), compiler_bits) << x;
#endif
  }
  EXPECT_TRUE(std::isnan(shm::half_to_float(shm::float_to_half(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(shm::bf16_to_float(shm::float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(shm::bf16_to_float(shm::float_to_bf16(std::numeric_limits<float>::signaling_NaN()))));
}

// reduce_into may convert with vector instructions (F16C, AVX2): it must give the scalar
// functions' bits for every value.
TEST(ShmKernels, BlockConversionsMatchTheScalarOnes) {
  for (const shm::DType dtype : {shm::DType::kFloat16, shm::DType::kBFloat16}) {
    const bool half = dtype == shm::DType::kFloat16;
    std::vector<std::uint16_t> a(65536), b(65536), out(65536);
    for (std::size_t i = 0; i < a.size(); ++i) {
      a[i] = static_cast<std::uint16_t>(i);
      b[i] = static_cast<std::uint16_t>(random_bits(3, 0, i));
    }
    const void* sources[] = {a.data(), b.data()};
    shm::reduce_into(out.data(), sources, 2, a.size(), dtype, shm::Op::kSum);
    for (std::size_t i = 0; i < a.size(); ++i) {
      const float sum = half ? shm::half_to_float(a[i]) + shm::half_to_float(b[i]) : shm::bf16_to_float(a[i]) + shm::bf16_to_float(b[i]);
      const std::uint16_t expected = half ? shm::float_to_half(sum) : shm::float_to_bf16(sum);
      if (std::isnan(sum)) {
        ASSERT_TRUE(std::isnan(half ? shm::half_to_float(out[i]) : shm::bf16_to_float(out[i]))) << i;
      } else {
        ASSERT_EQ(out[i], expected) << shm::dtype_name(dtype) << " element " << i;
      }
    }
  }
}

TEST(ShmKernels, DestinationMayBeASourceAndNanPropagates) {
  std::vector<float> a(5000), b(5000), c(5000);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i);
    b[i] = 2.0f * static_cast<float>(i);
    c[i] = 1.0f;
  }
  const void* sources[] = {a.data(), b.data(), c.data()};
  shm::reduce_into(b.data(), sources, 3, b.size(), shm::DType::kFloat32, shm::Op::kSum);
  for (std::size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b[i], 3.0f * static_cast<float>(i) + 1.0f) << i;

  const float nan = std::numeric_limits<float>::quiet_NaN();
  float x[] = {1.0f, nan, 3.0f}, y[] = {nan, 2.0f, 1.0f}, out[3];
  const void* pair[] = {x, y};
  for (const shm::Op op : {shm::Op::kMax, shm::Op::kMin, shm::Op::kSum}) {
    shm::reduce_into(out, pair, 2, 3, shm::DType::kFloat32, op);
    EXPECT_TRUE(std::isnan(out[0]) && std::isnan(out[1])) << shm::op_name(op);
  }
  EXPECT_THROW(shm::reduce_into(out, pair, 2, 3, shm::DType::kInt32, shm::Op::kAvg), std::invalid_argument);
}

// Both copies move exactly the bytes asked for, whatever the alignment of either end and the size
// (the streamed one aligns its stores by copying a head first, and copies a tail of under 64 bytes
// plainly), and touch nothing around them.
TEST(ShmKernels, CopiesMoveExactlyTheirBytesAtEveryAlignment) {
  std::vector<unsigned char> source(5000), target(5000);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = static_cast<unsigned char>(i * 7 + 3);
  for (const bool streamed : {false, true}) {
    for (std::size_t from = 0; from < 40; from += 3) {
      for (std::size_t to = 0; to < 40; to += 5) {
        for (const std::size_t bytes : {0, 1, 15, 31, 63, 64, 65, 127, 200, 4000}) {
          std::fill(target.begin(), target.end(), 0xAB);
          (streamed ? shm::stream_bytes : shm::copy_bytes)(target.data() + to, source.data() + from, bytes);
          for (std::size_t i = 0; i < target.size(); ++i) {
            const bool inside = i >= to && i < to + bytes;
            ASSERT_EQ(target[i], inside ? source[from + i - to] : 0xAB)
                << (streamed ? "stream_bytes" : "copy_bytes") << " from +" << from << " to +" << to << ", " << bytes << " bytes, at " << i;
          }
        }
      }
    }
  }
}

// ---- Segments ---------------------------------------------------------------------------------

TEST(ShmSegment, ErrorsNameTheObjectAndTheReason) {
  Scratch scratch;
  const std::string name = scratch.prefix + "-x";
  shm::Segment first = shm::Segment::create(name, 4096);
  try {
    shm::Segment::create(name, 4096);
    FAIL() << "created the same name twice";
  } catch (const shm::ShmUnavailable& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::strerror(EEXIST)), std::string::npos) << e.what();
  }
  try {
    shm::Segment::open(scratch.prefix + "-missing", 4096);
    FAIL() << "opened a missing object";
  } catch (const shm::ShmUnavailable& e) {
    EXPECT_NE(std::string(e.what()).find(scratch.prefix + "-missing"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::strerror(ENOENT)), std::string::npos) << e.what();
  }
  EXPECT_THROW(shm::Segment::open(name, 8192), shm::ShmUnavailable);  // shorter than expected
  EXPECT_THROW(shm::Segment::create("no-slash", 4096), shm::ShmUnavailable);
  // A peer's object is what create() makes: this user's, 0600. Another mode, or (where this
  // process may give one away: root) another owner, is refused by name.
  const auto refused = [&](const std::string& object) {
    try {
      shm::Segment::open(object, 4096);
    } catch (const shm::ShmUnavailable& e) {
      return std::string(e.what());
    }
    return std::string("opened");
  };
  {
    shm::Segment planted = shm::Segment::create(scratch.prefix + "-planted", 4096);
    const int fd = ::shm_open(planted.name().c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fchmod(fd, 0644), 0);
    EXPECT_NE(refused(planted.name()).find(planted.name() + " has mode 0644, not 0600"), std::string::npos)
        << refused(planted.name());
    ASSERT_EQ(::fchmod(fd, 0600), 0);
    if (::fchown(fd, 4242, static_cast<gid_t>(-1)) == 0) {
      EXPECT_NE(refused(planted.name()).find(planted.name() + " belongs to uid 4242, not to this process's uid"),
                std::string::npos)
          << refused(planted.name());
    }
    ::close(fd);
  }

  // The mapping outlives the name; moving keeps the ownership; destruction removes an owned name.
  shm::Segment peer = shm::Segment::open(name, 4096);
  static_cast<char*>(first.data())[100] = 42;
  EXPECT_EQ(static_cast<char*>(peer.data())[100], 42);
  shm::Segment moved = std::move(first);
  EXPECT_TRUE(moved.owns_name());
  moved.unlink();
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
  static_cast<char*>(moved.data())[101] = 7;
  EXPECT_EQ(static_cast<char*>(peer.data())[101], 7);
  { shm::Segment temporary = shm::Segment::create(scratch.prefix + "-y", 100); }
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

// ---- Collectives across processes ------------------------------------------------------------------

// allreduce: whole tensors; scaled, as DDP hands a bucket over: in pieces where the gradients lie.
void run_allreduce_numerics(int world) {
  run_numerics(world, [](shm::Communicator& comm, const Format& format, shm::Op op, std::size_t count, std::uint64_t seed,
                         double scale, std::string& hashes) {
    return check_allreduce(comm, format, op, count, seed, hashes, scale != 1.0, scale);
  });
}

TEST(ShmCommunicator, AllreduceMatchesTheReferenceAtTwoRanks) { run_allreduce_numerics(2); }
TEST(ShmCommunicator, AllreduceMatchesTheReferenceAtThreeRanks) { run_allreduce_numerics(3); }
TEST(ShmCommunicator, AllreduceMatchesTheReferenceAtFourRanks) { run_allreduce_numerics(4); }

// The ranks' parts (part(): each one's slice in allreduce_shared) tile an array of `count`
// elements in rank order, each at a multiple of 64 bytes, none more than 1/W of it plus 128 bytes.
std::string parts_problems(const shm::Communicator& comm, std::size_t count, shm::DType dtype) {
  const std::size_t element = shm::dtype_size(dtype), world = static_cast<std::size_t>(comm.size());
  std::ostringstream errors;
  std::size_t expected_first = 0;
  for (int r = 0; r < comm.size(); ++r) {
    const auto [first, last] = comm.part(r, count, dtype);
    if (first != expected_first || last < first || (first * element) % 64 != 0 || (last - first) * element > count * element / world + 128) {
      errors << "  rank " << r << "'s part [" << first << ", " << last << ") of " << count << " does not follow on "
             << expected_first << ", does not start at a multiple of 64 bytes or holds more than 1/" << world
             << " of the array plus 128 bytes\n";
    }
    expected_first = last;
  }
  if (expected_first != count) errors << "  the parts end at " << expected_first << ", not at " << count << "\n";
  return errors.str();
}

// allreduce_shared: each test tensor written into this rank's part of one shared array (made once
// per rank process, big enough for the largest), at an offset that moves with the seed, so slices
// start anywhere. (A peer's part is not compared here: once the call returns, the peer may already
// write its next tensor there. The hashes show that every rank got the same bits.)
void run_allreduce_shared_numerics(int world) {
  run_numerics(world, [](shm::Communicator& comm, const Format& format, shm::Op op, std::size_t count, std::uint64_t seed,
                         double scale, std::string& hashes) {
    static std::shared_ptr<shm::SharedArray> array = comm.share(std::size_t{1000003} * 8 + 64 * 8);
    const std::size_t element = shm::dtype_size(format.dtype);
    const std::size_t offset = (seed % 64) * element;
    auto* mine = static_cast<unsigned char*>(array->mine()) + offset;
    for (std::size_t i = 0; i < count; ++i) make_element(format, op, seed, comm.rank(), i, mine);
    comm.allreduce_shared(*array, offset, count, format.dtype, op, scale);
    const std::string errors = parts_problems(comm, count, format.dtype) +
                               compare_with_reference(format, op, seed, comm.size(), scale, mine, 0, count);
    const std::string what = std::string(shm::dtype_name(format.dtype)) + " " + shm::op_name(op) + " x " + std::to_string(count) +
                             " shared, scaled by " + std::to_string(scale);
    hashes += "HASH " + what + " " + std::to_string(fnv1a(mine, count * element)) + "\n";
    return errors.empty() ? "" : what + " at " + std::to_string(comm.size()) + " ranks:\n" + errors;
  }, [world](std::size_t per_rank_64) {
    // No chunks here: slices (64 bytes per rank and around) and the 16 KiB blocks (4096 elements
    // of float32) matter, and one size that is none of these.
    const std::size_t w = static_cast<std::size_t>(world);
    return std::vector<std::size_t>{0, 1, w - 1, per_rank_64 - 1, per_rank_64, per_rank_64 + 1, 4096 * w - 1, 4096 * w + 1,
                                    3 * 4096 * w + 7, 100003};
  });
}

TEST(ShmCommunicator, AllreduceSharedMatchesTheReferenceAtTwoRanks) { run_allreduce_shared_numerics(2); }
TEST(ShmCommunicator, AllreduceSharedMatchesTheReferenceAtThreeRanks) { run_allreduce_shared_numerics(3); }

// allreduce_shared in steps (Communicator::start_shared), as a hierarchical allreduce runs it: the
// slice in pieces of `piece` elements, each reduced, then handed to `work(first, n)` (the step
// across the hosts), then copied to the peers. A failure in `work` is this rank's (fail_with).
void allreduce_shared_in_pieces(shm::Communicator& comm, const shm::SharedArray& array, std::size_t count, double scale,
                                std::size_t piece, const std::function<void(std::size_t, std::size_t)>& work) {
  shm::SharedSlice slice = comm.start_shared(array, 0, count, shm::DType::kFloat32, shm::Op::kSum, scale, true);
  try {
    for (std::size_t first = slice.begin(); first < slice.end(); first += piece) {
      const std::size_t n = std::min(piece, slice.end() - first);
      slice.reduce(first, n);
      work(first, n);
      slice.copy_to_peers(first, n);
    }
  } catch (const std::exception& e) {
    throw comm.fail_with(e);
  }
  comm.finish_shared();
}

// allreduce_shared in steps: each rank's slice (its part()), reduced inside the "host", goes
// through the caller's step in pieces (several per slice, the last one short) - here "another
// host" that holds the same data, so a SUM across the two doubles each piece - and lands in every
// rank's part: the result is the reference (float32 SUM scaled by 1/2, doubled across the twin
// hosts), the same bits on every rank. Then rank 1's step fails on its second piece: rank 1
// throws that error and its peers, waiting for it, fail at once with it.
TEST(ShmCommunicator, AllreduceSharedInStepsHandsTheCallerEachSliceInPieces) {
  constexpr int kWorld = 3;
  const Format& float32 = kFormats[0];
  constexpr std::size_t kPiece = (std::size_t{1} << 20) / sizeof(float);
  // Every slice 2.5 pieces and some, and slices that are not equal.
  const std::size_t count = kWorld * kPiece * 5 / 2 + 11;
  Scratch scratch;
  const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    shm::Communicator comm(rendezvous, scratch.prefix, rank, kWorld, test_options());
    const auto array = comm.share(count * sizeof(float));
    auto* mine = static_cast<float*>(array->mine());
    const auto [begin, end] = comm.part(rank, count, shm::DType::kFloat32);
    for (std::size_t i = 0; i < count; ++i) make_element(float32, shm::Op::kSum, 5, rank, i, mine);
    std::string report;
    std::size_t next = begin;
    int pieces = 0;
    allreduce_shared_in_pieces(comm, *array, count, 0.5, kPiece, [&](std::size_t first, std::size_t n) {
      if (first != next) report += "a piece does not start where the one before ended; ";
      next = first + n;
      ++pieces;
      for (std::size_t i = first; i < first + n; ++i) mine[i] *= 2;
    });
    if (next != end) report += "the pieces do not cover the slice; ";
    if (pieces < 3) report += "only " + std::to_string(pieces) + " pieces; ";
    report += compare_with_reference(float32, shm::Op::kSum, 5, kWorld, 1.0, mine, 0, count);
    report += "\nHASH " + std::to_string(fnv1a(mine, count * sizeof(float))) + "\n";

    int crossed = 0;
    try {
      allreduce_shared_in_pieces(comm, *array, count, 0.5, kPiece, [&](std::size_t, std::size_t) {
        if (rank == 1 && ++crossed == 2) throw shm::PeerError(1, "rank 1: the step across hosts failed");
      });
      report += "the failing step's allreduce_shared did not throw";
    } catch (const shm::PeerError& e) {
      if (std::string(e.what()) != "rank 1: the step across hosts failed") report += std::string("wrong error: ") + e.what();
    }
    return report;
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    ASSERT_TRUE(outcomes[rank].finished) << "rank " << rank << ": " << outcomes[rank].exit << "\n" << outcomes[rank].report;
    EXPECT_EQ(outcomes[rank].report.find("\nHASH "), 0u) << "rank " << rank << ": " << outcomes[rank].report;
    EXPECT_EQ(lines_with(outcomes[rank].report, "HASH "), lines_with(outcomes[0].report, "HASH ")) << "rank " << rank;
  }
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

// A shared array leaves nothing in /dev/shm, outlives its communicator, and a rank that passes
// another offset than its peers is a desync every rank names; a share() that cannot be served
// (larger than /dev/shm, or of different sizes) throws ShmUnavailable on every rank and leaves
// the group usable.
TEST(ShmCommunicator, SharedArraysLeaveNothingDisagreeingRanksAreNamedAndTooBigIsRefused) {
  constexpr int kWorld = 2;
  Scratch scratch;
  const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    std::string errors;
    std::shared_ptr<shm::SharedArray> array;
    {
      shm::Communicator comm(rendezvous, scratch.prefix, rank, kWorld, test_options());
      array = comm.share(4096);
      comm.barrier();  // every rank has removed its name
      if (!leftovers(scratch.prefix).empty()) errors += "after share: " + leftovers(scratch.prefix).front() + "\n";
      auto* values = static_cast<float*>(array->mine());
      for (int i = 0; i < 1024; ++i) values[i] = static_cast<float>(rank + 1);
      comm.allreduce_shared(*array, 0, 1024, shm::DType::kFloat32, shm::Op::kSum, 0.5);
      if (values[1023] != 1.5f) errors += "wrong average: " + std::to_string(values[1023]) + "\n";
      try {
        comm.share(std::size_t{1} << 50);  // a petabyte: no /dev/shm has it
        errors += "sharing a petabyte did not throw\n";
      } catch (const shm::ShmUnavailable& e) {
        if (std::string(e.what()).find("could not create shared memory for an array of 1125899906842624 bytes") ==
            std::string::npos) {
          errors += std::string("unexpected refusal: ") + e.what() + "\n";
        }
      }
      try {
        comm.share(rank == 0 ? 64 : 128);
        errors += "sharing arrays of different sizes did not throw\n";
      } catch (const shm::ShmUnavailable& e) {
        if (std::string(e.what()) != "rank 0 asks for shared memory for an array of 64 bytes, rank 1 for one of 128") {
          errors += std::string("unexpected refusal of different sizes: ") + e.what() + "\n";
        }
      }
      try {
        comm.allreduce_shared(*array, 4096 - 4, 2, shm::DType::kFloat32, shm::Op::kSum);
        errors += "an allreduce_shared past the array's end did not throw\n";
      } catch (const std::invalid_argument& e) {
        if (std::string(e.what()) != "shm::Communicator::allreduce_shared: 2 x float32 at byte 4092 is not inside this "
                                      "group's shared array of 4096 bytes") {
          errors += std::string("unexpected text for an allreduce_shared past the end: ") + e.what() + "\n";
        }
      }
      comm.barrier();  // still usable
      try {
        comm.allreduce_shared(*array, rank == 0 ? 0 : 64, 16, shm::DType::kFloat32, shm::Op::kSum);
        errors += "disagreeing offsets did not throw\n";
      } catch (const shm::PeerError& e) {
        if (std::string(e.what()).find("rank 0 runs allreduce_shared #") == std::string::npos ||
            std::string(e.what()).find("at byte 64") == std::string::npos) {
          errors += std::string("unexpected desync text: ") + e.what() + "\n";
        }
      }
    }
    if (static_cast<float*>(array->mine())[0] != 1.5f) errors += "the array did not outlive its communicator\n";
    return errors;
  });
  expect_all_good(outcomes);
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}


TEST(ShmCommunicator, BroadcastFromEveryRootAllgatherAndBarrier) {
  constexpr int kWorld = 3;
  Scratch scratch;
  const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    const shm::Options options = test_options();
    shm::Communicator comm(rendezvous, scratch.prefix, rank, kWorld, options);
    std::ostringstream errors;
    const std::size_t chunk = options.chunk_bytes;
    const std::size_t sizes[] = {0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk + 5, 1000003};
    std::uint64_t seed = 100;
    for (const std::size_t bytes : sizes) {
      for (int root = 0; root < kWorld; ++root, ++seed) {
        std::vector<unsigned char> data(bytes + 1, 0xee);
        for (std::size_t i = 0; i < bytes; ++i) data[i] = rank == root ? static_cast<unsigned char>(random_bits(seed, root, i)) : 0;
        comm.broadcast(data.data(), bytes, root);
        for (std::size_t i = 0; i < bytes; ++i) {
          if (data[i] != static_cast<unsigned char>(random_bits(seed, root, i))) {
            errors << "broadcast of " << bytes << " bytes from " << root << ": byte " << i << " differs\n";
            break;
          }
        }
        if (data[bytes] != 0xee) errors << "broadcast of " << bytes << " bytes wrote past the end\n";
      }
      for (const bool in_place : {false, true}) {
        ++seed;
        std::vector<unsigned char> piece(bytes), out(kWorld * bytes + 1, 0xee);
        for (std::size_t i = 0; i < bytes; ++i) piece[i] = static_cast<unsigned char>(random_bits(seed, rank, i));
        if (in_place) {
          std::copy(piece.begin(), piece.end(), out.begin() + static_cast<std::ptrdiff_t>(rank * bytes));
          comm.allgather(out.data() + rank * bytes, bytes, out.data());
        } else {
          comm.allgather(piece.data(), bytes, out.data());
        }
        for (int q = 0; q < kWorld; ++q) {
          for (std::size_t i = 0; i < bytes; ++i) {
            if (out[q * bytes + i] != static_cast<unsigned char>(random_bits(seed, q, i))) {
              errors << "allgather" << (in_place ? " in place" : "") << " of " << bytes << " bytes: rank " << q << "'s byte " << i << " differs\n";
              break;
            }
          }
        }
        if (out[kWorld * bytes] != 0xee) errors << "allgather of " << bytes << " bytes wrote past the end\n";
      }
    }
    // Barrier: nobody leaves before the last one arrived (ranks arrive 0, 100, 200 ms apart).
    for (int round = 0; round < 3; ++round) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100 * ((rank + round) % kWorld)));
      const std::int64_t arrived = now_ns();
      comm.barrier();
      const std::int64_t left = now_ns();
      errors << "BARRIER " << round << " " << arrived << " " << left << "\n";
    }
    return errors.str();
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    ASSERT_TRUE(outcomes[rank].finished) << "rank " << rank << ": " << outcomes[rank].exit;
    EXPECT_EQ(lines_with(outcomes[rank].report, "BARRIER").size(), 3u) << outcomes[rank].report;
    EXPECT_EQ(outcomes[rank].report.find("BARRIER"), 0u) << "rank " << rank << ":\n" << outcomes[rank].report;
  }
  for (int round = 0; round < 3; ++round) {
    std::int64_t last_arrival = 0, first_departure = std::numeric_limits<std::int64_t>::max();
    for (int rank = 0; rank < kWorld; ++rank) {
      std::istringstream line(lines_with(outcomes[rank].report, "BARRIER")[round]);
      std::string tag;
      int number;
      std::int64_t arrived, left;
      line >> tag >> number >> arrived >> left;
      last_arrival = std::max(last_arrival, arrived);
      first_departure = std::min(first_departure, left);
    }
    EXPECT_GE(first_departure, last_arrival) << "round " << round << ": a rank left the barrier before the last one arrived";
  }
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

TEST(ShmCommunicator, EightRanksOnTwoCoresStayCorrect) {
  constexpr int kWorld = 8;
  Scratch scratch;
  const auto started = Clock::now();
  const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    shm::Options options;
    options.timeout = 60s;
    options.chunk_bytes = 1 << 20;
    shm::Communicator comm(rendezvous, scratch.prefix, rank, kWorld, options);
    std::ostringstream errors;
    // Integer-valued floats: every sum is exact, so the check is exact.
    const auto value = [](int r, std::size_t i, int iteration) { return static_cast<float>((r * 31 + i * 7 + iteration) % 1001) - 500.0f; };
    for (int iteration = 0; iteration < 220; ++iteration) {
      const bool large = iteration % 40 == 39;
      const std::size_t count = large ? 1000003 : 1 + iteration % 64;
      std::vector<float> data(count);
      for (std::size_t i = 0; i < count; ++i) data[i] = value(rank, i, iteration);
      comm.allreduce(data.data(), count, shm::DType::kFloat32, shm::Op::kSum);
      for (std::size_t i = 0; i < count; ++i) {
        float expected = 0;
        for (int r = 0; r < kWorld; ++r) expected += value(r, i, iteration);
        if (data[i] != expected) {
          errors << "iteration " << iteration << " element " << i << ": " << data[i] << " != " << expected << "\n";
          break;
        }
      }
      if (iteration % 50 == 0) comm.barrier();
    }
    return errors.str();
  });
  expect_all_good(outcomes);
  std::printf("[          ] 8 ranks: %.1f s\n", std::chrono::duration<double>(Clock::now() - started).count());
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

TEST(ShmCommunicator, TwoCommunicatorsWithDifferentPrefixesAtOnce) {
  constexpr int kWorld = 3;
  Scratch scratch;
  const std::string other = scratch.prefix + "b";
  const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    shm::Communicator first(rendezvous, scratch.prefix, rank, kWorld, test_options());
    shm::Communicator second(rendezvous, other, rank, kWorld, test_options());
    std::ostringstream errors;
    for (int iteration = 0; iteration < 20; ++iteration) {
      const std::size_t count = iteration % 2 ? 100000 : 17;
      std::vector<std::int64_t> a(count, rank + 1), b(count, 10 * (rank + 1));
      first.allreduce(a.data(), count, shm::DType::kInt64, shm::Op::kSum);
      second.allreduce(b.data(), count, shm::DType::kInt64, shm::Op::kMax);
      if (a.front() != 6 || a.back() != 6) errors << "iteration " << iteration << ": the first communicator's sum is " << a.back() << "\n";
      if (b.front() != 30 || b.back() != 30) errors << "iteration " << iteration << ": the second communicator's max is " << b.back() << "\n";
    }
    return errors.str();
  });
  expect_all_good(outcomes);
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

// Desync: the ranks run different collectives. Every rank throws, naming both collectives, and
// the communicator keeps throwing the same error.
TEST(ShmCommunicator, MismatchedCollectivesThrowOnEveryRank) {
  struct Case {
    const char* name;
    std::function<void(shm::Communicator&, int)> run;
    const char* rank0_runs;
    const char* rank1_runs;
  };
  const std::vector<Case> cases = {
      {"sizes",
       [](shm::Communicator& comm, int rank) {
         std::vector<float> data(rank == 0 ? 10 : 100, 1.0f);
         comm.allreduce(data.data(), data.size(), shm::DType::kFloat32, shm::Op::kSum);
       },
       "allreduce #1 (10 x float32, SUM)", "allreduce #1 (100 x float32, SUM)"},
      {"kinds",
       [](shm::Communicator& comm, int rank) {
         std::vector<float> data(300000, 1.0f);  // several chunks on rank 1, one step on rank 0
         if (rank == 0) comm.barrier(); else comm.allreduce(data.data(), data.size(), shm::DType::kFloat32, shm::Op::kMax);
       },
       "barrier #1", "allreduce #1 (300000 x float32, MAX)"},
      {"scales",  // two ranks averaging over different numbers of ranks
       [](shm::Communicator& comm, int rank) {
         std::vector<float> data(10, 1.0f);
         comm.allreduce({{data.data(), 4}, {data.data() + 4, 6}}, shm::DType::kFloat32, shm::Op::kSum, rank == 0 ? 0.5 : 1.0);
       },
       "allreduce #1 (10 x float32, SUM x 0.5)", "allreduce #1 (10 x float32, SUM)"},
  };
  for (const Case& c : cases) {
    Scratch scratch;
    const auto outcomes = run_ranks(2, scratch, [&](int rank) -> std::string {
      FileRendezvous rendezvous(scratch.folder);
      shm::Options options = test_options();
      options.timeout = 10s;
      shm::Communicator comm(rendezvous, scratch.prefix, rank, 2, options);
      std::string first;
      try {
        c.run(comm, rank);
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

// A rank is SIGKILLed in a loop of large allreduces. Every other rank throws PeerError naming it
// within 2 s, though the timeout is 30 s, and /dev/shm holds nothing of the group.
void kill_one_rank(int world, int victim, bool reap_late) {
  Scratch scratch;
  std::int64_t killed_at = 0;
  RunOptions run;
  run.limit = 120s;
  run.meanwhile = [&](const std::vector<pid_t>& pids) {
    const auto deadline = Clock::now() + 60s;
    for (int rank = 0; rank < world; ++rank) {
      while (!file_exists(scratch.folder + "/looping-" + std::to_string(rank)) && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(random_bits(victim, world, 0) % 40));  // somewhere inside a collective
    killed_at = now_ns();
    ::kill(pids[victim], SIGKILL);
    if (!reap_late) {
      ::waitpid(pids[victim], nullptr, 0);
      return;
    }
    // Reaping late leaves a zombie until the others have reported: they must see through it
    // (kill(pid, 0) still succeeds; /proc says 'Z').
    for (int rank = 0; rank < world; ++rank) {
      if (rank == victim) continue;
      while (!file_exists(scratch.folder + "/report-" + std::to_string(rank)) && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    }
  };
  const auto outcomes = run_ranks(world, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    shm::Options options;
    options.timeout = 30s;
    options.chunk_bytes = 1 << 20;
    shm::Communicator comm(rendezvous, scratch.prefix, rank, world, options);
    std::vector<float> data(8 << 20, 1.0f);  // 33.6 MB
    for (int iteration = 0; iteration < 2000; ++iteration) {
      if (iteration == 2) write_file(scratch.folder + "/looping-" + std::to_string(rank), "");
      try {
        comm.allreduce(data.data(), data.size(), shm::DType::kFloat32, shm::Op::kAvg);
      } catch (const shm::PeerError& e) {
        return "PeerError " + std::to_string(e.peer()) + " " + std::to_string(now_ns()) + " " + e.what();
      }
    }
    return "finished the loop without an error";
  }, run);
  for (int rank = 0; rank < world; ++rank) {
    if (rank == victim) continue;
    ASSERT_TRUE(outcomes[rank].finished) << "rank " << rank << ": " << outcomes[rank].exit;
    std::istringstream report(outcomes[rank].report);
    std::string kind;
    int peer = -1;
    std::int64_t at = 0;
    report >> kind >> peer >> at;
    ASSERT_EQ(kind, "PeerError") << "rank " << rank << ": " << outcomes[rank].report;
    EXPECT_EQ(peer, victim) << outcomes[rank].report;
    EXPECT_NE(outcomes[rank].report.find("rank " + std::to_string(victim) + " (pid"), std::string::npos) << outcomes[rank].report;
    EXPECT_NE(outcomes[rank].report.find("exited"), std::string::npos) << outcomes[rank].report;
    EXPECT_LT(at - killed_at, 2'000'000'000) << "rank " << rank << " took " << (at - killed_at) / 1e6 << " ms: " << outcomes[rank].report;
    std::printf("[          ] %d ranks, rank %d killed: rank %d threw after %.0f ms: %s\n", world, victim, rank, (at - killed_at) / 1e6,
                outcomes[rank].report.substr(outcomes[rank].report.find(' ', outcomes[rank].report.find(' ', 10) + 1) + 1).c_str());
  }
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

TEST(ShmCommunicator, KilledRankIsNamedAtOnceAndLeavesNothing) {
  kill_one_rank(3, 1, false);
  kill_one_rank(3, 0, false);
  kill_one_rank(4, 3, false);
}

TEST(ShmCommunicator, KilledRankIsNamedWhileStillAZombie) { kill_one_rank(3, 2, true); }

// A rank is frozen (SIGSTOP): the others throw PeerError naming it once the timeout passes.
TEST(ShmCommunicator, FrozenRankIsNamedAfterTheTimeout) {
  constexpr int kWorld = 3, kFrozen = 1;
  constexpr auto kTimeout = 1500ms;
  Scratch scratch;
  std::int64_t stopped_at = 0;
  RunOptions run;
  run.meanwhile = [&](const std::vector<pid_t>& pids) {
    const auto deadline = Clock::now() + 60s;
    for (int rank = 0; rank < kWorld; ++rank) {
      while (!file_exists(scratch.folder + "/looping-" + std::to_string(rank)) && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    }
    stopped_at = now_ns();
    ::kill(pids[kFrozen], SIGSTOP);
    // Thaw and end it once the others have reported (bounded).
    for (int rank = 0; rank < kWorld; ++rank) {
      if (rank == kFrozen) continue;
      while (!file_exists(scratch.folder + "/report-" + std::to_string(rank)) && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    }
    ::kill(pids[kFrozen], SIGCONT);
    ::kill(pids[kFrozen], SIGKILL);
  };
  const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    shm::Options options = test_options();
    options.timeout = kTimeout;
    shm::Communicator comm(rendezvous, scratch.prefix, rank, kWorld, options);
    std::vector<float> data(1 << 20, 1.0f);
    for (int iteration = 0; iteration < 100000; ++iteration) {
      if (iteration == 2) write_file(scratch.folder + "/looping-" + std::to_string(rank), "");
      try {
        comm.allreduce(data.data(), data.size(), shm::DType::kFloat32, shm::Op::kSum);
        std::fill(data.begin(), data.end(), 1.0f);
      } catch (const shm::PeerError& e) {
        return "PeerError " + std::to_string(e.peer()) + " " + std::to_string(now_ns()) + " " + e.what();
      }
    }
    return "finished the loop without an error";
  }, run);
  for (int rank = 0; rank < kWorld; ++rank) {
    if (rank == kFrozen) continue;
    ASSERT_TRUE(outcomes[rank].finished) << "rank " << rank << ": " << outcomes[rank].exit;
    std::istringstream report(outcomes[rank].report);
    std::string kind;
    int peer = -1;
    std::int64_t at = 0;
    report >> kind >> peer >> at;
    ASSERT_EQ(kind, "PeerError") << outcomes[rank].report;
    EXPECT_EQ(peer, kFrozen) << outcomes[rank].report;
    EXPECT_NE(outcomes[rank].report.find("rank 1 (pid"), std::string::npos) << outcomes[rank].report;
    EXPECT_NE(outcomes[rank].report.find("stopped) did not arrive within 1500 ms"), std::string::npos) << outcomes[rank].report;
    EXPECT_LT(at - stopped_at, std::chrono::nanoseconds(kTimeout + 2s).count()) << outcomes[rank].report;
    std::printf("[          ] rank %d threw %.0f ms after the stop: %s\n", rank, (at - stopped_at) / 1e6, outcomes[rank].report.c_str());
  }
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

// Errors blame the rank at fault, not one that waited for it. (1) Rank 1's step across the hosts
// (between start_shared and finish_shared) holds it past the timeout and then fails naming a rank
// on the other host: its peers, which waited for rank 1, fail with that error, not "rank 1 did not
// arrive". (2) Rank 2 is stopped and rank 1 is late, running: rank 0's error blames the stopped
// rank, naming it first.
// Whether `pid` is stopped, by /proc.
bool is_stopped(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'T';
}

TEST(ShmCommunicator, ErrorsBlameTheRankAtFaultNotOneThatWaited) {
  constexpr int kWorld = 3;
  constexpr auto kTimeout = 600ms;
  Scratch scratch;
  const std::string stopped = scratch.folder + "/rank-2-stopped";
  const auto await_file = [](const std::string& path) {  // bounded
    const auto deadline = Clock::now() + 60s;
    while (!file_exists(path) && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  };
  RunOptions run;
  run.meanwhile = [&](const std::vector<pid_t>& pids) {
    // Say when rank 2 has stopped itself; thaw and end it once the others reported (bounded).
    const auto deadline = Clock::now() + 60s;
    while (!is_stopped(pids[2]) && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    write_file(stopped, "");
    for (int rank : {0, 1}) {
      while (!file_exists(scratch.folder + "/report-" + std::to_string(rank)) && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    }
    ::kill(pids[2], SIGCONT);
    ::kill(pids[2], SIGKILL);
  };
  const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    shm::Options options = test_options();
    options.timeout = kTimeout;
    std::string report;
    {
      shm::Communicator comm(rendezvous, scratch.prefix, rank, kWorld, options);
      const auto array = comm.share(std::size_t{1} << 16);
      try {
        allreduce_shared_in_pieces(comm, *array, 1 << 14, 1.0, 1 << 14, [&](std::size_t, std::size_t) {
          if (rank != 1) return;
          std::this_thread::sleep_for(kTimeout + 100ms);  // past the timeout, as a step bounded by its own
          throw shm::PeerError(1, "rank 9 (pid 99, stopped) did not arrive within 600 ms; rank 8 was in allreduce_shared #1");
        });
        report += "the held-up step's allreduce_shared did not throw; ";
      } catch (const shm::PeerError& e) {
        if (std::string(e.what()).rfind("rank 9 (pid 99, stopped) did not arrive", 0) != 0) {
          report += std::string("(1) wrong error: ") + e.what() + "; ";
        }
      }
    }
    shm::Communicator comm(rendezvous, scratch.prefix + "-2", rank, kWorld, options);
    if (rank == 2) ::raise(SIGSTOP);
    await_file(stopped);
    if (rank == 1) std::this_thread::sleep_for(2 * kTimeout);  // late, but running
    std::vector<float> data(64, 1.0f);
    try {
      comm.allreduce(data.data(), data.size(), shm::DType::kFloat32, shm::Op::kSum);
      report += "(2) the allreduce did not throw";
    } catch (const shm::PeerError& e) {
      const std::string what = e.what();
      if (e.peer() != 2 || what.rfind("ranks 2 (pid ", 0) != 0 || what.find(", stopped), 1 (pid ") == std::string::npos) {
        report += "(2) wrong error (peer " + std::to_string(e.peer()) + "): " + what;
      }
    }
    return report;
  }, run);
  for (int rank : {0, 1}) {
    EXPECT_TRUE(outcomes[rank].finished) << "rank " << rank << ": " << outcomes[rank].exit;
    EXPECT_EQ(outcomes[rank].report, "") << "rank " << rank;
  }
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

// An allreduce that must fail within a second with an error `expected` accepts: "" when it does.
std::string allreduce_fails_at_once(shm::Communicator& comm, std::vector<float>& data,
                                    const std::function<bool(const shm::PeerError&)>& expected) {
  const std::int64_t start = now_ns();
  try {
    comm.allreduce(data.data(), data.size(), shm::DType::kFloat32, shm::Op::kSum);
    return "did not throw";
  } catch (const shm::PeerError& e) {
    if (!expected(e)) return std::string("wrong error: ") + e.what();
    if (now_ns() - start > 1'000'000'000) return "took " + std::to_string((now_ns() - start) / 1000000) + " ms";
  }
  return "";
}

// A rank leaves (destroys its communicator, say after an exception of its own) while its process
// lives on: a peer waiting for it fails at once, naming it, not at the timeout.
TEST(ShmCommunicator, RankThatClosesItsCommunicatorIsNamedAtOnce) {
  Scratch scratch;
  const auto outcomes = run_ranks(2, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    auto comm = std::make_unique<shm::Communicator>(rendezvous, scratch.prefix, rank, 2, test_options());
    std::vector<float> data(100000, 1.0f);
    comm->allreduce(data.data(), data.size(), shm::DType::kFloat32, shm::Op::kSum);
    if (rank == 1) {
      comm.reset();
      std::this_thread::sleep_for(3s);  // alive, but gone from the group
      return "";
    }
    return allreduce_fails_at_once(*comm, data, [](const shm::PeerError& e) {
      const std::string what = e.what();
      return e.peer() == 1 && what.find("rank 1 (pid") != std::string::npos &&
             what.find("closed its communicator") != std::string::npos;
    });
  });
  expect_all_good(outcomes);
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

// A host's ranks in a hierarchical allreduce (hierarchical.h): errors name them by rank_names (their
// ranks in the whole group), and a failure outside the communicator (fail(), as when the Gloo step
// across hosts fails) stops a waiting peer at once with its text.
TEST(ShmCommunicator, ErrorsUseRankNamesAndAFailureFromOutsideStopsPeersAtOnce) {
  Scratch scratch;
  const auto outcomes = run_ranks(3, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    shm::Options options = test_options();
    options.rank_names = {4, 6, 7};
    auto comm = std::make_unique<shm::Communicator>(rendezvous, scratch.prefix, rank, 3, options);
    std::vector<float> data(100000, 1.0f);
    comm->allreduce(data.data(), data.size(), shm::DType::kFloat32, shm::Op::kSum);
    if (rank == 2) {  // gone from the group, alive: named "rank 7"
      comm.reset();
      std::this_thread::sleep_for(3s);
      return "";
    }
    if (rank == 1) {  // fails from outside while rank 0 waits for it
      std::this_thread::sleep_for(200ms);
      comm->fail(shm::PeerError(1, "rank 6: the step across hosts failed"));
      try {
        comm->barrier();
        return "barrier after fail() did not throw";
      } catch (const shm::PeerError& e) {
        if (std::string(e.what()) != "rank 6: the step across hosts failed") return std::string("wrong error: ") + e.what();
      }
      return "";
    }
    return allreduce_fails_at_once(*comm, data, [](const shm::PeerError& e) {
      // Either comes first: rank 7 closed (named by its group rank), or rank 6's own failure.
      const std::string what = e.what();
      return (what.find("rank 7 (pid") != std::string::npos && what.find("closed its communicator") != std::string::npos &&
              what.find("; rank 4 was in") != std::string::npos) ||
             what == "rank 6: the step across hosts failed";
    });
  });
  expect_all_good(outcomes);
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

TEST(ShmCommunicator, RankNamesMustNameEveryRank) {
  Scratch scratch;
  FileRendezvous rendezvous(scratch.folder);
  shm::Options options = test_options();
  options.rank_names = {4};
  try {
    shm::Communicator comm(rendezvous, scratch.prefix, 0, 2, options);
    FAIL() << "did not throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "shm::Communicator: rank_names has 1 entries for 2 ranks");
  }
}

TEST(ShmCommunicator, NothingIsLeftInDevShmAfterSetupOrDestruction) {
  constexpr int kWorld = 3;
  Scratch scratch;
  const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) -> std::string {
    FileRendezvous rendezvous(scratch.folder);
    std::string errors;
    {
      shm::Communicator comm(rendezvous, scratch.prefix, rank, kWorld, test_options());
      comm.barrier();  // everyone constructed: every name is gone while the group runs
      if (!leftovers(scratch.prefix).empty()) errors += "after setup: " + leftovers(scratch.prefix).front() + "\n";
      std::vector<double> data(50000, 1.0);
      comm.allreduce(data.data(), data.size(), shm::DType::kFloat64, shm::Op::kSum);
      if (data[49999] != 3.0) errors += "wrong sum\n";
    }
    return errors;
  });
  expect_all_good(outcomes);
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

// Setup fails halfway: every rank throws ShmUnavailable (or, where it had already finished,
// succeeds - the caller agrees on the fallback), and nothing of the group is left.
TEST(ShmCommunicator, FailedSetupThrowsShmUnavailableAndLeavesNothing) {
  constexpr int kWorld = 3;
  // 1. A stale object holds rank 1's name.
  {
    Scratch scratch;
    const std::string stale = scratch.prefix + "-1";
    const int fd = ::shm_open(stale.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0);
    ::close(fd);
    const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) -> std::string {
      FileRendezvous rendezvous(scratch.folder, 10s);
      try {
        shm::Communicator comm(rendezvous, scratch.prefix, rank, kWorld, test_options());
        return "constructed";
      } catch (const shm::ShmUnavailable& e) {
        return std::string("ShmUnavailable ") + e.what();
      }
    });
    for (int rank = 0; rank < kWorld; ++rank) {
      ASSERT_TRUE(outcomes[rank].finished) << outcomes[rank].exit;
      const std::string& report = outcomes[rank].report;
      EXPECT_EQ(report.rfind("ShmUnavailable ", 0), 0u) << report;
      EXPECT_NE(report.find(stale), std::string::npos) << report;
      EXPECT_NE(report.find(std::strerror(EEXIST)), std::string::npos) << report;
      if (rank != 1) {
        EXPECT_NE(report.find("rank 1 could not create its segment"), std::string::npos) << report;
      }
    }
    EXPECT_EQ(leftovers(scratch.prefix), std::vector<std::string>{stale.substr(1)});  // the stale one only: not ours to remove
    ::shm_unlink(stale.c_str());
  }
  // 2. Rank 2's rendezvous fails after it published that it mapped everything: it throws, the
  //    others may complete.
  // 3. Rank 2 dies (SIGKILL) right after publishing its segment, before it could remove the name:
  //    the others time out in the rendezvous and remove the name for it.
  for (const bool die : {false, true}) {
    Scratch scratch;
    class Failing : public FileRendezvous {
     public:
      Failing(const std::string& folder, int rank, bool die) : FileRendezvous(folder, 3s), rank_(rank), die_(die) {}
      void set(const std::string& key, const std::string& value) override {
        FileRendezvous::set(key, value);
        if (die_ && rank_ == 2 && key.find("/created/") != std::string::npos) ::kill(::getpid(), SIGKILL);
      }
      std::string get(const std::string& key) override {
        if (!die_ && rank_ == 2 && key.find("/mapped/") != std::string::npos) throw std::runtime_error("the store went away");
        return FileRendezvous::get(key);
      }

     private:
      int rank_;
      bool die_;
    };
    const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) -> std::string {
      Failing rendezvous(scratch.folder, rank, die);
      try {
        shm::Communicator comm(rendezvous, scratch.prefix, rank, kWorld, test_options());
        return "constructed";
      } catch (const shm::ShmUnavailable& e) {
        return std::string("ShmUnavailable ") + e.what();
      }
    });
    for (int rank = 0; rank < kWorld; ++rank) {
      if (die && rank == 2) {
        EXPECT_EQ(outcomes[rank].exit, "killed by signal 9");
        continue;
      }
      ASSERT_TRUE(outcomes[rank].finished) << outcomes[rank].exit;
      if (rank == 2 || die) {
        EXPECT_EQ(outcomes[rank].report.rfind("ShmUnavailable ", 0), 0u) << outcomes[rank].report;
        EXPECT_NE(outcomes[rank].report.find(die ? "waiting for rank 2" : "the store went away"), std::string::npos) << outcomes[rank].report;
      }
    }
    EXPECT_TRUE(leftovers(scratch.prefix).empty()) << (die ? "after a death in setup" : "after a failed rendezvous");
  }
}

// A scale goes with a floating SUM only; anything else is refused before communicating, saying
// which pair. A group of one still applies it (its sum is its own data).
TEST(ShmCommunicator, OnlyAFloatingSumIsScaled) {
  Scratch scratch;
  FileRendezvous rendezvous(scratch.folder);
  shm::Communicator comm(rendezvous, scratch.prefix, 0, 1, test_options());
  std::vector<float> floats = {1.5f, -2.0f};
  std::vector<std::int32_t> ints = {3, 4};
  const auto refusal = [](const std::function<void()>& call) {
    try {
      call();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(refusal([&] { comm.allreduce({{floats.data(), 2}}, shm::DType::kFloat32, shm::Op::kMax, 0.5); }),
            "shm::Communicator::allreduce: MAX of float32 cannot be scaled");
  EXPECT_EQ(refusal([&] { comm.allreduce({{ints.data(), 2}}, shm::DType::kInt32, shm::Op::kSum, 0.5); }),
            "shm::Communicator::allreduce: SUM of int32 cannot be scaled");
  comm.allreduce({{floats.data(), 1}, {floats.data() + 1, 1}}, shm::DType::kFloat32, shm::Op::kSum, 0.5);
  EXPECT_EQ(floats, (std::vector<float>{0.75f, -1.0f}));
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

TEST(ShmCommunicator, AGroupOfOneNeedsNoSharedMemory) {
  Scratch scratch;
  FileRendezvous rendezvous(scratch.folder);
  shm::Communicator comm(rendezvous, scratch.prefix, 0, 1, test_options());
  std::vector<std::uint16_t> data = {shm::float_to_bf16(1.5f), shm::float_to_bf16(-2.0f)};
  comm.allreduce(data.data(), data.size(), shm::DType::kBFloat16, shm::Op::kAvg);
  EXPECT_EQ(shm::bf16_to_float(data[0]), 1.5f);
  int piece = 7, out = 0;
  comm.allgather(&piece, sizeof piece, &out);
  EXPECT_EQ(out, 7);
  comm.broadcast(&piece, sizeof piece, 0);
  comm.barrier();
  EXPECT_THROW(comm.allreduce(data.data(), 2, shm::DType::kInt32, shm::Op::kAvg), std::invalid_argument);
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

}  // namespace
