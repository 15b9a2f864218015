// The heartbeat thread and the stall report (heartbeat.h says what they are for).
#include "ddp/floor/src/heartbeat.h"

#include <ddp/wait_collective.h>

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/floor/src/store_text.h"
#include "ddp/internal/diagnostics/text.h"

#ifndef _WIN32  // no /proc: a silent rank is never told apart there
#include <unistd.h>

#include "ddp/floor/src/shm/process.h"
#endif

namespace ddp::detail {

namespace {
std::atomic<int> g_collectives_waiting{0};  // collectives this process waits in right now
}  // namespace

WaitingInCollective::WaitingInCollective() { g_collectives_waiting.fetch_add(1, std::memory_order_relaxed); }
WaitingInCollective::~WaitingInCollective() { g_collectives_waiting.fetch_sub(1, std::memory_order_relaxed); }

namespace {

constexpr auto kInterval = std::chrono::seconds(1);
constexpr auto kObservation = std::chrono::milliseconds(2500);  // 2.5 beats: a running rank beats at least twice

std::string key_of(int rank) { return "torchddp/heartbeat/" + std::to_string(rank); }
// Where the rendezvous publishes a refusal (process_group.cpp, refuse(), stage "rendezvous").
constexpr const char* kRefusalKey = "ddp/rendezvous/error";

struct Beat {
  long count = 0;
  bool waiting = false;
  int pid = 0;                   // the rank's process, as seen from its pid space
  std::uint64_t start_time = 0;  // that process's start (shm/process.h)
  std::string pid_space;         // where that pid means that process (shm::pid_space(); "-": unknown)
};

// Where this process's pid means this process (shm::pid_space()); "-": nowhere we can tell.
std::string my_pid_space() {
#ifdef _WIN32
  return "-";
#else
  const std::string space = shm::pid_space();
  return space.empty() ? "-" : space;
#endif
}

// This process, as its heartbeat tells the others: "<pid> <start time> <pid space>".
std::string identity() {
#ifdef _WIN32
  return "0 0 -";
#else
  const int pid = static_cast<int>(::getpid());
  return std::to_string(pid) + " " + std::to_string(shm::read_process(pid).start_time) + " " + my_pid_space();
#endif
}

// What a rank's silence means, where its pid means its process here too: "exited", "stopped", or
// empty (alive, or nothing to tell).
std::string state_of(const Beat& beat, const std::string& my_space) {
#ifndef _WIN32
  if (beat.pid <= 0 || my_space == "-" || beat.pid_space != my_space) return "";
  const shm::ProcessInfo now = shm::read_process(beat.pid);
  if (shm::exited(now, beat.start_time)) return "exited";
  if (shm::stopped(now)) return "stopped";
#endif
  return "";
}

class Heartbeat {
 public:
  Heartbeat(std::function<c10::intrusive_ptr<c10d::Store>()> connect, int rank, int world_size)
      : rank_(rank), world_size_(world_size), thread_([this, connect = std::move(connect)] { run(connect); }) {}

  ~Heartbeat() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  std::string report() {
    c10::intrusive_ptr<c10d::Store> store;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!store_) return "Stall check: this rank's heartbeat never reached the store" + problem_suffix();
      store = store_;
    }
    try {
      const auto before = read_all(*store);
      std::this_thread::sleep_for(kObservation);
      const auto after = read_all(*store);
      return describe(before, after);
    } catch (const std::exception& error) {
      return "Stall check: the store is unreachable (" + error_text(error) +
             "); the rank hosting it (rank 0, or the launcher) may be gone";
    }
  }

 private:
  void run(const std::function<c10::intrusive_ptr<c10d::Store>()>& connect) {
    c10::intrusive_ptr<c10d::Store> store;
    try {
      store = connect();
    } catch (const std::exception& error) {
      std::lock_guard<std::mutex> lock(mutex_);
      problem_ = error_text(error);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      store_ = store;
    }
    long beat = 0;
    bool refusal_named = false;
    const std::string me = identity();
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      const std::string value = std::to_string(++beat) + " " +
                                (g_collectives_waiting.load(std::memory_order_relaxed) > 0 ? "1" : "0") + " " + me;
      lock.unlock();
      try {
        store->set(key_of(rank_), bytes_of(value));
        // A process refused at the rendezvous after this world formed (a late duplicate RANK, another
        // WORLD_SIZE) never joined, so the job goes on; it is named here once, so that a mis-started
        // launch shows where the job runs and not only in the refused process's output.
        if (!refusal_named && store->check({kRefusalKey})) {
          refusal_named = true;
          std::fprintf(stderr, "[torchddp] rank %d: a process that reached this job's store later was refused (this job "
                       "goes on): %s\n", rank_, text_of(store->get(kRefusalKey)).c_str());
        }
      } catch (const std::exception& error) {  // kept for the report; the collectives will fail on their own
        std::lock_guard<std::mutex> problem_lock(mutex_);
        problem_ = error_text(error);
      }
      lock.lock();
      wake_.wait_for(lock, kInterval, [this] { return stopping_; });
    }
  }

  std::string problem_suffix() {
    return problem_.empty() ? "" : " (" + problem_ + ")";
  }

  std::vector<std::optional<Beat>> read_all(c10d::Store& store) {
    std::vector<std::optional<Beat>> beats(world_size_);
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_ || !store.check({key_of(r)})) continue;
      const auto bytes = store.get(key_of(r));
      std::istringstream fields(text_of(bytes));
      Beat beat;
      int waiting = 0;
      if (fields >> beat.count >> waiting) {
        beat.waiting = waiting != 0;
        fields >> beat.pid >> beat.start_time >> std::ws;
        std::getline(fields, beat.pid_space);
        beats[r] = beat;
      }
    }
    return beats;
  }

  std::string describe(const std::vector<std::optional<Beat>>& before, const std::vector<std::optional<Beat>>& after) {
    std::vector<std::string> findings;
    const std::string seconds = std::to_string(kObservation.count() / 1000.0).substr(0, 3);
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      const std::string who = "rank " + std::to_string(r);
      if (!after[r]) {
        findings.push_back(who + " never sent a heartbeat");
      } else if (!before[r] || after[r]->count == before[r]->count) {
        findings.push_back(why_silent(who, seconds, *after[r]));
      } else if (!after[r]->waiting && !before[r]->waiting) {
        findings.push_back(who + " is running but in no collective (busy in its own code, or deadlocked there)");
      }
    }
    if (findings.empty()) return "Stall check: every other rank is running and inside a collective";
    return "Stall check: " + join_limited(findings, 8, "; ", [](const std::string& finding) { return finding; });
  }

  // A rank whose heartbeat did not move: exited or stopped, where its pid means its process here;
  // otherwise all that silence can mean.
  std::string why_silent(const std::string& who, const std::string& seconds, const Beat& beat) const {
    const std::string silence = " (no heartbeat for " + seconds + " s: ";
    const std::string process = "its process, pid " + std::to_string(beat.pid);
    const std::string state = state_of(beat, pid_space_);
    if (state == "exited") return who + " exited" + silence + process + ", is gone)";
    if (state == "stopped") return who + " stopped" + silence + process + ", is stopped: SIGSTOP or a debugger)";
    return who + " stopped" + silence + "its process is frozen, stopped or gone, or its host is unreachable)";
  }

  const std::string pid_space_ = my_pid_space();
  const int rank_, world_size_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string problem_;
  std::thread thread_;  // last: started once everything above exists
};

std::mutex g_mutex;
std::unique_ptr<Heartbeat> g_heartbeat;

}  // namespace

void start_heartbeat(std::function<c10::intrusive_ptr<c10d::Store>()> connect, int rank, int world_size) {
  auto heartbeat = std::make_unique<Heartbeat>(std::move(connect), rank, world_size);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_heartbeat = std::move(heartbeat);
}

void stop_heartbeat() {
  std::unique_ptr<Heartbeat> stopped;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    stopped = std::move(g_heartbeat);
  }
}

std::string stall_report() {
  std::lock_guard<std::mutex> lock(g_mutex);  // held while reporting: stop_heartbeat waits for it
  return g_heartbeat ? g_heartbeat->report() : "";
}

}  // namespace ddp::detail
