#pragma once
// Communication hooks: replace how DistributedDataParallel reduces a gradient bucket
// (PyTorch's DistributedDataParallel.register_comm_hook and torch.distributed.algorithms.ddp_comm_hooks).
//
//   model.register_comm_hook(ddp::hooks::bf16_compress());       // or allreduce(), fp16_compress()
//   model.register_comm_hook(ddp::hooks::powersgd(ddp::hooks::PowerSGDOptions().matrix_approximation_rank(2)));  // powersgd.h
//   model.register_comm_hook([](ddp::GradBucket& bucket) {        // your own
//     bucket.buffer().div_(bucket.world_size());                    // the hook averages (PyTorch's contract)
//     return ddp::hooks::allreduce_future(bucket.process_group(), bucket.buffer());
//   });
//
// The contract (PyTorch's, plus what C++ needs to say):
//  - A hook gets one bucket: its flat buffer() holds this rank's gradients of the bucket's
//    parameters, one after another (offsets()), summed over the backward passes since the last
//    synchronization (no_sync) and NOT divided by the world size. The hook starts the reduction and
//    returns a future whose value is a tensor with the buffer's shape and dtype holding the
//    average over the ranks (a list holding one such tensor is accepted too). DDP waits for every
//    bucket's future when backward ends and writes the result into the parameters' gradients.
//  - Hooks run on DDP's communication thread, one bucket at a time in bucket order, while backward
//    continues on its own thread. DDP waits for a hook's future before it calls the hook of the
//    next bucket, so a hook may chain collectives inside then() callbacks and every rank still issues
//    them in the same order (with Gloo, PyTorch does not guarantee that).
//  - A hook that throws, or whose future fails or holds the wrong shape or dtype, makes backward's
//    end raise an error naming the bucket on this rank; no further bucket of that backward is
//    reduced. Other ranks then fail in their collective (within the group's timeout).
//  - Register once, before the first backward; the hook lives as long as the DDP wrapper.
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ddp/process_group.h>
#include <ddp/stateful.h>

namespace ddp {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// One gradient bucket, as a hook sees it. Valid during the hook call and until its future is
// done; the tensors are the reducer's own (no copies are made for the hook).
namespace detail {
class Reducer;
struct OwnAverage;
}

class GradBucket {
 public:
  // For testing a hook outside DDP: a bucket whose flat `buffer` holds the gradients of
  // `parameters` one after another (gradients() are views of it, shaped like the parameters), and
  // whose parameter_indices() count up from `first_parameter_index`. `buffer` must have at least
  // the parameters' total number of elements.
  static GradBucket for_parameters(size_t index, size_t bucket_count, at::Tensor buffer,
                                   std::vector<at::Tensor> parameters, ProcessGroupPtr group,
                                   size_t first_parameter_index = 0);

  // Position in launch order: 0 is the first bucket reduced in a backward pass.
  size_t index() const { return index_; }
  // The last bucket of this backward pass (stateful hooks count iterations on it).
  bool is_last() const { return index_ + 1 == bucket_count_; }
  size_t bucket_count() const { return bucket_count_; }
  // The flat gradients (see the contract above). A hook may modify it in place.
  at::Tensor& buffer() { return buffer_; }
  const at::Tensor& buffer() const { return buffer_; }
  // Replaces what buffer() returns for the rest of this hook call (compression wrappers hand an
  // inner hook a compressed copy this way). The bucket's own storage is not changed.
  void set_buffer(at::Tensor buffer) { buffer_ = std::move(buffer); }
  // Per-parameter views into the bucket's own storage, shaped like parameters().
  const std::vector<at::Tensor>& gradients() const { return gradients_; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  // Element offset of each parameter's gradient in buffer().
  const std::vector<int64_t>& offsets() const { return offsets_; }
  // Each parameter's position among the parameters DDP reduces (the module's parameters() that
  // require gradients, in order): stable across bucket rebuilds
  // and runs, so a stateful hook keys its per-parameter state by it (PowerSGD does).
  const std::vector<size_t>& parameter_indices() const { return parameter_indices_; }
  const ProcessGroupPtr& process_group() const { return group_; }
  int world_size() const { return group_->getSize(); }
  int rank() const { return group_->getRank(); }

 private:
  friend class detail::Reducer;  // DDP's buckets: views of the reducer's own storage
  friend struct detail::OwnAverage;
  GradBucket(size_t index, size_t bucket_count, at::Tensor buffer, std::vector<at::Tensor> gradients,
             std::vector<at::Tensor> parameters, std::vector<int64_t> offsets, ProcessGroupPtr group,
             std::vector<size_t> parameter_indices);

  size_t index_;
  size_t bucket_count_;
  at::Tensor buffer_;
  std::vector<at::Tensor> gradients_;
  std::vector<at::Tensor> parameters_;
  std::vector<int64_t> offsets_;
  ProcessGroupPtr group_;
  std::vector<size_t> parameter_indices_;
  // DDP's buckets: the floor's own average of the bucket's storage (shared memory reduces it where
  // it lies), which hooks::allreduce() starts while buffer() is still that storage (own_buffer_).
  std::function<c10::intrusive_ptr<c10d::Work>()> own_average_;
  at::Tensor own_buffer_;
};

// What register_comm_hook takes: the function, a name (reported in logging_data()), optionally
// the hook's state, which save_checkpoint/load_checkpoint carry when given the DDP wrapper, and
// optionally its settings: what else every rank must agree on (PowerSGD's options, say).
// Any callable FuturePtr(GradBucket&) converts to a CommHook.
//
// Every rank must register the same hook: at the first reduction DDP compares each rank's name and
// settings (one small allgather, once) and throws on every rank, listing each rank's hook, when they
// differ -- a hook on one rank and none on another would pair collectives of different sizes.
class CommHook {
 public:
  using Function = std::function<FuturePtr(GradBucket&)>;

  CommHook(Function function, std::string name = "custom", std::shared_ptr<Stateful> state = nullptr,
           std::string settings = "")
      : function_(std::move(function)), name_(std::move(name)), state_(std::move(state)),
        settings_(std::move(settings)) {}
  template <typename F, typename = std::enable_if_t<std::is_invocable_r_v<FuturePtr, F&, GradBucket&> &&
                                                    !std::is_same_v<std::decay_t<F>, CommHook> &&
                                                    !std::is_same_v<std::decay_t<F>, Function>>>
  CommHook(F function)  // NOLINT(google-explicit-constructor): a lambda is a hook
      : CommHook(Function(std::move(function))) {}

  FuturePtr operator()(GradBucket& bucket) const { return function_(bucket); }
  const std::string& name() const { return name_; }
  const std::shared_ptr<Stateful>& state() const { return state_; }
  const std::string& settings() const { return settings_; }

 private:
  Function function_;
  std::string name_;
  std::shared_ptr<Stateful> state_;
  std::string settings_;
};

namespace hooks {

// --- the built-in hooks --------------------------------------------------------------------------

// Averages by allreduce: the same gradients, bit for bit, as registering no hook (a reference for
// writing your own; slower than no hook, which fuses the division into the copy into the bucket).
CommHook allreduce();
// Divides by the world size, rounds to float16 and allreduces in float16 (half the bytes of
// float32), then writes the average back into the bucket's dtype. Gloo and NCCL.
CommHook fp16_compress();
// The same with bfloat16 (float32's range, 8 bits of precision). With NCCL, and with Gloo builds
// that reduce bfloat16 (LibTorch 2.6's), an allreduce in bfloat16; with Gloo builds that cannot
// (LibTorch 1.13's), a reduce-scatter of its own: each rank receives one slice of every rank's
// bfloat16 values, sums it in float32 (so as precise or more), and an allgather shares the sums.
// Waits on the hook thread there.
CommHook bf16_compress();
// Compress around any other hook: the inner hook sees the buffer in float16 / bfloat16 (already
// divided by nothing: the inner hook averages), its result is written back in the bucket's dtype.
CommHook fp16_compress_wrapper(CommHook inner);
CommHook bf16_compress_wrapper(CommHook inner);

// --- for writing hooks -----------------------------------------------------------------------------

// Starts a SUM allreduce of `tensor` in place on `group`; the future's value is `tensor`.
FuturePtr allreduce_future(const ProcessGroupPtr& group, at::Tensor tensor);
// A future that is already done with `tensor` as its value.
FuturePtr completed_future(at::Tensor tensor);

}  // namespace hooks
}  // namespace ddp
