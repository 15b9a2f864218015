#pragma once
// DDP's gradient buckets as the floor keeps and reduces them: the one seam between the reducer and
// the group. The group chooses once per bucket, when the buckets are built, where the bucket lives
// and how it is averaged; the reducer hands each gradient over (take), starts the average
// (start_average) and reads the result back where take() left it. Three kinds:
//
//   copying    private memory; gradients are copied into their slots, divided by the divisor on
//              the way, and the group's allreduce sums the whole bucket (Gloo, NCCL, a group built
//              with c10d).
//   in place   shared memory, the bucket in private memory: the channel sums the members'
//              gradients where they lie, as one array, times 1/divisor in the same pass, and
//              nothing is copied in or out. A gradient it cannot read where it lies (another
//              dtype, not contiguous, requiring grad) is copied into its slot first.
//   shared     shared memory, the bucket itself in memory every rank of the host maps (only where
//              every rank builds its buckets at once: a collective): each rank reduces its slice
//              of every rank's bucket and writes it into all of them - two passes over the bucket.
//
// With a communication hook (for_hook), each kind keeps its storage, and take() copies every
// gradient into its slot as it is: the hook reduces flat(), and hooks::allreduce() through the
// buffer's own start_average() (the shared kind then still reduces where the bucket lies).
//
// Thread-safety: a buffer is used by one thread at a time (the reducer's, under its lock); the Work
// it returns completes on the group's thread.
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ddp/process_group.h>

namespace ddp::detail {

class GradientBuffer {
 public:
  virtual ~GradientBuffer() = default;

  // Every member's slot, one after another: what a communication hook reduces.
  const at::Tensor& flat() const { return flat_; }
  // Slot k: member k's place in flat(), shaped like it. Not an autograd view, so an optimizer may
  // detach_() and zero_() a gradient that is its slot. The caller may replace a slot by a tensor
  // over the same place (the reducer does, to keep a slot the user holds apart).
  at::Tensor& slot(size_t k) { return slots_[k]; }
  const std::vector<at::Tensor>& slots() const { return slots_; }
  size_t members() const { return slots_.size(); }
  // Whether the reduction writes into every rank's slots (memory all ranks of the host map): a
  // slot then changes under whoever holds it, at any rank's reduction. Each slot has a storage of
  // its own then, so what holds one can be told apart slot by slot.
  virtual bool shared() const { return false; }

  // Member k's gradient for this pass: its slot itself (zeros of an unused parameter,
  // gradient_as_bucket_view), or a gradient, which the buffer reduces where it lies when it can
  // (reduced_in_place(k) is true until the next take(k)) or else copies into slot k.
  virtual void take(size_t k, const at::Tensor& gradient) = 0;
  bool reduced_in_place(size_t k) const { return !in_place_.empty() && in_place_[k] != 0; }
  // Starts the average of what was taken: every member's gradient (where it lies, or in its slot)
  // becomes the sum over the ranks times 1/divisor. Every member must have been taken. The buffer
  // keeps no reference to a gradient past this call.
  virtual c10::intrusive_ptr<c10d::Work> start_average() = 0;
  // The number start_average divides by from the next take() on (the world size, or fewer ranks
  // under ddp::Join).
  void set_divisor(int divisor);
  int divisor() const { return divisor_; }
  // From now on a communication hook reduces flat() (what make_gradient_buffers' for_hook makes):
  // gradients are copied into their slots as they are, and start_average() divides by `divisor`.
  void hand_to_hook(int divisor);

 protected:
  GradientBuffer(ProcessGroupPtr group, at::Tensor flat, const std::vector<at::Tensor>& members, bool own_storage,
                 int divisor);

  ProcessGroupPtr group_;
  at::Tensor flat_;
  std::vector<at::Tensor> slots_;
  std::vector<char> in_place_;  // in_place_[k]: member k's gradient is reduced where it lies
  at::Tensor scale_;            // 1/divisor, 0-dim, of flat's dtype and device
  int divisor_ = 1;
  bool for_hook_ = false;       // take() copies as it is; a hook reduces flat()
};

struct GradientBufferOptions {
  bool for_hook = false;                 // a communication hook reduces flat() (hand_to_hook)
  bool every_rank_builds = true;         // every rank builds these buckets now (a collective): they
                                         // may go into memory the ranks share
  bool gradient_as_bucket_view = false;  // gradients will be their slots
  int divisor = 1;
};

// One buffer per bucket: bucket b holds the gradients of `members[b]` (the parameters, of one dtype
// and device per bucket), in order. With every_rank_builds, a collective (every rank passes the
// same layout); it then throws what a peer's failure in it raised.
std::vector<std::unique_ptr<GradientBuffer>> make_gradient_buffers(const ProcessGroupPtr& group,
                                                                   const std::vector<std::vector<at::Tensor>>& members,
                                                                   const GradientBufferOptions& options);

// The average over the group's ranks of `tensor`, in place: its sum times 1/divisor. On shared
// memory in the reduction's own pass; elsewhere each rank's part divided first, then summed by the
// group's allreduce. What hooks::allreduce() does with a bucket.
c10::intrusive_ptr<c10d::Work> start_average(const ProcessGroupPtr& group, const at::Tensor& tensor, int divisor);

}  // namespace ddp::detail
