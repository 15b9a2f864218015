#pragma once
// Options of DistributedDataParallel; names and defaults mirror torch.nn.parallel.DistributedDataParallel.
//
// Thread-safety: a plain value; DDP copies it at construction.
#include <vector>

#include <c10/core/Device.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <ddp/process_group.h>

namespace ddp {

class DDPOptions {
 public:
  // Bucket size in MiB; gradients are reduced one bucket at a time while backward runs.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  // Try caps of 1, 5, 10, 25, 50 and 100 MiB on the live model during the first iterations (after
  // the one bucket rebuild; about 5 iterations per distinct layout), keep the fastest, the ranks
  // agreeing on the timings. bucket_cap_mb is then only the cap of the first two iterations. The
  // choice is in logging_data(). Not with a stateful communication hook (PowerSGD keeps state
  // per bucket).
  TORCH_ARG(bool, bucket_cap_mb_auto) = false;
  // The first bucket (the last layers' gradients) is small so communication starts early.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  // Find parameters the forward did not use and count them as ready (zero contribution).
  TORCH_ARG(bool, find_unused_parameters) = false;
  // Broadcast buffers (e.g. BatchNorm running stats) from rank 0 before every forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  // Make param.grad() a view into the bucket: saves memory and the copy back.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  // The set of used parameters never changes: learn it in the first iteration, then skip the search.
  TORCH_ARG(bool, static_graph) = false;
  // For a single-device module: inputs are moved to device_ids[0] before forward.
  TORCH_ARG(std::vector<c10::Device>, device_ids) = {};
  // Where outputs are moved after forward (default: device_ids[0] when set, else left in place).
  TORCH_ARG(c10::optional<c10::Device>, output_device) = c10::nullopt;
  // The group to reduce over; the default group when null.
  TORCH_ARG(ProcessGroupPtr, process_group) = {};
};

}  // namespace ddp
