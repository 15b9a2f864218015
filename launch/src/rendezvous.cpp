#include "rendezvous.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <thread>
#include <vector>

#include "options.h"
#include "process.h"

namespace ddprun {
namespace {

using Clock = std::chrono::steady_clock;

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

// One node: the world is this node's ranks; MASTER_PORT is --master-port (or a free one).
class LocalRendezvous : public Rendezvous {
 public:
  explicit LocalRendezvous(const Options& options) : nproc_(options.nproc_per_node) {
    addr_ = options.standalone ? "127.0.0.1" : options.master_addr;
    port_ = options.standalone ? pick_free_port() : options.master_port;
    // Rank 0 will host its store on this port: refuse now rather than after starting N ranks.
    if (!options.standalone && !port_is_free(port_)) {
      throw UsageError("--master-port " + std::to_string(port_) +
                       " is already in use on this host: pick another port, or use --standalone");
    }
  }
  RoundInfo join(int, bool (*)()) override { return {nproc_, 0, addr_, port_}; }
  void report_failure(int, const std::string&) override {}
  std::optional<std::string> peer_failure(int) override { return std::nullopt; }
  std::optional<std::string> finish(int, bool (*)()) override { return std::nullopt; }

 private:
  int nproc_;
  std::string addr_;
  int port_;
};

std::vector<uint8_t> bytes(const std::string& text) { return {text.begin(), text.end()}; }
std::string text(const std::vector<uint8_t>& data) { return {data.begin(), data.end()}; }

class StoreRendezvous : public Rendezvous {
 public:
  explicit StoreRendezvous(const Options& options)
      : nnodes_(options.nnodes),
        node_(options.node_rank),
        nproc_(options.nproc_per_node),
        addr_(options.master_addr),
        port_(options.master_port),
        timeout_(to_ms(options.rdzv_timeout_s)),
        interval_(to_ms(options.monitor_interval_s)),
        grace_(to_ms(options.grace_period_s)) {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(port_);
    store_options.isServer = node_ == 0;
    store_options.waitWorkers = false;  // join() waits itself, and names who is missing
    store_options.timeout = timeout_;
    if (node_ == 0) {
      if (!port_is_free(port_)) {
        throw UsageError("--master-port " + std::to_string(port_) +
                         " is already in use on this host (node 0 hosts the launchers' store there)");
      }
      try {
        store_ = c10::make_intrusive<c10d::TCPStore>(addr_, store_options);
      } catch (const std::exception& error) {
        throw UsageError("node 0 cannot host the rendezvous store on port " + std::to_string(port_) + ": " +
                         error.what());
      }
      return;
    }
    // Connect in short attempts so Ctrl-C is noticed while node 0 is not up yet.
    const auto deadline = Clock::now() + timeout_;
    store_options.timeout = std::min(timeout_, std::chrono::milliseconds(1000));
    std::string last_error;
    while (Clock::now() < deadline) {
      try {
        store_ = c10::make_intrusive<c10d::TCPStore>(addr_, store_options);
        store_->setTimeout(timeout_);
        return;
      } catch (const std::exception& error) {
        last_error = error.what();
      }
    }
    throw RendezvousError("could not reach node 0's launcher at " + addr_ + ":" + std::to_string(port_) +
                          " within " + std::to_string(options.rdzv_timeout_s) +
                          " s: is ddprun --node-rank 0 running there, and are --master-addr/--master-port right?");
  }

  RoundInfo join(int round, bool (*stop_requested)()) override {
    const std::string p = prefix(round);
    if (store_->add(p + "claim/" + std::to_string(node_), 1) > 1) {
      throw RendezvousError("two launchers were started with --node-rank " + std::to_string(node_));
    }
    if (node_ == 0) store_->set(p + "port", bytes(std::to_string(pick_free_port())));
    store_->set(p + "nproc/" + std::to_string(node_), bytes(std::to_string(nproc_)));

    std::vector<std::string> keys{p + "port"};
    for (int n = 0; n < nnodes_; ++n) keys.push_back(p + "nproc/" + std::to_string(n));
    const auto deadline = Clock::now() + timeout_;
    while (!store_->check(keys)) {
      if (stop_requested()) throw RendezvousError("interrupted while waiting for the other nodes");
      if (Clock::now() >= deadline) {
        std::string missing;
        for (int n = 0; n < nnodes_; ++n) {
          if (!store_->check({p + "nproc/" + std::to_string(n)})) missing += (missing.empty() ? "" : ", ") + std::to_string(n);
        }
        throw RendezvousError("node(s) [" + missing + "] did not join round " + std::to_string(round) + " within " +
                              std::to_string(timeout_.count() / 1000.0) + " s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    RoundInfo info;
    info.master_addr = addr_;
    info.master_port = std::stoi(text(store_->get(p + "port")));
    for (int n = 0; n < nnodes_; ++n) {
      const int count = std::stoi(text(store_->get(p + "nproc/" + std::to_string(n))));
      if (n < node_) info.rank_offset += count;
      info.world_size += count;
    }
    return info;
  }

  void report_failure(int round, const std::string& why) override {
    try {
      store_->set(prefix(round) + "failed", bytes(why));
    } catch (const std::exception&) {
      // Node 0 is gone: the others learn it from their own failed store access.
    }
  }

  std::optional<std::string> peer_failure(int round) override {
    const std::string key = prefix(round) + "failed";
    try {
      if (store_->check({key})) return text(store_->get(key));
    } catch (const std::exception& error) {
      return "lost contact with node 0's launcher at " + addr_ + ":" + std::to_string(port_);
    }
    return std::nullopt;
  }

  std::optional<std::string> finish(int round, bool (*stop_requested)()) override {
    const std::string p = prefix(round);
    const auto deadline = Clock::now() + timeout_;
    try {
      store_->add(p + "done", 1);
      while (store_->add(p + "done", 0) < nnodes_) {
        if (auto failure = peer_failure(round)) return failure;
        if (stop_requested()) return std::string("interrupted");
        if (Clock::now() >= deadline) {
          return "other nodes' ranks did not finish within " + std::to_string(timeout_.count() / 1000.0) +
                 " s of this node's";
        }
        std::this_thread::sleep_for(interval_);
      }
    } catch (const std::exception&) {
      return "lost contact with node 0's launcher at " + addr_ + ":" + std::to_string(port_);
    }
    return std::nullopt;
  }

  void leave() override {
    try {
      if (node_ != 0) {
        store_->add("left", 1);
        return;
      }
      // Node 0 hosts the store: give the other launchers time to read the final keys.
      const auto deadline = Clock::now() + grace_ + std::chrono::seconds(5);
      while (store_->add("left", 0) < nnodes_ - 1 && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const std::exception&) {
    }
  }

 private:
  static std::string prefix(int round) { return "ddprun/r" + std::to_string(round) + "/"; }

  int nnodes_, node_, nproc_;
  std::string addr_;
  int port_;
  std::chrono::milliseconds timeout_, interval_, grace_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
};

}  // namespace

std::unique_ptr<Rendezvous> make_rendezvous(const Options& options) {
  if (options.nnodes == 1) return std::make_unique<LocalRendezvous>(options);
  return std::make_unique<StoreRendezvous>(options);
}

}  // namespace ddprun
