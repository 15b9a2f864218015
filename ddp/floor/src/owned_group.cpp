// The group handle the library owns (owned_group.h): forwarding to the backend's group, except
// where the shared-memory channel serves the collective.
#include "ddp/floor/src/owned_group.h"

#include <functional>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include "ddp/floor/src/shm/channel.h"

namespace ddp::detail {

OwnedGroup::OwnedGroup(c10::intrusive_ptr<compat::CollectiveBackend> inner, GroupRecipe recipe,
                       std::shared_ptr<::gloo::transport::Device> device, std::unique_ptr<shm::Channel> shm)
    : compat::CollectiveBackend(recipe.rank, recipe.size),
      inner_(std::move(inner)),
      recipe_(std::move(recipe)),
      device_(std::move(device)),
      shm_(std::move(shm)) {}

OwnedGroup::~OwnedGroup() = default;

std::string OwnedGroup::transport() const { return inner_->getBackendName() + (shm_ ? "+" + shm_->name() : ""); }

// --- the collectives shared memory runs when every tensor is a dense CPU one it takes ------------

c10::intrusive_ptr<c10d::Work> OwnedGroup::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  // Several tensors here mean one per device (c10d's old multi-device form): Gloo's business.
  if (shm_ && tensors.size() == 1 && shm_->serves_allreduce(tensors, opts.reduceOp)) {
    return shm_->allreduce(tensors, opts.reduceOp);
  }
  return inner_->allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> OwnedGroup::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceCoalescedOptions& opts) {
  if (shm_ && shm_->serves_allreduce(tensors, opts.reduceOp)) return shm_->allreduce(tensors, opts.reduceOp);
  return inner_->allreduce_coalesced(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> OwnedGroup::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  if (shm_ && shm_->serves(tensors) && opts.rootTensor == 0) return shm_->broadcast(tensors, static_cast<int>(opts.rootRank));
  return inner_->broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> OwnedGroup::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) {
  if (shm_ && shm_->serves_allgather(outputs, inputs)) return shm_->allgather(outputs, inputs);
  return inner_->allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> OwnedGroup::barrier(const c10d::BarrierOptions& opts) {
  if (shm_ && shm_->serves_barrier()) return shm_->barrier();
  return inner_->barrier(opts);
}

// --- the collectives into or out of one tensor: shared memory, else Gloo through what it has ------

namespace {

// A Work that completes once `inner` has and `then` (a local step on its result) has run after it,
// on the thread that completed `inner`, so the caller goes on meanwhile as with any collective.
// wait() is inner's (bounded by the group's timeout, failing with the backend's words), then the
// local step's.
class ThenWork final : public c10d::Work {
 public:
  ThenWork(c10::intrusive_ptr<c10d::Work> inner, std::function<void()> then, std::vector<at::Tensor> result,
           c10d::OpType type)
      : c10d::Work(-1, type), inner_(std::move(inner)), result_(std::move(result)) {
    future_ = inner_->getFuture()->then(
        [then = std::move(then), result = result_](c10::ivalue::Future& done) {
          done.value();  // rethrows inner's failure: this future fails with it, and `then` does not run
          then();
          return c10::IValue(result);
        },
        c10::ListType::create(c10::TensorType::get()));
  }
  bool isCompleted() override { return future_->completed(); }
  bool wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    future_->wait();
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return result_; }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// What _reduce_scatter_base and _allgather_base take, checked where Gloo would not (its own
// checks, of dtypes and devices, follow): `whole` holds the group's size times `piece`'s elements.
void check_pieces(const at::Tensor& piece, const at::Tensor& whole, int size, const char* who, const char* names) {
  TORCH_CHECK(piece.defined() && whole.defined() && piece.is_contiguous() && whole.is_contiguous(), who,
              ": the tensors must be defined and contiguous");
  TORCH_CHECK(whole.numel() == piece.numel() * size && whole.scalar_type() == piece.scalar_type(), who, ": ", names,
              " the group's size (", size, ") times the other's elements, of its dtype; it holds ", whole.numel(),
              " for ", piece.numel());
}

// Piece r of `whole` read as pieces of `piece`'s shape, one after the other.
at::Tensor piece_of(const at::Tensor& whole, int r, const at::Tensor& piece) {
  const int64_t n = piece.numel();
  return whole.view(-1).narrow(0, r * n, n).view(piece.sizes());
}

}  // namespace

bool OwnedGroup::gloo() const { return inner_->getBackendName() == "gloo"; }

c10::intrusive_ptr<c10d::Work> OwnedGroup::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::ReduceScatterOptions& opts) {
  if (shm_ && shm_->serves_reduce_scatter(output, input, opts.reduceOp)) {
    return shm_->reduce_scatter(output, input, opts.reduceOp);
  }
  if (!gloo()) return inner_->_reduce_scatter_base(output, input, opts);
  // Gloo has no reduce-scatter into one tensor in every LibTorch (1.13's has none): the whole input
  // reduced in a copy (Gloo's allreduce; the caller's input stays as it was), then this rank's piece.
  check_pieces(output, input, getSize(), "_reduce_scatter_base", "input must hold");
  std::vector<at::Tensor> whole{input.clone()};
  c10d::AllreduceOptions all;
  all.reduceOp = opts.reduceOp;
  all.timeout = opts.timeout;
  auto reduced = inner_->allreduce(whole, all);
  const int rank = getRank();
  return c10::make_intrusive<ThenWork>(
      reduced, [output, whole = whole[0], rank]() mutable { output.copy_(piece_of(whole, rank, output)); },
      std::vector<at::Tensor>{output}, c10d::OpType::_REDUCE_SCATTER_BASE);
}

c10::intrusive_ptr<c10d::Work> OwnedGroup::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& opts) {
  if (shm_ && shm_->serves_allgather_into(output, input)) return shm_->allgather_into(output, input);
  if (!gloo()) return inner_->_allgather_base(output, input, opts);
  // Gloo's list form (1.13's Gloo has no _allgather_base), each rank's piece received straight
  // into its place in `output`.
  check_pieces(input, output, getSize(), "_allgather_base", "output must hold");
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < getSize(); ++r) outputs[0].push_back(piece_of(output, r, input));
  std::vector<at::Tensor> inputs{input};
  return inner_->allgather(outputs, inputs, opts);
}

// --- the rest: the backend's group, but all-to-all and point to point where shared memory serves ---

c10::intrusive_ptr<c10d::Work> OwnedGroup::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  return inner_->reduce(tensors, opts);
}
c10::intrusive_ptr<c10d::Work> OwnedGroup::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& opts) {
  return inner_->allgather_coalesced(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> OwnedGroup::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  return inner_->gather(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> OwnedGroup::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& opts) {
  return inner_->scatter(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> OwnedGroup::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                          std::vector<std::vector<at::Tensor>>& inputs,
                                                          const c10d::ReduceScatterOptions& opts) {
  return inner_->reduce_scatter(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> OwnedGroup::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_split_sizes,
                                                         std::vector<int64_t>& input_split_sizes,
                                                         const c10d::AllToAllOptions& opts) {
  if (shm_ && shm_->serves_all_to_all(output, input, output_split_sizes, input_split_sizes)) {
    return shm_->all_to_all(output, input, output_split_sizes, input_split_sizes);
  }
  return inner_->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
}
c10::intrusive_ptr<c10d::Work> OwnedGroup::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& opts) {
  return inner_->alltoall(outputs, inputs, opts);
}
// Point to point: through the channel's mailbox on one host (it moves messages on a thread of its
// own, so a waiting receive holds up no collective), else the backend's.
c10::intrusive_ptr<c10d::Work> OwnedGroup::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  if (shm_ && shm_->serves_point_to_point(tensors)) return shm_->send(tensors[0], dst_rank, tag);
  return inner_->send(tensors, dst_rank, tag);
}
c10::intrusive_ptr<c10d::Work> OwnedGroup::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  if (shm_ && shm_->serves_point_to_point(tensors)) return shm_->recv(tensors[0], src_rank, tag);
  return inner_->recv(tensors, src_rank, tag);
}
c10::intrusive_ptr<c10d::Work> OwnedGroup::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  if (shm_ && shm_->serves_point_to_point(tensors)) return shm_->recv(tensors[0], -1, tag);
  return inner_->recvAnysource(tensors, tag);
}

OwnedGroup* owned(const ProcessGroupPtr& group) {
  if (!group) return nullptr;
  return dynamic_cast<OwnedGroup*>(compat::backend_of(group).get());
}

}  // namespace ddp::detail
