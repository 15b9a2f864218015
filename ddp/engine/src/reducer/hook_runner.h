#pragma once
// Runs a communication hook on each gradient bucket, on a thread of its own, while backward goes on.
//
//   submit(b)     the reducer's bucket b is complete (autograd thread): queue it
//   run()         the hook thread: for each queued bucket, in order, call the hook and wait for its
//                 future before the next one, so every rank issues the hooks' collectives in the
//                 same order even when a hook chains several of them
//   wait_all()    end of backward: wait until every submitted bucket is done, hand back the results
//
// One backward pass at a time: begin_pass() before the first submit, wait_all() or abandon() after.
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include <ddp/comm_hooks.h>

namespace ddp::detail {

// Waits for `future` for at most `timeout` (c10's Future::wait has none); throws std::runtime_error
// when it is not done by then. Does not rethrow the future's own error.
void wait_for_future(const FuturePtr& future, std::chrono::milliseconds timeout);
// The tensor a finished hook future holds: a tensor, or a list holding exactly one; throws
// std::runtime_error otherwise.
at::Tensor future_tensor(const c10::ivalue::Future& future);

class HookRunner {
 public:
  HookRunner(CommHook hook, std::chrono::milliseconds timeout);
  ~HookRunner();  // stops the thread (after the bucket it is running, if any)
  HookRunner(const HookRunner&) = delete;
  HookRunner& operator=(const HookRunner&) = delete;

  const CommHook& hook() const { return hook_; }

  // The buckets of the coming passes (after every bucket rebuild). Not during a pass.
  void set_buckets(std::vector<GradBucket> buckets);
  // Called on the hook thread before each hook call (TORCH_DISTRIBUTED_DEBUG=DETAIL's check).
  void set_before_each(std::function<void(size_t)> before_each) { before_each_ = std::move(before_each); }
  // Called on the hook thread when a bucket's hook future is done (timings).
  void set_on_done(std::function<void(size_t)> on_done) { on_done_ = std::move(on_done); }
  // A new backward pass starts: no bucket submitted yet, no error.
  void begin_pass();
  // Bucket `index` is complete: its hook runs once every earlier bucket's has finished.
  void submit(size_t index);
  // Blocks until every submitted bucket's hook has finished. On success returns each bucket's
  // average (result[b]: a tensor shaped and typed like bucket b's buffer), valid until the next
  // pass. On failure throws, naming the first bucket that failed.
  const std::vector<at::Tensor>& wait_all();
  // Leaves no hook running: waits for the submitted ones to finish, drops their results and errors.
  void abandon() noexcept;

 private:
  void run();
  at::Tensor call_hook(size_t index);

  const CommHook hook_;
  const std::chrono::milliseconds timeout_;
  std::vector<GradBucket> buckets_;
  std::vector<at::Tensor> own_buffers_;  // each bucket's storage, restored before each call
  std::vector<at::Tensor> results_;
  std::function<void(size_t)> before_each_;
  std::function<void(size_t)> on_done_;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<size_t> queue_;  // submitted buckets, in order; [next_, submitted) still to run
  size_t next_ = 0;            // the next queued bucket the thread runs
  size_t finished_ = 0;        // buckets whose hook is done (or skipped after an error)
  std::exception_ptr error_;   // the first failure of this pass
  bool stopping_ = false;
  std::thread thread_;         // last: starts after every member above exists
};

}  // namespace ddp::detail
