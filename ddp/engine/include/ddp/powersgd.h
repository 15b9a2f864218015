#pragma once
// PowerSGD gradient compression (Vogels, Karimireddy and Jaggi, NeurIPS 2019), as PyTorch's
// torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook with PowerSGDState's parameters: the
// same numbers for the same inputs (tests/ddp/test_powersgd.cpp checks a recording of PyTorch's hook).
//
//   model.register_comm_hook(ddp::hooks::powersgd(ddp::hooks::PowerSGDOptions()
//       .matrix_approximation_rank(2).start_powerSGD_iter(10)));
//
// Each gradient matrix M (n x m: a parameter's first dimension by the rest) is replaced by P Q^T
// with P (n x r) and Q (m x r), r = matrix_approximation_rank, and only P and Q cross the network:
// with r = 1 a 1024 x 1024 layer sends 2,048 numbers instead of a million. Per bucket:
//   1. Before iteration start_powerSGD_iter: a plain averaging allreduce (PyTorch's warm-up; DDP
//      rebuilds buckets after the first iteration, so compression state starts on the final layout).
//   2. Error feedback: add what compression left out last time to this gradient; keep a copy.
//   3. Gradients that would shrink by more than min_compression_rate are compressed; the others
//      (biases, small or thin tensors) are averaged by one allreduce of their concatenation.
//   4. Q: last iteration's (warm start), or normal random values from a generator seeded from
//      random_seed (the same on every rank); then orthonormalized.
//   5. P = M Q, summed over ranks, orthonormalized (so no division by the world size).
//   6. Q = M^T P, averaged over ranks.
//   7. M ~ P Q^T: the averaged low-rank approximation, written into the bucket.
//   8. Error feedback: remember (gradient + old error) - approximation, this rank's own.
// It runs on DDP's hook thread while backward goes on, and waits for its own collectives there.
//
// The state (iteration count, random generator, and per parameter the error and the warm-start Q)
// is kept per parameter rather than per bucket (PyTorch): a run that resumes from a checkpoint
// starts with DDP's initial bucket layout and rebuilds it after one iteration, and per-parameter
// state fits every layout. save_checkpoint/load_checkpoint given the DDP wrapper carry it.
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include <torch/arg.h>

#include <ddp/comm_hooks.h>
#include <ddp/stateful.h>

namespace ddp::hooks {

// PyTorch's PowerSGDState arguments, names and defaults.
struct PowerSGDOptions {
  // r: the rank of the approximation. Larger is more accurate and sends more (1 to 4 is typical).
  TORCH_ARG(int64_t, matrix_approximation_rank) = 1;
  // Iterations of plain allreduce before compression starts. Must be > 1 with error feedback or
  // warm start (PyTorch's rule: their state must not start on the buckets of the first iteration).
  TORCH_ARG(int64_t, start_powerSGD_iter) = 1000;
  // Compress a gradient only when n*m > (n + m) * r * min_compression_rate.
  TORCH_ARG(double, min_compression_rate) = 2.0;
  // Carry the compression error into the next iteration (convergence close to uncompressed SGD).
  TORCH_ARG(bool, use_error_feedback) = true;
  // Start each iteration's Q from the last one's (one power iteration per step, continued).
  TORCH_ARG(bool, warm_start) = true;
  // Added to the norm when orthonormalizing: 0 divides by a zero norm (NaN) for an all-zero column;
  // PyTorch suggests 1e-8 then.
  TORCH_ARG(double, orthogonalization_epsilon) = 0.0;
  // Seeds the random initial Qs (identically on every rank). 0 to 2^32 - 1, like numpy's seed.
  TORCH_ARG(int64_t, random_seed) = 0;
  // Multiply gradients of the same shape in one batched product (faster for many small layers;
  // a copy each way).
  TORCH_ARG(bool, batch_tensors_with_same_shape) = false;
};

// The hook's state. Obtain it with model.comm_hook_state() (cast) or keep the pointer powersgd_state()
// returns; it is not thread-safe: use it between iterations.
class PowerSGDState : public Stateful {
 public:
  // Throws std::invalid_argument for options PyTorch refuses (see PowerSGDOptions).
  explicit PowerSGDState(PowerSGDOptions options);
  ~PowerSGDState() override;

  const PowerSGDOptions& options() const { return options_; }
  // Iterations seen so far (PyTorch's state.iter): counted on each pass's last bucket.
  int64_t iteration() const { return iteration_; }
  // PyTorch's compression_stats(): elements before and after compression since the start, and
  // their ratio (0 before compression has started).
  struct CompressionStats {
    double compress_rate = 0;
    int64_t numel_before_compression = 0;
    int64_t numel_after_compression = 0;
  };
  CompressionStats compression_stats() const;

  // Keys: "iteration", "rng", "numel_before", "numel_after", "seen", and per parameter index i
  // "error.<i>" and "q.<i>" (the latter with warm start only).
  TensorDict state_dict() const override;
  void load_state_dict(const TensorDict& state) override;

  // The hook: reduces `bucket` in place and returns a completed future of its buffer.
  FuturePtr reduce(GradBucket& bucket);

 private:
  struct BucketMemory;  // a bucket layout's error and Q storage (powersgd.cpp)
  struct CarriedState {  // one parameter's state outside any bucket memory
    at::Tensor error;
    at::Tensor q;
  };

  BucketMemory& memory_for(const GradBucket& bucket);
  std::map<size_t, CarriedState> per_parameter() const;
  uint32_t next_seed();

  PowerSGDOptions options_;
  int64_t iteration_ = 0;
  std::mt19937 rng_;  // numpy's RandomState(random_seed) draws seeds from the same generator
  int64_t numel_before_ = 0;
  int64_t numel_after_ = 0;
  std::map<size_t, std::unique_ptr<BucketMemory>> memories_;  // by bucket index, for the current layout
  std::map<size_t, CarriedState> carried_;                      // by parameter index
  std::set<size_t> seen_;                                       // parameters compressed so far
};

// The hook, with a fresh state (CommHook::state() returns it).
CommHook powersgd(PowerSGDOptions options = {});

}  // namespace ddp::hooks
