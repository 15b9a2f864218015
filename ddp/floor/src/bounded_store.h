#pragma once
// A c10d::Store whose every call returns within a bound, whatever the store's host does.
//
// c10d's TCPStore client waits for the server's answer without a deadline in most calls (check,
// set, add, compareSet; get once its key exists). A store host that is frozen - SIGSTOP, a hung
// machine - still completes TCP connections in its kernel but never answers, so every rank would
// block forever: in the rendezvous, in the stall check after a collective timed out, in the
// heartbeat thread that shutdown joins. Here each call runs on the store's own worker thread and
// the caller waits at most its bound; a call that does not return in time throws an error naming
// the store's host, leaves the worker blocked on the dead connection (it ends with the process),
// and every later call throws the same error at once: a connection with an unanswered request
// cannot be trusted again.
//
// Thread-safety: calls from several threads are run one at a time, in order of arrival.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace ddp::detail {

class BoundedStore final : public c10d::Store {
 public:
  // `inner` is the store to bound; `host` names who hosts it in errors ("rank 0 at
  // 127.0.0.1:29500"). A call that waits for a key (get, wait) may take the store's timeout; every
  // call gets `slack` more before it counts as unanswered.
  BoundedStore(c10::intrusive_ptr<c10d::Store> inner, std::string host, std::chrono::milliseconds slack);
  ~BoundedStore() override;

  // Makes a store with `make` on a worker thread, waiting at most `bound`: a TCPStore's constructor
  // talks to its server too. Throws std::runtime_error naming `host` when it does not return.
  static c10::intrusive_ptr<c10d::Store> connect(const std::function<c10::intrusive_ptr<c10d::Store>()>& make,
                                                 const std::string& host, std::chrono::milliseconds bound,
                                                 std::chrono::milliseconds slack);

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  void setTimeout(const std::chrono::milliseconds& timeout) override;
  // Another bounded handle on a clone of the inner store (a new connection for a TCPStore, made on
  // the worker like every call). c10d::Store's pure virtual in LibTorch 2.15, a plain method before
  // (compat::clone_store says which versions).
  c10::intrusive_ptr<c10d::Store> clone();

 private:
  class Worker;
  // Runs `call` (which owns everything it uses: it may outlive this call) on the worker and
  // returns its result, or throws after `bound`.
  template <typename Call>
  auto run(const char* what, std::chrono::milliseconds bound, Call call) -> decltype(call());
  std::chrono::milliseconds bound() const;  // the store's timeout plus the slack

  c10::intrusive_ptr<c10d::Store> inner_;
  std::string host_;
  std::chrono::milliseconds slack_;
  std::shared_ptr<Worker> worker_;
  std::mutex mutex_;
  std::string unanswered_;  // set once a call went unanswered: every later call throws it
};

}  // namespace ddp::detail
