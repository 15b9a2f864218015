// The shared-memory mailbox (mailbox.h): ranks forked as processes send each other messages of
// every size around the slots, with interleaved tags, from any source, both ways at once, and
// with peers that are killed, stopped or ask for the wrong size. Every byte received is compared
// with the pattern its sender wrote (a function of sender, receiver, tag, index and position).
#include <atomic>
#include <map>
#include <mutex>

#include "ddp/floor/src/shm/mailbox.h"
#include "ddp/floor/src/shm/test_support.h"

namespace {

using namespace shm_test;
using Mailbox = shm::Mailbox;

shm::MailboxOptions mailbox_options(std::chrono::milliseconds timeout = 30s) {
  shm::MailboxOptions options;
  options.timeout = timeout;
  options.slot_bytes = 4 << 10;  // small, so a message of a few KiB crosses several slots
  options.slots = 3;
  return options;
}

constexpr std::size_t kSlot = 4 << 10;

// Message `index` with `tag` from `from` to `to`: `bytes` bytes of a pattern of all five.
std::vector<unsigned char> message(int from, int to, int tag, int index, std::size_t bytes) {
  std::vector<unsigned char> data(bytes);
  const std::uint64_t seed = mix(static_cast<std::uint64_t>(from) * 131 + to * 17 + tag * 7919 + index);
  for (std::size_t i = 0; i < bytes; ++i) data[i] = static_cast<unsigned char>(random_bits(seed, from, i));
  return data;
}

const std::vector<std::size_t> kSizes = {0, 1, 63, kSlot - 1, kSlot, kSlot + 1, 3 * kSlot + 100, 40 * kSlot + 7};

std::string opened(const Scratch& scratch, int rank, int world, const std::function<std::string(Mailbox&)>& body,
                   std::chrono::milliseconds timeout = 30s) {
  FileRendezvous rendezvous(scratch.folder);
  Mailbox mailbox(rendezvous, scratch.prefix, rank, world, mailbox_options(timeout));
  return body(mailbox);
}

// Each rank sends every size to the next rank around the ring (asynchronously) while it receives
// every size from the previous one, blocking: each message equals its pattern.
TEST(Mailbox, EverySizeAroundTheSlotsArrivesWhole) {
  for (int world : {2, 3, 4}) {
    Scratch scratch;
    const auto outcomes = run_ranks(world, scratch, [&](int rank) {
      return opened(scratch, rank, world, [&](Mailbox& mailbox) -> std::string {
        const int next = (rank + 1) % world, previous = (rank + world - 1) % world;
        std::vector<std::vector<unsigned char>> out;
        for (std::size_t k = 0; k < kSizes.size(); ++k) out.push_back(message(rank, next, 5, static_cast<int>(k), kSizes[k]));
        std::atomic<int> sent{0};
        std::string failure;
        std::mutex failure_mutex;
        for (auto& data : out) {
          mailbox.send(data.data(), data.size(), next, 5, [&](int, std::exception_ptr error) {
            if (error) {
              std::lock_guard<std::mutex> lock(failure_mutex);
              failure = "a send failed";
            }
            ++sent;
          });
        }
        for (std::size_t k = 0; k < kSizes.size(); ++k) {
          std::vector<unsigned char> in(kSizes[k], 0xee);
          if (mailbox.recv(in.data(), in.size(), previous, 5) != previous) return "the wrong sender";
          if (in != message(previous, rank, 5, static_cast<int>(k), kSizes[k])) return "message " + std::to_string(k) + " differs";
        }
        while (sent.load() < static_cast<int>(out.size())) std::this_thread::sleep_for(1ms);
        return failure;
      });
    });
    expect_all_good(outcomes);
    EXPECT_TRUE(leftovers(scratch.prefix).empty());
  }
}

// Rank 0 sends three messages on each of six tags, interleaved; rank 1 receives the tags in the
// reverse order: every tag's messages arrive in the order sent, whatever waits in between.
TEST(Mailbox, ManyTagsInterleavedKeepTheirOrder) {
  Scratch scratch;
  const auto outcomes = run_ranks(2, scratch, [&](int rank) {
    return opened(scratch, rank, 2, [&](Mailbox& mailbox) -> std::string {
      constexpr int kTags = 6, kEach = 3;
      const auto size_of = [](int tag, int k) { return static_cast<std::size_t>(tag * 1500 + k * 700 + 1); };
      if (rank == 0) {
        for (int k = 0; k < kEach; ++k) {
          for (int tag = 0; tag < kTags; ++tag) {
            const auto data = message(0, 1, tag, k, size_of(tag, k));
            mailbox.send(data.data(), data.size(), 1, tag);
          }
        }
        return "";
      }
      for (int tag = kTags - 1; tag >= 0; --tag) {
        for (int k = 0; k < kEach; ++k) {
          std::vector<unsigned char> in(size_of(tag, k));
          mailbox.recv(in.data(), in.size(), 0, tag);
          if (in != message(0, 1, tag, k, in.size())) return "tag " + std::to_string(tag) + " message " + std::to_string(k);
        }
      }
      return "";
    });
  });
  expect_all_good(outcomes);
}

// Every message of one size: rank 0 receives from any source without knowing who comes next.
TEST(Mailbox, AnySourceAtFourRanks) {
  Scratch scratch;
  constexpr int kWorld = 4, kEach = 4;
  constexpr std::size_t kBytes = 5 * kSlot + 3;
  const auto outcomes = run_ranks(kWorld, scratch, [&](int rank) {
    return opened(scratch, rank, kWorld, [&](Mailbox& mailbox) -> std::string {
      if (rank != 0) {
        for (int k = 0; k < kEach; ++k) {
          const auto data = message(rank, 0, 2, k, kBytes);
          mailbox.send(data.data(), data.size(), 0, 2);
        }
        return "";
      }
      std::map<int, int> next;
      for (int m = 0; m < (kWorld - 1) * kEach; ++m) {
        std::vector<unsigned char> in(kBytes);
        const int from = mailbox.recv(in.data(), in.size(), Mailbox::kAnySource, 2);
        if (from < 1 || from >= kWorld) return "sender " + std::to_string(from);
        if (in != message(from, 0, 2, next[from]++, kBytes)) return "a message from rank " + std::to_string(from) + " out of order";
      }
      for (int from = 1; from < kWorld; ++from) {
        if (next[from] != kEach) return "rank " + std::to_string(from) + "'s messages: " + std::to_string(next[from]);
      }
      return "";
    });
  });
  expect_all_good(outcomes);
}

// Every rank sends a large message to every other rank first, then receives theirs: with any
// buffering of the sends' own this would wait forever; here each rank's thread takes what comes.
TEST(Mailbox, SendsFirstBothWaysDoNotDeadlock) {
  for (int world : {2, 3, 4}) {
    Scratch scratch;
    const auto outcomes = run_ranks(world, scratch, [&](int rank) {
      return opened(scratch, rank, world, [&](Mailbox& mailbox) -> std::string {
        constexpr std::size_t kBytes = 100 * kSlot + 11;
        for (int q = 0; q < world; ++q) {
          if (q == rank) continue;
          const auto data = message(rank, q, 0, 0, kBytes);
          mailbox.send(data.data(), data.size(), q, 0);  // blocking: completes once rank q's thread took it
        }
        for (int q = 0; q < world; ++q) {
          if (q == rank) continue;
          std::vector<unsigned char> in(kBytes);
          mailbox.recv(in.data(), in.size(), q, 0);
          if (in != message(q, rank, 0, 0, kBytes)) return "from rank " + std::to_string(q);
        }
        return "";
      });
    });
    expect_all_good(outcomes);
  }
}

// A receive of the wrong size names both sizes; the pair works on afterwards.
TEST(Mailbox, AReceiveOfTheWrongSizeNamesBothSizes) {
  Scratch scratch;
  const auto outcomes = run_ranks(2, scratch, [&](int rank) {
    return opened(scratch, rank, 2, [&](Mailbox& mailbox) -> std::string {
      std::vector<unsigned char> data(3 * kSlot, 7), after(10, 3);
      if (rank == 1) {
        mailbox.send(data.data(), data.size(), 0, 4);
        mailbox.send(after.data(), after.size(), 0, 4);
        return "";
      }
      std::vector<unsigned char> small(100);
      try {
        mailbox.recv(small.data(), small.size(), 1, 4);
        return "a receive of the wrong size passed";
      } catch (const std::invalid_argument& error) {
        const std::string what = error.what();
        if (what.find("12288 bytes, not 100") == std::string::npos) return "the error: " + what;
      }
      std::vector<unsigned char> in(10);
      mailbox.recv(in.data(), in.size(), 1, 4);
      return in == after ? "" : "the message after";
    });
  });
  expect_all_good(outcomes);
}

// No message within the timeout: the receive fails naming the peer; from any source, nobody.
TEST(Mailbox, AReceiveThatNothingArrivesForNamesThePeerAtTheTimeout) {
  Scratch scratch;
  const auto outcomes = run_ranks(2, scratch, [&](int rank) {
    return opened(scratch, rank, 2, [&](Mailbox& mailbox) -> std::string {
      if (rank == 1) {
        std::this_thread::sleep_for(2s);
        return "";
      }
      std::vector<unsigned char> in(8);
      try {
        mailbox.recv(in.data(), in.size(), 1, 3);
        return "a receive passed without a message";
      } catch (const shm::PeerError& error) {
        const std::string what = error.what();
        if (error.peer() != 1 || what.find("rank 1 (pid") == std::string::npos ||
            what.find("sent no message for rank 0's receive from rank 1 (tag 3, 8 bytes) within 300 ms") == std::string::npos) {
          return "the error: " + what;
        }
      }
      try {
        mailbox.recv(in.data(), in.size(), Mailbox::kAnySource, 3);
        return "a receive from any rank passed without a message";
      } catch (const shm::PeerError& error) {
        if (std::string(error.what()).find("no rank sent a message for rank 0's receive from any rank") == std::string::npos) {
          return std::string("the error: ") + error.what();
        }
      }
      return "";
    }, 300ms);
  });
  expect_all_good(outcomes);
}

// Rank 1 is killed in the middle of a send to rank 0 (whose thread is not running yet, so the
// message fills the ring and stops); rank 0's receive then names rank 1 - and at three ranks
// rank 0 and rank 2 exchange on. In the other direction, a send to a killed receiver names it.
// Nothing is left in /dev/shm.
TEST(Mailbox, APeerKilledMidSendIsNamedByRank) {
  for (int world : {2, 3}) {
    Scratch scratch;
    RunOptions options;
    options.meanwhile = [&](const std::vector<pid_t>& pids) {
      while (!file_exists(scratch.folder + "/sending")) std::this_thread::sleep_for(1ms);
      ::kill(pids[1], SIGKILL);
      write_file(scratch.folder + "/killed", "");
    };
    constexpr std::size_t kBytes = 50 * kSlot;
    const auto outcomes = run_ranks(world, scratch, [&](int rank) {
      return opened(scratch, rank, world, [&](Mailbox& mailbox) -> std::string {
        if (rank == 1) {
          const auto data = message(1, 0, 0, 0, kBytes);
          mailbox.send(data.data(), data.size(), 0, 0, [](int, std::exception_ptr) {});
          std::this_thread::sleep_for(200ms);  // the ring is full by now
          write_file(scratch.folder + "/sending", "");
          std::this_thread::sleep_for(60s);
          return "rank 1 was not killed";
        }
        while (!file_exists(scratch.folder + "/killed")) std::this_thread::sleep_for(1ms);
        if (rank == 2) {
          std::vector<unsigned char> in(kBytes);
          mailbox.recv(in.data(), in.size(), 0, 1);
          return in == message(0, 2, 1, 0, kBytes) ? "" : "rank 0's message to rank 2";
        }
        std::vector<unsigned char> in(kBytes);
        try {
          mailbox.recv(in.data(), in.size(), 1, 0);
          return "a receive from a killed rank passed";
        } catch (const shm::PeerError& error) {
          const std::string what = error.what();
          if (error.peer() != 1 || what.find("rank 1 (pid") == std::string::npos || what.find(") exited") == std::string::npos ||
              what.find("rank 0's receive from rank 1 (tag 0") == std::string::npos) {
            return "the receive's error: " + what;
          }
        }
        try {
          const auto data = message(0, 1, 0, 0, kBytes);
          mailbox.send(data.data(), data.size(), 1, 0);
          return "a send to a killed rank passed";
        } catch (const shm::PeerError& error) {
          if (error.peer() != 1 || std::string(error.what()).find(") exited") == std::string::npos) {
            return std::string("the send's error: ") + error.what();
          }
        }
        if (world == 3) {
          const auto data = message(0, 2, 1, 0, kBytes);
          mailbox.send(data.data(), data.size(), 2, 1);
        }
        return "";
      }, 20s);
    }, options);
    EXPECT_TRUE(outcomes[0].finished && outcomes[0].report.empty()) << outcomes[0].report << outcomes[0].exit;
    EXPECT_FALSE(outcomes[1].finished);
    if (world == 3) EXPECT_TRUE(outcomes[2].finished && outcomes[2].report.empty()) << outcomes[2].report;
    EXPECT_TRUE(leftovers(scratch.prefix).empty());
  }
}

// A receiver killed while a send to it waits: the send names it (its ring full, nothing taken).
TEST(Mailbox, ASendToAKilledReceiverNamesIt) {
  Scratch scratch;
  RunOptions options;
  options.meanwhile = [&](const std::vector<pid_t>& pids) {
    while (!file_exists(scratch.folder + "/ready")) std::this_thread::sleep_for(1ms);
    ::kill(pids[1], SIGKILL);
  };
  const auto outcomes = run_ranks(2, scratch, [&](int rank) {
    return opened(scratch, rank, 2, [&](Mailbox& mailbox) -> std::string {
      if (rank == 1) {
        write_file(scratch.folder + "/ready", "");
        std::this_thread::sleep_for(60s);
        return "rank 1 was not killed";
      }
      const auto data = message(0, 1, 0, 0, 50 * kSlot);
      try {
        mailbox.send(data.data(), data.size(), 1, 0);
        return "a send to a killed rank passed";
      } catch (const shm::PeerError& error) {
        const std::string what = error.what();
        if (error.peer() != 1 || what.find(") exited; rank 0's send to rank 1 (tag 0, 204800 bytes)") == std::string::npos) {
          return "the error: " + what;
        }
      }
      return "";
    }, 20s);
  }, options);
  EXPECT_TRUE(outcomes[0].finished && outcomes[0].report.empty()) << outcomes[0].report << outcomes[0].exit;
  EXPECT_TRUE(leftovers(scratch.prefix).empty());
}

}  // namespace
