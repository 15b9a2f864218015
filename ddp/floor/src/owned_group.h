#pragma once
// The group handle the library owns. Every group that init_process_group, new_process_group and
// split_off make is an OwnedGroup around the backend's own group (Gloo or NCCL). It carries what
// the library must know of a group - how it was made (so DDP can split off a group of its own),
// its timeout, its Gloo device - and, for a Gloo group whose ranks all share one host, the
// shared-memory channel (shm/channel.h) that runs its CPU allreduce (also coalesced), reduce-scatter
// and allgather (into one tensor or a list), all-to-all (alltoall_base), broadcast, barrier, and
// send/recv/recvAnysource without TCP (for ranks on
// several hosts, the same number on each: its allreduce alone, hierarchically). Where it does not,
// a Gloo group still takes _reduce_scatter_base and _allgather_base, which 1.13's Gloo lacks: an
// allreduce of a copy and this rank's piece of it; the list allgather into the output's pieces.
// Everything else forwards to the backend's group unchanged.
//
// 1.13: an OwnedGroup is the c10d::ProcessGroup itself. 2.x: it is the c10d::Backend the
// ProcessGroup dispatches to (ddp/internal/compat/versions.h), for CPU tensors (Gloo) or CUDA tensors (NCCL).
//
// Thread-safety: as c10d's groups. Collectives may be issued from several threads (DDP's training
// and hook threads); next_split() is for the thread that makes groups.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <ddp/process_group.h>

#include "ddp/internal/compat/versions.h"
#include "ddp/internal/diagnostics/debug_level.h"

namespace gloo::transport {
class Device;
}

namespace ddp::detail {

namespace shm {
class Channel;
}

struct GroupRecipe {
  std::string backend;                     // "gloo" or "nccl"
  c10::intrusive_ptr<c10d::Store> store;   // the rendezvous store, without prefix
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  std::string master_host;                 // picks Gloo's network interface
  bool shared_memory = true;               // InitOptions::shared_memory and TORCHDDP_SHM
  bool hierarchical = true;                // InitOptions::hierarchical and TORCHDDP_HIERARCHICAL
  DebugLevel debug = DebugLevel::kOff;     // TORCH_DISTRIBUTED_DEBUG when the group was made
  std::string run_id;                      // the job's (launch_environment.h): in shared-memory names
  std::vector<int> global_ranks;           // each member's rank in the default group (empty: rank i is i)
};

class OwnedGroup final : public compat::CollectiveBackend {
 public:
  OwnedGroup(c10::intrusive_ptr<compat::CollectiveBackend> inner, GroupRecipe recipe,
             std::shared_ptr<::gloo::transport::Device> device, std::unique_ptr<shm::Channel> shm);
  ~OwnedGroup() override;

  const GroupRecipe& recipe() const { return recipe_; }
  const std::shared_ptr<::gloo::transport::Device>& device() const { return device_; }
  // "gloo+shm" when the shared-memory channel serves this group ("gloo+shm hierarchical (2 hosts
  // x 2)" across hosts), else the backend's name.
  std::string transport() const;
  // The n-th group split off this one (0, 1, ...): every rank splits in the same order.
  int next_split() { return splits_.fetch_add(1); }

  // The shared-memory channel that serves this group's CPU collectives, or null. DDP's gradient
  // buffers (gradient_buffers.h) reduce through it directly.
  shm::Channel* shared_memory() const { return shm_.get(); }

  // --- c10d: the shared-memory channel where it serves, else the backend's group -------------
  const std::string getBackendName() const override { return inner_->getBackendName(); }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    inner_->monitoredBarrier(opts, wait_all_ranks);
  }
#if DDP_TORCH_AT_LEAST(2, 0)  // collectives 2.x added to Backend
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override {
    return inner_->allreduce_sparse(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    return inner_->allgather_into_tensor_coalesced(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    return inner_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }
#endif
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }

 private:
  bool gloo() const;  // the backend's group is Gloo's

  c10::intrusive_ptr<compat::CollectiveBackend> inner_;
  GroupRecipe recipe_;
  std::shared_ptr<::gloo::transport::Device> device_;
  std::unique_ptr<shm::Channel> shm_;  // null: every collective goes to inner_
  std::atomic<int> splits_{0};
};

// The library's handle of `group`, or null for a group built with c10d directly.
OwnedGroup* owned(const ProcessGroupPtr& group);

}  // namespace ddp::detail
