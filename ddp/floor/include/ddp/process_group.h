#pragma once
// Process groups: rendezvous (env://, tcp://, file://), the default group, and the few
// collectives a training script calls directly. Mirrors torch.distributed's free functions.
//
// Thread-safety: init_process_group/destroy_process_group are for one thread (the program's
// set-up); a group and the free collectives may be used from any thread, each collective issued
// in the same order on every rank (two threads issuing collectives on one group must agree on an
// order themselves, as with PyTorch).
#include <chrono>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <ddp/launch_environment.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace ddp {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

// PyTorch's default for rendezvous and collectives.
inline constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(30);

// The fields of PyTorch's init_process_group; options added since chain like DDPOptions:
//   ddp::InitOptions{"gloo", "env://"}.shared_memory(false)
struct InitOptions {
  InitOptions(std::string backend = "auto", std::string init_method = "env://")
      : backend(std::move(backend)), init_method(std::move(init_method)) {}
  // "gloo", "nccl", or "auto" (nccl when CUDA is available and LibTorch has NCCL, else gloo).
  std::string backend;
  // "env://" (MASTER_ADDR/MASTER_PORT), "tcp://host:port", or "file:///path/to/shared/file".
  std::string init_method;
  // -1: from the launcher's variables (launch_environment.h: torchrun/ddprun, Slurm, Open MPI; a
  // world of one, with a notice, when there is no launcher).
  int rank = -1;
  int world_size = -1;
  // true: no launcher is an error instead of a world of one.
  bool require_launcher = false;
  // Applies to the rendezvous and to every collective: a dead peer becomes an error, not a hang.
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Gloo groups whose ranks all run on this host reduce, broadcast and gather CPU tensors through
  // shared memory instead of TCP (the same results; README, "Shared memory"). false, or
  // TORCHDDP_SHM=0 in the environment of any rank, keeps every collective on Gloo.
  TORCH_ARG(bool, shared_memory) = true;
  // Gloo groups whose ranks run on several hosts, the same number (two or more) on each, allreduce
  // CPU tensors hierarchically: over shared memory inside each host, over Gloo across the hosts
  // (README, "Several hosts"). false, or TORCHDDP_HIERARCHICAL=0 in the environment of any rank,
  // keeps such groups on Gloo alone; shared_memory(false) does too.
  TORCH_ARG(bool, hierarchical) = true;
};

// Creates a process group, makes it the default group and returns it. On POSIX, also ignores
// SIGPIPE where the program left it at its default (as Python does for PyTorch's ranks): Gloo
// writes to its sockets without guarding against it, so a peer that died would otherwise end this
// process silently, before any error could name that peer. With glibc, also asks malloc to keep
// freed blocks below 32 MiB for reuse, up to 64 MiB free, instead of handing them back to the
// kernel and faulting them in again the next step (DDP's resnet_b32 step: 25.4-26.1 ms instead of
// 29.5-31.3; fully_shard's: 4 ms less); TORCHDDP_MALLOC_TUNING=0, or a malloc setting of your own
// (GLIBC_TUNABLES' glibc.malloc.*, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), keeps glibc as
// it is.
ProcessGroupPtr init_process_group(const InitOptions& options = {});
// Creates a process group without touching the default group.
ProcessGroupPtr new_process_group(const InitOptions& options);

// torch.distributed.new_group(): a group over some or all ranks of a group, with connections of
// its own, whose collectives never pair with the parent's.
//   ddp::ProcessGroupPtr evens = ddp::new_group(ddp::NewGroupOptions().ranks({0, 2}));  // null on ranks 1, 3
struct NewGroupOptions {
  // The group whose ranks and rendezvous the new group shares; null: the default group.
  TORCH_ARG(ProcessGroupPtr, parent) = {};
  // Ranks of the parent that form the group (in any order: group rank i is the i-th smallest, as
  // PyTorch sorts them); empty: every rank of the parent.
  TORCH_ARG(std::vector<int>, ranks) = {};
  // As InitOptions::shared_memory, for the new group only (false: Gloo alone, e.g. as a baseline).
  // Members that share a host reduce through shared memory as a whole group does.
  TORCH_ARG(bool, shared_memory) = true;
};
// Collective: every rank of the parent calls it, in the same order, members or not; a rank outside
// `ranks` gets null (and a null group passed to a collective means the default group). Throws
// std::invalid_argument on every rank for ranks out of the parent's range or repeated, for lists
// that differ across the parent's ranks, and for a parent built with c10d directly (there is no
// rendezvous to make another group from).
ProcessGroupPtr new_group(const NewGroupOptions& options = {});
// torch.distributed.new_subgroups(group_size): the default group cut into blocks of `group_size`
// consecutive ranks ({0..n-1}, {n..2n-1}, ...); returns this rank's block. Collective over the
// default group; group_size must divide its size.
ProcessGroupPtr new_subgroups(int group_size);
// The default group's rank of `group`'s rank `group_rank` (torch.distributed.get_global_rank), and
// back (get_group_rank: -1 when that rank is not in `group`). `dst`, `src` and recv()'s result in
// this library's collectives are ranks of the group they run on (PyTorch's group_dst/group_src).
int get_global_rank(const ProcessGroupPtr& group, int group_rank);
int get_group_rank(const ProcessGroupPtr& group, int global_rank);

bool is_initialized();
// The default group; throws when init_process_group has not been called.
ProcessGroupPtr default_group();
// Drops the default group (its workers shut down once the last reference goes).
void destroy_process_group();

// A collective that failed: a peer rank died, hung past the group's timeout, or ran a different
// sequence of collectives. Thrown by every blocking call below and by DDP's own collectives.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Free functions on a group (the default group when `group` is null). All block until done and
// throw CollectiveError when the collective fails. Each first checks, with a small fixed-size
// exchange, that every rank is running the same collective with the same size and dtype (and
// root): ranks that disagree all get a CollectiveError naming what each rank ran, instead of the
// backend pairing mismatched buffers. (Mixing these with raw c10d calls on the same group
// defeats that check: keep to one or the other on a group.)
int get_rank(const ProcessGroupPtr& group = {});
// How `group` (the default group when null) moves data: "gloo+shm" (its ranks share this host and
// its CPU collectives go through shared memory), "gloo+shm hierarchical (2 hosts x 2)" (its ranks
// run on 2 hosts, 2 on each, and its CPU allreduce goes through shared memory inside each host and
// Gloo across them), "gloo", "nccl"; for a group built with c10d directly, its backend's name.
std::string transport(const ProcessGroupPtr& group = {});
int get_world_size(const ProcessGroupPtr& group = {});
void barrier(const ProcessGroupPtr& group = {});
void all_reduce(at::Tensor& tensor, c10d::ReduceOp op = c10d::ReduceOp::SUM,
                const ProcessGroupPtr& group = {});

namespace detail {
template <typename T>
inline constexpr bool kReducibleNumber = std::is_arithmetic_v<T> && !std::is_same_v<T, bool>;
// The numbers' collective: floating-point values travel as double, integers as int64.
void all_reduce_numbers(std::vector<double>& values, c10d::ReduceOp op, const ProcessGroupPtr& group);
void all_reduce_numbers(std::vector<int64_t>& values, c10d::ReduceOp op, const ProcessGroupPtr& group);
}  // namespace detail

// The same for plain numbers (double, float, int64_t, size_t, ...) and vectors of them, in place,
// without packing them into a tensor first: a count of correct predictions or a loss total summed
// over the ranks. Floating-point values are reduced in double, integers exactly in int64 (an
// unsigned value above INT64_MAX is refused with std::out_of_range); one collective per call.
//   size_t correct = ...; double loss_sum = ...;
//   ddp::all_reduce(correct);                              // SUM over the ranks
//   std::vector<double> sums{loss_sum, double(seen)};  ddp::all_reduce(sums);
template <typename T, std::enable_if_t<detail::kReducibleNumber<T>, int> = 0>
void all_reduce(std::vector<T>& values, c10d::ReduceOp op = c10d::ReduceOp::SUM, const ProcessGroupPtr& group = {}) {
  using Wire = std::conditional_t<std::is_floating_point_v<T>, double, int64_t>;
  std::vector<Wire> wire;
  wire.reserve(values.size());
  for (const T& value : values) {
    if constexpr (std::is_unsigned_v<T> && sizeof(T) >= sizeof(int64_t)) {
      if (value > static_cast<T>(std::numeric_limits<int64_t>::max())) {
        throw std::out_of_range("ddp::all_reduce: " + std::to_string(value) +
                                " does not fit the int64 the ranks exchange integers in (at most 2^63 - 1)");
      }
    }
    wire.push_back(static_cast<Wire>(value));
  }
  detail::all_reduce_numbers(wire, op, group);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<T>(wire[i]);
}
template <typename T, std::enable_if_t<detail::kReducibleNumber<T>, int> = 0>
void all_reduce(T& value, c10d::ReduceOp op = c10d::ReduceOp::SUM, const ProcessGroupPtr& group = {}) {
  std::vector<T> values{value};
  all_reduce(values, op, group);
  value = values[0];
}

void broadcast(at::Tensor& tensor, int src = 0, const ProcessGroupPtr& group = {});
// Rank `src`'s `bytes` on every rank: read on `src`, replaced on the others (two broadcasts, the
// length then the bytes, on the group's collective_device()). For serialized state.
void broadcast_bytes(std::string& bytes, int src = 0, const ProcessGroupPtr& group = {});
// Returns world_size tensors shaped like `tensor`, index r holding rank r's value.
std::vector<at::Tensor> all_gather(const at::Tensor& tensor, const ProcessGroupPtr& group = {});

// The rest of torch.distributed's collectives, with PyTorch's semantics. Tensors are contiguous;
// `dst`, `src` and recv()'s result are ranks of `group` (PyTorch's group_dst/group_src; see
// get_global_rank). W below is the group's size.
// `input` (W times `output`'s elements, rank r's chunk r-th along the flattened tensor) reduced
// by `op` across the ranks; rank r receives chunk r in `output`.
void reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input, c10d::ReduceOp op = c10d::ReduceOp::SUM,
                           const ProcessGroupPtr& group = {});
// Every rank's `input` into `output` (W times its elements), rank r's at chunk r.
void all_gather_into_tensor(at::Tensor& output, const at::Tensor& input, const ProcessGroupPtr& group = {});
// Rank r's i-th block of `input` (along dim 0) becomes rank i's r-th block of `output`. Empty split
// sizes: W equal blocks; otherwise rows per block, summing to the tensor's first dimension.
void all_to_all_single(at::Tensor& output, const at::Tensor& input, std::vector<int64_t> output_split_sizes = {},
                       std::vector<int64_t> input_split_sizes = {}, const ProcessGroupPtr& group = {});
// The reduction of every rank's `tensor`, in `tensor` on rank `dst` (the others' are left as
// the backend leaves them, as in PyTorch: do not read them).
void reduce(at::Tensor& tensor, int dst = 0, c10d::ReduceOp op = c10d::ReduceOp::SUM, const ProcessGroupPtr& group = {});
// On `dst`: every rank's `tensor`, index r holding rank r's; empty on the other ranks.
std::vector<at::Tensor> gather(const at::Tensor& tensor, int dst = 0, const ProcessGroupPtr& group = {});
// Rank `src`'s scatter_list[r] (W tensors shaped like `tensor`, read on src only) into rank r's `tensor`.
void scatter(at::Tensor& tensor, const std::vector<at::Tensor>& scatter_list, int src = 0,
             const ProcessGroupPtr& group = {});
// Point to point: blocking send to `dst`; blocking receive from `src` (-1: any rank), returning
// the rank it came from. A send pairs with the receive of the same tag on its destination.
void send(const at::Tensor& tensor, int dst, const ProcessGroupPtr& group = {}, int tag = 0);
int recv(at::Tensor& tensor, int src = -1, const ProcessGroupPtr& group = {}, int tag = 0);
// The same, returning at once; wait() on the Work (ddp::wait_collective bounds and names it).
// `tensor` must stay alive and untouched until then.
c10::intrusive_ptr<c10d::Work> isend(const at::Tensor& tensor, int dst, const ProcessGroupPtr& group = {}, int tag = 0);
c10::intrusive_ptr<c10d::Work> irecv(at::Tensor& tensor, int src = -1, const ProcessGroupPtr& group = {}, int tag = 0);
// A barrier that names every rank that did not arrive within `timeout` (zero: the group's) in a
// CollectiveError on rank 0, the ranks that did arrive get an error too (torch.distributed's
// monitored_barrier with wait_all_ranks=True). Gloo groups only, as in PyTorch.
void monitored_barrier(const ProcessGroupPtr& group = {}, std::chrono::milliseconds timeout = {});

// This process's rank on its host, from the launcher (launch_environment.h: LOCAL_RANK,
// SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK; 0 without one): which device it should use.
int local_rank();

// The device a tensor must be on for a collective on `group` (the default group when null): the
// CPU for Gloo, this process's GPU (cuda:<local_rank() % device count>) for NCCL, which moves CUDA
// tensors only. The one rule every collective on small host-side values follows.
c10::Device collective_device(const ProcessGroupPtr& group = {});

// The NCCL release this library was built against, as "2.30.7" (its nccl.h: the one beside the
// LibTorch that has c10d's ProcessGroupNCCL), or "" when it was built without the NCCL backend
// (a CPU-only LibTorch; backend "nccl" is then refused). Needs no GPU: a CUDA build on a
// machine without one still says which NCCL it links.
std::string nccl_version();

}  // namespace ddp
