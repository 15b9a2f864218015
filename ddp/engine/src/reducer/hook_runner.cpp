#include "ddp/engine/src/reducer/hook_runner.h"

#include <memory>
#include <sstream>
#include <stdexcept>

#include <c10/util/Exception.h>

namespace ddp::detail {
namespace {

std::string describe(const at::Tensor& tensor) {
  std::ostringstream out;
  out << tensor.sizes() << " " << c10::toString(tensor.scalar_type());
  return out.str();
}

}  // namespace

at::Tensor future_tensor(const c10::ivalue::Future& future) {
  const c10::IValue& value = future.constValue();
  if (value.isTensor()) return value.toTensor();
  if (value.isTensorList() && value.toTensorList().size() == 1) return value.toTensorList().get(0);
  throw std::runtime_error("its future holds a " + value.tagKind() + ", not a tensor");
}

void wait_for_future(const FuturePtr& future, std::chrono::milliseconds timeout) {
  struct Done {
    std::mutex mutex;
    std::condition_variable changed;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  future->addCallback([done](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(done->mutex);
    done->done = true;
    done->changed.notify_all();
  });
  std::unique_lock<std::mutex> lock(done->mutex);
  if (!done->changed.wait_for(lock, timeout, [&] { return done->done; })) {
    throw std::runtime_error("its future was not done after " + std::to_string(timeout.count() / 1000.0) +
                             " s (a hook must complete the future it returns)");
  }
}

HookRunner::HookRunner(CommHook hook, std::chrono::milliseconds timeout)
    : hook_(std::move(hook)), timeout_(timeout), thread_([this] { run(); }) {}

HookRunner::~HookRunner() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void HookRunner::set_buckets(std::vector<GradBucket> buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  buckets_ = std::move(buckets);
  own_buffers_.clear();
  for (auto& bucket : buckets_) own_buffers_.push_back(bucket.buffer());
  results_.assign(buckets_.size(), at::Tensor());
  queue_.clear();
  queue_.reserve(buckets_.size());
}

void HookRunner::begin_pass() {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.clear();
  next_ = finished_ = 0;
  error_ = nullptr;
}

void HookRunner::submit(size_t index) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(index);  // capacity reserved: no allocation on the backward path
  }
  changed_.notify_all();
}

// The hook thread: runs queued buckets one by one, in order.
void HookRunner::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [this] { return stopping_ || next_ < queue_.size(); });
    if (stopping_) return;
    const size_t index = queue_[next_++];
    const bool skip = static_cast<bool>(error_);  // after a failure, no further collective
    lock.unlock();
    at::Tensor result;
    std::exception_ptr error;
    if (!skip) {
      try {
        result = call_hook(index);
      } catch (const std::exception& failure) {
        error = std::make_exception_ptr(std::runtime_error(
            "DistributedDataParallel: the communication hook '" + hook_.name() + "' failed on gradient bucket " +
            std::to_string(index) + " of " + std::to_string(buckets_.size()) + ": " + failure.what()));
      } catch (...) {  // anything else thrown on this thread would end the process
        error = std::make_exception_ptr(std::runtime_error(
            "DistributedDataParallel: the communication hook '" + hook_.name() + "' failed on gradient bucket " +
            std::to_string(index) + " of " + std::to_string(buckets_.size()) +
            ": it threw something that is not a std::exception (throw std::runtime_error or another std::exception)"));
      }
    }
    lock.lock();
    results_[index] = std::move(result);
    if (error && !error_) error_ = error;
    ++finished_;
    changed_.notify_all();
  }
}

// Calls the hook on one bucket and checks what its future holds.
at::Tensor HookRunner::call_hook(size_t index) {
  GradBucket& bucket = buckets_[index];
  bucket.set_buffer(own_buffers_[index]);  // undo what a wrapper set in the previous pass
  if (before_each_) before_each_(index);
  FuturePtr future = hook_(bucket);
  if (!future) throw std::runtime_error("it returned a null future");
  wait_for_future(future, timeout_);
  if (on_done_) on_done_(index);
  if (future->hasError()) std::rethrow_exception(future->exception_ptr());
  at::Tensor result = future_tensor(*future);
  const at::Tensor& own = own_buffers_[index];
  if (!result.defined() || result.sizes() != own.sizes() || result.scalar_type() != own.scalar_type()) {
    throw std::runtime_error("its future holds " + (result.defined() ? describe(result) : std::string("no tensor")) +
                             " but the bucket's buffer is " + describe(own) +
                             " (a hook returns the averaged buffer, same shape and dtype)");
  }
  return result;
}

const std::vector<at::Tensor>& HookRunner::wait_all() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [this] { return finished_ == queue_.size(); });
  if (error_) std::rethrow_exception(error_);
  return results_;  // the thread is idle until the next submit
}

void HookRunner::abandon() noexcept {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [this] { return finished_ == queue_.size(); });
  error_ = nullptr;
}

}  // namespace ddp::detail
