#pragma once
// Seeing where a DDP job's time goes: model.logging_data() (PyTorch's DDPLoggingData, the fields
// that apply here), the TORCHDDP_TIMELINE Chrome trace (Horovod's HOROVOD_TIMELINE), and
// TimelineSpan to mark your own steps in it.
//
//   auto data = model.logging_data();
//   std::cout << data.avg_backward_comm_time / 1e6 << " ms communicating per step\n";
//
//   TORCHDDP_TIMELINE=/tmp/trace.json ./train     # /tmp/trace.rank0.json, /tmp/trace.rank1.json, ...
//   { ddp::TimelineSpan span("optimizer.step"); optimizer.step(); }
//
// Costs: the timings are taken on sampled iterations only (the first 10, then every 100th, as
// PyTorch does), a few clock reads each; with a timeline, on every iteration.
//
// Thread-safety: logging_data() is for the training thread, between iterations.
#include <cstdint>
#include <string>
#include <vector>

namespace ddp {

struct DDPLoggingData {
  // --- the job and the model ---
  int world_size = 0;
  int rank = 0;
  std::string backend_name;               // "gloo+shm" (shared memory on one host), "gloo", "nccl"
  std::string module_name;                // the wrapped module's name()
  int64_t num_parameter_tensors = 0;      // reduced ones (requiring gradients)
  int64_t total_parameter_size_bytes = 0;
  // --- the options ---
  int64_t bucket_cap_bytes = 0;           // in effect now (after autotuning, the chosen one)
  int64_t first_bucket_cap_bytes = 0;
  bool bucket_cap_mb_auto = false;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
  bool broadcast_buffers = true;
  std::string comm_hook;                  // the registered hook's name, "" without one
  bool join_uneven_inputs = false;        // the last iteration ran under ddp::Join
  // --- the buckets (bytes each, in launch order) ---
  std::vector<int64_t> bucket_sizes;          // as first built
  bool has_rebuilt_buckets = false;
  std::vector<int64_t> rebuilt_bucket_sizes;  // after the one rebuild in observed gradient order
  // Autotuning (bucket_cap_mb_auto): each candidate cap in MiB and its step time in ns (the
  // slowest rank's), in the order tried; empty until it finished.
  std::vector<double> autotune_candidates_mb;
  std::vector<int64_t> autotune_step_times;
  // --- per iteration ---
  int64_t iteration = 0;                  // synchronized backward passes so far
  int64_t unused_parameter_size = 0;      // bytes of parameters no rank produced a gradient for, last iteration
  // Averages over the sampled iterations, in nanoseconds (0 before the first):
  int64_t avg_forward_compute_time = 0;   // forward()
  int64_t avg_backward_compute_time = 0;  // end of forward -> last gradient ready
  int64_t avg_backward_comm_time = 0;     // first bucket launched -> last bucket reduced
  int64_t avg_backward_compute_comm_overlap_time = 0;  // first bucket launched -> last gradient ready
  int64_t sampled_iterations = 0;
};

// Marks a span of your own (an optimizer step, data loading) in the TORCHDDP_TIMELINE trace, from
// construction to destruction, on the "program" row. Costs nothing without a timeline.
class TimelineSpan {
 public:
  explicit TimelineSpan(std::string name);
  ~TimelineSpan();
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;

 private:
  std::string name_;
  int64_t start_ns_ = -1;  // -1: no timeline
};

}  // namespace ddp
