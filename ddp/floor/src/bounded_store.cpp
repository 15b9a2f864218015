// The store whose calls return within a bound (bounded_store.h): a worker thread per store runs
// the calls one at a time; the caller waits for each with a deadline.
#include "ddp/floor/src/bounded_store.h"

#include <stdexcept>
#include <type_traits>
#include <utility>

#include "ddp/internal/compat/versions.h"

namespace ddp::detail {

// One thread and a queue of calls. Shared by the store and by its own thread, so that a store
// given up on (its worker blocked for good) can be destroyed while the worker still runs.
class BoundedStore::Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}

  // Queues `body`; returns whether it finished within `bound` (rethrowing its exception).
  bool run(std::chrono::milliseconds bound, std::function<void()> body) {
    auto call = std::make_shared<Call>();
    call->body = std::move(body);
    std::unique_lock<std::mutex> lock(mutex_);
    queue_.push_back(call);
    wake_.notify_all();
    if (!finished_.wait_for(lock, bound, [&] { return call->finished; })) return false;
    if (call->error) std::rethrow_exception(call->error);
    return true;
  }

  // Its owner is done with it: an idle worker ends now; one blocked in a call ends with the
  // process (or after the call, if it ever returns).
  static void release(std::shared_ptr<Worker> worker, bool blocked) {
    std::unique_lock<std::mutex> lock(worker->mutex_);
    worker->stopping_ = true;
    worker->wake_.notify_all();
    if (blocked) {
      worker->self_ = worker;  // the detached thread keeps its own state alive
      worker->thread_.detach();
      return;
    }
    lock.unlock();
    worker->thread_.join();
  }

 private:
  struct Call {
    std::function<void()> body;
    bool finished = false;
    std::exception_ptr error;
  };

  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) break;
      std::shared_ptr<Call> call = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::exception_ptr error;
      try {
        call->body();
      } catch (...) {
        error = std::current_exception();
      }
      call->body = nullptr;  // drop what it captured before the caller wakes
      lock.lock();
      call->error = error;
      call->finished = true;
      finished_.notify_all();
    }
    // Given up on while blocked: this thread holds the last reference, and drops it as it leaves.
    std::shared_ptr<Worker> last = std::move(self_);
    lock.unlock();
  }

  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  std::deque<std::shared_ptr<Call>> queue_;
  bool stopping_ = false;
  std::shared_ptr<Worker> self_;
  std::thread thread_;  // last: started once everything above exists
};

namespace {
std::string unanswered(const std::string& host, const char* what, std::chrono::milliseconds bound) {
  return "the store hosted by " + host + " did not answer (" + what + ") within " +
         std::to_string(bound.count() / 1000.0).substr(0, 4) + " s: that process may be frozen (stopped, hung) or its host unreachable";
}
}  // namespace

BoundedStore::BoundedStore(c10::intrusive_ptr<c10d::Store> inner, std::string host, std::chrono::milliseconds slack)
    : c10d::Store(inner->getTimeout()),
      inner_(std::move(inner)),
      host_(std::move(host)),
      slack_(slack),
      worker_(std::make_shared<Worker>()) {}

BoundedStore::~BoundedStore() {
  std::lock_guard<std::mutex> lock(mutex_);
  Worker::release(std::move(worker_), /*blocked=*/!unanswered_.empty());
}

c10::intrusive_ptr<c10d::Store> BoundedStore::connect(const std::function<c10::intrusive_ptr<c10d::Store>()>& make,
                                                      const std::string& host, std::chrono::milliseconds bound,
                                                      std::chrono::milliseconds slack) {
  auto worker = std::make_shared<Worker>();
  auto made = std::make_shared<c10::intrusive_ptr<c10d::Store>>();  // outlives this frame if `make` hangs
  bool answered = false;
  try {
    answered = worker->run(bound, [made, make] { *made = make(); });
  } catch (...) {
    Worker::release(std::move(worker), /*blocked=*/false);
    throw;
  }
  Worker::release(std::move(worker), /*blocked=*/!answered);
  if (!answered) throw std::runtime_error(unanswered(host, "connecting", bound));
  return c10::make_intrusive<BoundedStore>(std::move(*made), host, slack);
}

template <typename Call>
auto BoundedStore::run(const char* what, std::chrono::milliseconds bound, Call call) -> decltype(call()) {
  using Result = decltype(call());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!unanswered_.empty()) throw std::runtime_error(unanswered_);
  }
  if constexpr (std::is_void_v<Result>) {
    if (worker_->run(bound, std::move(call))) return;
  } else {
    auto result = std::make_shared<Result>();  // written by the worker, maybe after we gave up
    if (worker_->run(bound, [result, call = std::move(call)] { *result = call(); })) return std::move(*result);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (unanswered_.empty()) unanswered_ = unanswered(host_, what, bound);
  throw std::runtime_error(unanswered_);
}

std::chrono::milliseconds BoundedStore::bound() const { return timeout_ + slack_; }

// Every call copies its arguments and the inner store into what the worker runs.

void BoundedStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  run("set", bound(), [inner = inner_, key, value] { inner->set(key, value); });
}

std::vector<uint8_t> BoundedStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                              const std::vector<uint8_t>& desired) {
  return run("compareSet", bound(), [inner = inner_, key, expected, desired] { return inner->compareSet(key, expected, desired); });
}

std::vector<uint8_t> BoundedStore::get(const std::string& key) {
  return run("get", bound(), [inner = inner_, key] { return inner->get(key); });
}

int64_t BoundedStore::add(const std::string& key, int64_t value) {
  return run("add", bound(), [inner = inner_, key, value] { return inner->add(key, value); });
}

bool BoundedStore::deleteKey(const std::string& key) {
  return run("deleteKey", bound(), [inner = inner_, key] { return inner->deleteKey(key); });
}

bool BoundedStore::check(const std::vector<std::string>& keys) {
  return run("check", bound(), [inner = inner_, keys] { return inner->check(keys); });
}

int64_t BoundedStore::getNumKeys() {
  return run("getNumKeys", bound(), [inner = inner_] { return inner->getNumKeys(); });
}

void BoundedStore::wait(const std::vector<std::string>& keys) {
  run("wait", bound(), [inner = inner_, keys] { inner->wait(keys); });
}

void BoundedStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  run("wait", timeout + slack_, [inner = inner_, keys, timeout] { inner->wait(keys, timeout); });
}

c10::intrusive_ptr<c10d::Store> BoundedStore::clone() {
  auto inner = run("clone", bound(), [inner = inner_] { return compat::clone_store(inner); });
  return c10::make_intrusive<BoundedStore>(std::move(inner), host_, slack_);
}

void BoundedStore::setTimeout(const std::chrono::milliseconds& timeout) {
  c10d::Store::setTimeout(timeout);
  run("setTimeout", bound(), [inner = inner_, timeout] { inner->setTimeout(timeout); });
}

}  // namespace ddp::detail
