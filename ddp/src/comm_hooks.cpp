// The built-in communication hooks and the helpers hook authors use (ddp/comm_hooks.h).
#include "ddp/comm_hooks.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "compat.h"

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
// none): every rank gathers every rank's values (their raw bits, carried as float16 words: a
// gather does no arithmetic) and adds them up in float32,
// in rank order, so that every rank computes exactly the same sum.
FuturePtr bf16_sum_by_allgather(const ProcessGroupPtr& group, const at::Tensor& values) {
  std::vector<at::Tensor> input{values.view(at::kHalf)};  // Gloo moves 16-bit floats, not int16
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < group->getSize(); ++r) output[0].push_back(at::empty_like(input[0]));
  auto gathered = output[0];
  return group->allgather(output, input)->getFuture()->then(
      [gathered, values](c10::ivalue::Future& done) {
        done.value();  // rethrows the collective's error
        // The same bits, read as bfloat16.
        at::Tensor sum = gathered[0].view(at::kBFloat16).to(at::kFloat);
        for (size_t r = 1; r < gathered.size(); ++r) sum.add_(gathered[r].view(at::kBFloat16));
        values.copy_(sum);
        return c10::IValue(values);
      },
      c10::TensorType::get());
}

// Whether this group's backend reduces bfloat16 tensors itself.
bool reduces_bfloat16(const ProcessGroupPtr& group) {
  return group->getBackendName() == "nccl" || compat::kGlooReducesBFloat16;
}

}  // namespace

FuturePtr allreduce_future(const ProcessGroupPtr& group, at::Tensor tensor) {
  std::vector<at::Tensor> tensors{tensor};
  return group->allreduce(tensors)->getFuture()->then(
      [tensor](c10::ivalue::Future& done) {
        done.value();  // rethrows the collective's error
        return c10::IValue(tensor);
      },
      c10::TensorType::get());
}

FuturePtr completed_future(at::Tensor tensor) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  future->markCompleted(c10::IValue(std::move(tensor)));
  return future;
}

CommHook allreduce() {
  return CommHook(
      [](GradBucket& bucket) {
        // The same arithmetic as DDP without a hook: multiply by the rounded 1/world_size.
        bucket.buffer().mul_(1.0 / bucket.world_size());
        return allreduce_future(bucket.process_group(), bucket.buffer());
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
                                                    : bf16_sum_by_allgather(bucket.process_group(), bucket.buffer());
  });
  return CommHook([sum](GradBucket& bucket) { return compress_around(bucket, at::kBFloat16, /*divide=*/true, sum); },
                  "bf16_compress");
}

CommHook fp16_compress_wrapper(CommHook inner) {
  const std::string name = "fp16_compress_wrapper(" + inner.name() + ")";
  auto state = inner.state();
  return CommHook([inner](GradBucket& bucket) { return compress_around(bucket, at::kHalf, /*divide=*/false, inner); },
                  name, state);
}

CommHook bf16_compress_wrapper(CommHook inner) {
  const std::string name = "bf16_compress_wrapper(" + inner.name() + ")";
  auto state = inner.state();
  return CommHook(
      [inner](GradBucket& bucket) { return compress_around(bucket, at::kBFloat16, /*divide=*/false, inner); }, name,
      state);
}

}  // namespace hooks
}  // namespace ddp
