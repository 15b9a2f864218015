#include "rendezvous.h"

#include <cstdint>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "hosts.h"
#include "options.h"
#include "process.h"
#include "secret.h"
#include "signals.h"
#include "store.h"

namespace ddprun {
namespace {

using Clock = std::chrono::steady_clock;

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

// 64 random bits as hex: a job's run id.
std::string random_run_id() { return random_hex(8); }

// Where node 0's store listens: the address the other nodes were given (--master-addr), or every
// interface with --rdzv-listen-all. A host name that resolves to loopback here (Debian maps a
// host's own name to 127.0.1.1) is still how the other hosts reach it: every interface then too.
std::string store_address(const Options& options) {
  const bool literal = options.master_addr == "localhost" || is_address_literal(options.master_addr);
  if (options.rdzv_listen_all || (!literal && is_loopback(options.master_addr))) return "";
  return options.master_addr;
}

// A count or port another launcher stored: checked like a command-line number.
int stored_number(const std::optional<std::string>& text, const std::string& what, int low, int high) {
  if (auto number = parse_number(text.value_or(""), low, high)) return static_cast<int>(*number);
  throw RendezvousError("the store holds a bad " + what + " '" + text.value_or("").substr(0, 80) + "' (expected " +
                        std::to_string(low) + ".." + std::to_string(high) + ")");
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
  RoundInfo join(int, bool (*)()) override { return {nproc_, 0, addr_, port_, run_id_}; }
  void report_failure(int, const std::string&) override {}
  std::optional<std::string> peer_failure(int) override { return std::nullopt; }
  std::optional<std::string> finish(int, bool (*)()) override { return std::nullopt; }

 private:
  int nproc_;
  std::string addr_;
  int port_;
  std::string run_id_ = random_run_id();
};

bool stop_signal_seen() { return stop_signal() != 0; }

class StoreRendezvous : public Rendezvous {
 public:
  StoreRendezvous(const Options& options, const std::string& token)
      : nnodes_(options.nnodes),
        node_(options.node_rank),
        nproc_(options.nproc_per_node),
        addr_(options.master_addr),
        port_(options.master_port),
        timeout_(to_ms(options.rdzv_timeout_s)),
        interval_(to_ms(options.monitor_interval_s)),
        grace_(to_ms(options.grace_period_s)) {
    const std::string listen_address = store_address(options);
    if (node_ == 0) {
      try {
        server_ = std::make_unique<StoreServer>(listen_address, port_, token);
      } catch (const std::exception& error) {
        if (!port_is_free(port_)) {
          throw UsageError("--master-port " + std::to_string(port_) +
                           " is already in use on this host (node 0 hosts the launchers' store there): " + error.what());
        }
        throw UsageError("node 0 hosts the launchers' store at --master-addr " + addr_ + ", but " + error.what() +
                         ": give an address of this host, or --rdzv-listen-all to listen on every interface");
      }
    }
    const std::string store_host = node_ != 0 ? addr_ : listen_address.empty() ? "localhost" : listen_address;
    try {
      store_ = std::make_unique<StoreClient>(store_host, port_, token, timeout_, stop_signal_seen);
    } catch (const StoreTrustError& error) {
      throw RendezvousError("node 0's launcher at " + addr_ + ":" + std::to_string(port_) + " " + error.what());
    } catch (const std::exception& error) {
      throw RendezvousError("could not reach node 0's launcher at " + addr_ + ":" + std::to_string(port_) +
                            " within " + seconds(timeout_) + " (" + error.what() +
                            "): is ddprun --node-rank 0 running there, and are --master-addr/--master-port right?");
    }
  }

  RoundInfo join(int round, bool (*stop_requested)()) override {
    const std::string p = prefix(round);
    if (!joined_) store_->add("joined", 1);  // node 0's leave() waits only for launchers that came
    joined_ = true;
    if (store_->add(p + "claim/" + std::to_string(node_), 1) > 1) {
      throw RendezvousError("two launchers were started with --node-rank " + std::to_string(node_));
    }
    if (node_ == 0) {
      store_->set(p + "port", std::to_string(pick_free_port()));
      store_->set(p + "run_id", run_id_);  // one id for all rounds: a restart is the same job
    }
    store_->set(p + "nproc/" + std::to_string(node_), std::to_string(nproc_));

    // Node 0 writes the port and run id before its own count, so all counts present means they are too.
    RoundInfo info;
    info.master_addr = addr_;
    const auto deadline = Clock::now() + timeout_;
    for (int n = 0; n < nnodes_; ++n) {
      std::optional<std::string> count;
      while (!(count = store_->get(p + "nproc/" + std::to_string(n)))) {
        if (stop_requested()) throw RendezvousError("interrupted while waiting for the other nodes");
        if (Clock::now() >= deadline) {
          std::string missing;
          for (int m = n; m < nnodes_; ++m) {
            if (!store_->get(p + "nproc/" + std::to_string(m))) missing += (missing.empty() ? "" : ", ") + std::to_string(m);
          }
          throw RendezvousError("node(s) [" + missing + "] did not join round " + std::to_string(round) + " within " +
                                seconds(timeout_));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      const int ranks = stored_number(count, "rank count of node " + std::to_string(n), 1, kMaxRanksPerNode);
      if (n < node_) info.rank_offset += ranks;
      info.world_size += ranks;
    }
    info.master_port = stored_number(store_->get(p + "port"), "MASTER_PORT", 1, 65535);
    info.run_id = store_->get(p + "run_id").value_or("");
    return info;
  }

  void report_failure(int round, const std::string& why) override {
    try {
      store_->set(prefix(round) + "failed", why);
    } catch (const std::exception&) {
      // Node 0 is gone: the others learn it from their own failed store access.
    }
  }

  std::optional<std::string> peer_failure(int round) override {
    try {
      return store_->get(prefix(round) + "failed");
    } catch (const std::exception& error) {
      return "lost contact with node 0's launcher at " + addr_ + ":" + std::to_string(port_);
    }
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
          return "other nodes' ranks did not finish within " + seconds(timeout_) + " of this node's";
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
      while (store_->add("left", 0) < store_->add("joined", 0) - 1 && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const std::exception&) {
    }
  }

 private:
  static std::string prefix(int round) { return "ddprun/r" + std::to_string(round) + "/"; }
  static std::string seconds(std::chrono::milliseconds ms) {
    std::string text = std::to_string(ms.count() / 1000.0);
    text.erase(text.find_last_not_of('0') + 1);
    if (text.back() == '.') text.pop_back();
    return text + " s";
  }

  int nnodes_, node_, nproc_;
  std::string addr_;
  int port_;
  std::chrono::milliseconds timeout_, interval_, grace_;
  std::unique_ptr<StoreServer> server_;  // node 0 only
  std::string run_id_ = random_run_id();  // node 0's is the job's (as LocalRendezvous keeps one)
  std::unique_ptr<StoreClient> store_;
  bool joined_ = false;
};

}  // namespace

std::unique_ptr<Rendezvous> make_rendezvous(const Options& options, const std::string& token) {
  if (options.nnodes == 1) return std::make_unique<LocalRendezvous>(options);
  return std::make_unique<StoreRendezvous>(options, token);
}

}  // namespace ddprun
