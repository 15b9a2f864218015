// The built-in communication hooks and the helpers hook authors use (ddp/comm_hooks.h).
#include <ddp/comm_hooks.h>

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ddp/wait_collective.h>
#include "ddp/floor/src/backends.h"
#include "ddp/internal/compat/versions.h"
#include "ddp/floor/src/gradient_buffers.h"

namespace ddp {

GradBucket::GradBucket(size_t index, size_t bucket_count, at::Tensor buffer, std::vector<at::Tensor> gradients,
                       std::vector<at::Tensor> parameters, std::vector<int64_t> offsets, ProcessGroupPtr group,
                       std::vector<size_t> parameter_indices)
    : index_(index),
      bucket_count_(bucket_count),
      buffer_(std::move(buffer)),
      gradients_(std::move(gradients)),
      parameters_(std::move(parameters)),
      offsets_(std::move(offsets)),
      group_(std::move(group)),
      parameter_indices_(std::move(parameter_indices)) {}

GradBucket GradBucket::for_parameters(size_t index, size_t bucket_count, at::Tensor buffer,
                                      std::vector<at::Tensor> parameters, ProcessGroupPtr group,
                                      size_t first_parameter_index) {
  std::vector<at::Tensor> gradients;
  std::vector<int64_t> offsets;
  std::vector<size_t> indices;
  int64_t offset = 0;
  for (const at::Tensor& parameter : parameters) {
    TORCH_CHECK(offset + parameter.numel() <= buffer.numel(), "GradBucket::for_parameters: the buffer holds ",
                buffer.numel(), " elements, fewer than the parameters' ", offset + parameter.numel());
    gradients.push_back(buffer.narrow(0, offset, parameter.numel()).view(parameter.sizes()));
    offsets.push_back(offset);
    indices.push_back(first_parameter_index + indices.size());
    offset += parameter.numel();
  }
  return GradBucket(index, bucket_count, std::move(buffer), std::move(gradients), std::move(parameters),
                    std::move(offsets), std::move(group), std::move(indices));
}

namespace detail {

// The average hooks::allreduce() starts: DDP's own bucket storage averaged by the floor as the
// bucket was built to be (in shared memory where it lies), or any other buffer by the same
// arithmetic (gradient_buffers.h).
struct OwnAverage {
  static c10::intrusive_ptr<c10d::Work> start(GradBucket& bucket) {
    if (bucket.own_average_ && bucket.buffer_.is_same(bucket.own_buffer_)) return bucket.own_average_();
    return start_average(bucket.process_group(), bucket.buffer(), bucket.world_size());
  }
};

}  // namespace detail

namespace hooks {
namespace {

// The tensor a finished collective's future holds (c10d futures hold the list of its tensors).
at::Tensor first_tensor(c10::ivalue::Future& future) {
  const c10::IValue& value = future.value();  // rethrows the collective's error
  return value.isTensor() ? value.toTensor() : value.toTensorVector().at(0);
}

// Rounds buffer/world into `dtype`, reduces it with `reduce` (a hook on a bucket whose buffer is
// the compressed tensor), and writes the average back into the bucket's own buffer and dtype.
FuturePtr compress_around(GradBucket& bucket, at::ScalarType dtype, bool divide, const CommHook& reduce) {
  at::Tensor original = bucket.buffer();
  // Divided in the buffer's own precision, in place (the buffer is overwritten with the result
  // anyway), then rounded once: two vectorized passes and one allocation.
  if (divide) original.div_(bucket.world_size());
  at::Tensor compressed = original.to(dtype);
  bucket.set_buffer(compressed);
  FuturePtr reduced = reduce(bucket);
  bucket.set_buffer(original);
  return reduced->then(
      [original](c10::ivalue::Future& done) {
        original.copy_(first_tensor(done));
        return c10::IValue(original);
      },
      c10::TensorType::get());
}

// Sum of a bfloat16 tensor over the ranks without a bfloat16 allreduce (LibTorch 1.13's Gloo has
// none), moving what a ring allreduce moves:
//   1. all-to-all: rank r receives every rank's values of the r-th of W equal slices (raw bits,
//      carried as float16 words: Gloo moves 16-bit floats, and a move does no arithmetic)
//   2. rank r adds its slice's W rows in float32, in rank order, and rounds once to bfloat16
//   3. allgather: every rank receives every slice's sum
// Each element is summed by one rank only, so every rank ends with the same bits. Runs on the hook
// thread and waits there (two collectives issued from a future's callback could interleave with
// the next bucket's differently on different ranks).
FuturePtr bf16_sum_by_reduce_scatter(const ProcessGroupPtr& group, const at::Tensor& values) {
  const int64_t world = group->getSize(), n = values.numel();
  const int64_t slice = (n + world - 1) / world;
  at::Tensor padded = values;
  if (slice * world != n) {
    padded = at::zeros({slice * world}, values.options());
    padded.narrow(0, 0, n).copy_(values);
  }
  at::Tensor rows = at::empty({world, slice}, values.options());
  at::Tensor rows_words = rows.view(at::kHalf).view({world * slice}), padded_words = padded.view(at::kHalf);
  std::vector<int64_t> equal_splits;  // empty: W equal slices
  wait_collective(group->alltoall_base(rows_words, padded_words, equal_splits, equal_splits),
                          "ddp::hooks::bf16_compress: the all-to-all of bfloat16 slices");

  at::Tensor sum = rows[0].to(at::kFloat);
  for (int64_t r = 1; r < world; ++r) sum.add_(rows[r]);
  std::vector<at::Tensor> mine{sum.to(at::kBFloat16).view(at::kHalf)};

  std::vector<std::vector<at::Tensor>> slices(1);
  for (int64_t r = 0; r < world; ++r) slices[0].push_back(at::empty_like(mine[0]));
  wait_collective(group->allgather(slices, mine),
                          "ddp::hooks::bf16_compress: the allgather of the slices' sums");
  for (int64_t r = 0; r < world && r * slice < n; ++r) {
    const int64_t length = std::min(slice, n - r * slice);
    values.narrow(0, r * slice, length).copy_(slices[0][r].view(at::kBFloat16).narrow(0, 0, length));
  }
  return completed_future(values);
}

// Whether this group's backend reduces bfloat16 tensors itself (the shared-memory channel does, in
// float32 with one rounding).
bool reduces_bfloat16(const ProcessGroupPtr& group) {
  return group->getBackendName() == "nccl" || compat::kGlooReducesBFloat16 || detail::transport_of(group) == "gloo+shm";
}

}  // namespace

namespace {
// A future of `tensor` that completes when `work` does, with its error.
FuturePtr tensor_when_done(const c10::intrusive_ptr<c10d::Work>& work, at::Tensor tensor) {
  return work->getFuture()->then(
      [tensor](c10::ivalue::Future& done) {
        done.value();  // rethrows the collective's error
        return c10::IValue(tensor);
      },
      c10::TensorType::get());
}
}  // namespace

FuturePtr allreduce_future(const ProcessGroupPtr& group, at::Tensor tensor) {
  std::vector<at::Tensor> tensors{tensor};
  return tensor_when_done(group->allreduce(tensors), tensor);
}

FuturePtr completed_future(at::Tensor tensor) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  future->markCompleted(c10::IValue(std::move(tensor)));
  return future;
}

CommHook allreduce() {
  return CommHook(
      [](GradBucket& bucket) {
        return tensor_when_done(detail::OwnAverage::start(bucket), bucket.buffer());
      },
      "allreduce");
}

CommHook fp16_compress() {
  const CommHook sum([](GradBucket& bucket) { return allreduce_future(bucket.process_group(), bucket.buffer()); });
  return CommHook([sum](GradBucket& bucket) { return compress_around(bucket, at::kHalf, /*divide=*/true, sum); },
                  "fp16_compress");
}

CommHook bf16_compress() {
  const CommHook sum([](GradBucket& bucket) {
    return reduces_bfloat16(bucket.process_group()) ? allreduce_future(bucket.process_group(), bucket.buffer())
                                                    : bf16_sum_by_reduce_scatter(bucket.process_group(), bucket.buffer());
  });
  return CommHook([sum](GradBucket& bucket) { return compress_around(bucket, at::kBFloat16, /*divide=*/true, sum); },
                  "bf16_compress");
}

CommHook fp16_compress_wrapper(CommHook inner) {
  const std::string name = "fp16_compress_wrapper(" + inner.name() + ")";
  auto state = inner.state();
  return CommHook([inner](GradBucket& bucket) { return compress_around(bucket, at::kHalf, /*divide=*/false, inner); },
                  name, state, inner.settings());
}

CommHook bf16_compress_wrapper(CommHook inner) {
  const std::string name = "bf16_compress_wrapper(" + inner.name() + ")";
  auto state = inner.state();
  return CommHook(
      [inner](GradBucket& bucket) { return compress_around(bucket, at::kBFloat16, /*divide=*/false, inner); }, name,
      state, inner.settings());
}

}  // namespace hooks
}  // namespace ddp
