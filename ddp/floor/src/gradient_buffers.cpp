// DDP's gradient buckets (gradient_buffers.h): the three kinds of buffer, and the one place that
// chooses between them.
#include "ddp/floor/src/gradient_buffers.h"

#include <algorithm>
#include <utility>

#include "ddp/floor/src/owned_group.h"
#include "ddp/floor/src/shm/channel.h"
#include "ddp/floor/src/start_allreduce.h"

namespace ddp::detail {
namespace {

// One tensor per member over its place in `flat`, shaped like the member: sharing flat's storage,
// or (own_storage) each with a storage of its own over that place, which keeps flat alive.
std::vector<at::Tensor> make_slots(const at::Tensor& flat, const std::vector<at::Tensor>& members, bool own_storage) {
  std::vector<at::Tensor> slots;
  int64_t offset = 0;
  for (const at::Tensor& member : members) {
    const at::Tensor view = flat.narrow(0, offset, member.numel()).view(member.sizes());
    if (own_storage) {
      slots.push_back(at::from_blob(view.data_ptr(), view.sizes(), [flat](void*) {}, view.options()));
    } else {
      slots.push_back(
          at::empty({0}, flat.options()).set_(view.storage(), view.storage_offset(), view.sizes(), view.strides()));
    }
    offset += member.numel();
  }
  return slots;
}

// Private memory, reduced by the group's allreduce of the whole bucket. Gradients are divided while
// they are copied in (one pass for both), except for a hook, which gets them as they are.
class CopyingBuffer final : public GradientBuffer {
 public:
  CopyingBuffer(ProcessGroupPtr group, at::Tensor flat, const std::vector<at::Tensor>& members, int divisor)
      : GradientBuffer(std::move(group), std::move(flat), members, /*own_storage=*/false, divisor) {}

  void take(size_t k, const at::Tensor& gradient) override {
    at::Tensor& slot = slots_[k];
    const bool divide = !for_hook_ && divisor_ > 1;  // dividing by one would be a wasted pass
    if (gradient.is_same(slot)) {
      if (divide) slot.mul_(scale_);
    } else if (divide) {
      at::mul_out(slot, gradient, scale_);
    } else {
      slot.copy_(gradient);
    }
  }

  c10::intrusive_ptr<c10d::Work> start_average() override {
    return for_hook_ ? detail::start_average(group_, flat_, divisor_) : start_allreduce(group_, flat_);
  }
};

// Shared memory, the bucket in private memory: each gradient summed where it lies.
class InPlaceBuffer final : public GradientBuffer {
 public:
  InPlaceBuffer(ProcessGroupPtr group, shm::Channel& channel, at::Tensor flat, const std::vector<at::Tensor>& members,
                int divisor)
      : GradientBuffer(std::move(group), std::move(flat), members, /*own_storage=*/false, divisor),
        channel_(channel),
        whole_{flat_},
        pieces_(members.size()) {
    in_place_.assign(members.size(), 0);
  }

  void take(size_t k, const at::Tensor& gradient) override {
    at::Tensor& slot = slots_[k];
    in_place_[k] = !for_hook_ && !gradient.is_same(slot) && gradient.is_contiguous() && !gradient.requires_grad() &&
                   gradient.scalar_type() == flat_.scalar_type() && gradient.device() == flat_.device();
    if (!in_place_[k] && !gradient.is_same(slot)) slot.copy_(gradient);
    pieces_[k] = in_place_[k] ? gradient : slot;
  }

  c10::intrusive_ptr<c10d::Work> start_average() override {
    // Every member in its slot (gradient_as_bucket_view, copies): the bucket as one piece.
    const bool any = std::any_of(in_place_.begin(), in_place_.end(), [](char c) { return c != 0; });
    auto work = channel_.allreduce(any ? pieces_ : whole_, c10d::ReduceOp::SUM, 1.0 / divisor_);
    for (at::Tensor& piece : pieces_) piece = at::Tensor();  // no gradient kept alive past its reduction
    return work;
  }

 private:
  shm::Channel& channel_;           // the group's, which group_ keeps alive
  std::vector<at::Tensor> whole_;   // {flat_}
  std::vector<at::Tensor> pieces_;  // this pass: each member's gradient or slot
};

// Shared memory, the bucket in memory every rank of the host maps.
class SharedBuffer final : public GradientBuffer {
 public:
  SharedBuffer(ProcessGroupPtr group, shm::Channel& channel, std::shared_ptr<shm::SharedArray> array, size_t offset,
               at::Tensor flat, const std::vector<at::Tensor>& members, int divisor, bool gradient_as_bucket_view)
      : GradientBuffer(std::move(group), std::move(flat), members, /*own_storage=*/!gradient_as_bucket_view, divisor),
        channel_(channel),
        array_(std::move(array)),
        offset_(offset) {}

  bool shared() const override { return true; }

  void take(size_t k, const at::Tensor& gradient) override {
    if (!gradient.is_same(slots_[k])) slots_[k].copy_(gradient);
  }

  c10::intrusive_ptr<c10d::Work> start_average() override {
    return channel_.shared_sum(array_, offset_, flat_, 1.0 / divisor_);
  }

 private:
  shm::Channel& channel_;
  std::shared_ptr<shm::SharedArray> array_;
  size_t offset_;  // bytes: where flat_ begins in the array
};

// The channel that reduces the group's CPU tensors in shared memory, or null.
shm::Channel* channel_of(const ProcessGroupPtr& group) {
  OwnedGroup* owner = owned(group);
  return owner != nullptr ? owner->shared_memory() : nullptr;
}

// Where each of `sizes` (bytes) begins in one array holding them all, each at a multiple of 64
// bytes (whole cache lines); the last entry is the array's size.
std::vector<size_t> cache_line_offsets(const std::vector<size_t>& sizes) {
  std::vector<size_t> offsets{0};
  for (size_t bytes : sizes) offsets.push_back(offsets.back() + (bytes + 63) / 64 * 64);
  return offsets;
}

}  // namespace

GradientBuffer::GradientBuffer(ProcessGroupPtr group, at::Tensor flat, const std::vector<at::Tensor>& members,
                               bool own_storage, int divisor)
    : group_(std::move(group)),
      flat_(std::move(flat)),
      slots_(make_slots(flat_, members, own_storage)),
      scale_(at::full({}, 1.0 / divisor, flat_.options())),
      divisor_(divisor) {}

void GradientBuffer::hand_to_hook(int divisor) {
  for_hook_ = true;
  std::fill(in_place_.begin(), in_place_.end(), 0);
  set_divisor(divisor);
}

void GradientBuffer::set_divisor(int divisor) {
  if (divisor == divisor_) return;
  divisor_ = divisor;
  scale_.fill_(1.0 / divisor);
}

std::vector<std::unique_ptr<GradientBuffer>> make_gradient_buffers(const ProcessGroupPtr& group,
                                                                   const std::vector<std::vector<at::Tensor>>& members,
                                                                   const GradientBufferOptions& options) {
  // What each bucket holds, and whether shared memory sums it (a floating CPU dtype).
  shm::Channel* channel = channel_of(group);
  std::vector<at::TensorOptions> kinds;
  std::vector<int64_t> numels;
  std::vector<char> summed_in_shm;
  for (const auto& bucket : members) {
    int64_t numel = 0;
    for (const at::Tensor& member : bucket) numel += member.numel();
    numels.push_back(numel);
    kinds.push_back(bucket.front().options().requires_grad(false));
    summed_in_shm.push_back(channel != nullptr && channel->serves_scaled_sum({at::empty({0}, kinds.back())}));
  }
  // Those buckets in one array every rank maps, when every rank builds them now and the channel
  // sums each of their dtypes there (else none of them, on every rank alike).
  std::vector<size_t> sizes;
  bool shareable = options.every_rank_builds;
  for (size_t b = 0; b < members.size(); ++b) {
    if (!summed_in_shm[b]) continue;
    sizes.push_back(static_cast<size_t>(numels[b]) * kinds[b].dtype().itemsize());
    shareable = shareable && channel->serves_shared_sum(c10::typeMetaToScalarType(kinds[b].dtype()));
  }
  const std::vector<size_t> offsets = cache_line_offsets(sizes);
  std::shared_ptr<shm::SharedArray> array;
  if (shareable && !sizes.empty()) array = channel->share(offsets.back());

  std::vector<std::unique_ptr<GradientBuffer>> buffers;
  size_t next_shared = 0;
  for (size_t b = 0; b < members.size(); ++b) {
    if (summed_in_shm[b] && array) {
      const size_t offset = offsets[next_shared++];
      void* data = static_cast<unsigned char*>(shm::Channel::mine(*array)) + offset;
      at::Tensor flat = at::from_blob(data, {numels[b]}, [array](void*) {}, kinds[b].device(at::kCPU));
      buffers.push_back(std::make_unique<SharedBuffer>(group, *channel, array, offset, std::move(flat), members[b],
                                                       options.divisor, options.gradient_as_bucket_view));
    } else if (summed_in_shm[b]) {
      buffers.push_back(
          std::make_unique<InPlaceBuffer>(group, *channel, at::zeros({numels[b]}, kinds[b]), members[b], options.divisor));
    } else {
      buffers.push_back(std::make_unique<CopyingBuffer>(group, at::zeros({numels[b]}, kinds[b]), members[b], options.divisor));
    }
    if (options.for_hook) buffers.back()->hand_to_hook(options.divisor);
  }
  return buffers;
}

c10::intrusive_ptr<c10d::Work> start_average(const ProcessGroupPtr& group, const at::Tensor& tensor, int divisor) {
  const double scale = 1.0 / divisor;
  std::vector<at::Tensor> tensors{tensor};
  if (shm::Channel* channel = channel_of(group); channel != nullptr && channel->serves_scaled_sum(tensors)) {
    return channel->allreduce(tensors, c10d::ReduceOp::SUM, scale);
  }
  tensor.mul_(scale);
  return start_allreduce(group, tensor);
}

}  // namespace ddp::detail
