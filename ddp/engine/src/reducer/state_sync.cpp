#include "ddp/engine/src/reducer/state_sync.h"

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>

#include <c10/core/DeviceGuard.h>

#include <ddp/wait_collective.h>
#include "ddp/floor/src/backends.h"
#include "ddp/internal/diagnostics/debug_level.h"
#include "ddp/floor/src/desync.h"

namespace ddp::detail {
namespace {

// [count, then per parameter: dtype, ndim, sizes...]
std::vector<int64_t> describe(const std::vector<at::Tensor>& params) {
  std::vector<int64_t> out{static_cast<int64_t>(params.size())};
  for (const auto& param : params) {
    out.push_back(static_cast<int64_t>(param.scalar_type()));
    out.push_back(param.dim());
    for (int64_t size : param.sizes()) out.push_back(size);
  }
  return out;
}

std::string shape_of(const std::vector<int64_t>& meta, size_t& at) {
  std::ostringstream out;
  const auto dtype = static_cast<c10::ScalarType>(meta[at]);
  const int64_t dim = meta[at + 1];
  out << "[";
  for (int64_t d = 0; d < dim; ++d) out << (d ? ", " : "") << meta[at + 2 + d];
  out << "] " << c10::toString(dtype);
  at += 2 + dim;
  return out.str();
}

void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
  wait_collective(work, [what] { return std::string("DistributedDataParallel: ") + what; });
}

}  // namespace

void verify_same_parameters(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
                            const ProcessGroupPtr& group, const char* who) {
  const std::vector<int64_t> mine = describe(params);
  // Rank 0's description, length first.
  at::Tensor length = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong).to(collective_device(group));
  std::vector<at::Tensor> length_list{length};
  wait(group->broadcast(length_list), "the parameter check");
  at::Tensor theirs_tensor = at::zeros({length.cpu().item<int64_t>()}, at::kLong);
  if (group->getRank() == 0) theirs_tensor = at::tensor(mine, at::kLong);
  theirs_tensor = theirs_tensor.to(collective_device(group));
  std::vector<at::Tensor> theirs_list{theirs_tensor};
  wait(group->broadcast(theirs_list), "the parameter check");
  theirs_tensor = theirs_tensor.cpu();
  const std::vector<int64_t> theirs(theirs_tensor.data_ptr<int64_t>(), theirs_tensor.data_ptr<int64_t>() + theirs_tensor.numel());

  // My first mismatch with rank 0; the smallest over all ranks is reported everywhere.
  const int64_t none = std::numeric_limits<int64_t>::max();
  int64_t first = none;
  std::string detail;
  const size_t count = std::min<size_t>(params.size(), static_cast<size_t>(theirs[0]));
  size_t at_mine = 1, at_theirs = 1;
  for (size_t i = 0; i < count && first == none; ++i) {
    const std::string shape_mine = shape_of(mine, at_mine);
    const std::string shape_theirs = shape_of(theirs, at_theirs);
    if (shape_mine != shape_theirs) {
      first = static_cast<int64_t>(i);
      detail = "parameter #" + std::to_string(i) + " ('" + names[i] + "' here) is " + shape_mine +
               " on rank " + std::to_string(group->getRank()) + " but " + shape_theirs + " on rank 0";
    }
  }
  if (first == none && params.size() != static_cast<size_t>(theirs[0])) {
    first = static_cast<int64_t>(count);
    detail = "rank " + std::to_string(group->getRank()) + " has " + std::to_string(params.size()) +
             " parameters but rank 0 has " + std::to_string(theirs[0]);
  }
  at::Tensor smallest = at::tensor({first}, at::kLong).to(collective_device(group));
  std::vector<at::Tensor> smallest_list{smallest};
  c10d::AllreduceOptions min;
  min.reduceOp = c10d::ReduceOp::MIN;
  wait(group->allreduce(smallest_list, min), "the parameter check");
  const int64_t agreed = smallest.cpu().item<int64_t>();
  if (agreed == none) return;
  std::string message = "the model differs across ranks (every rank must build the same model): ";
  if (agreed == first) {
    message += detail;
  } else {
    message += "another rank reports its first mismatch with rank 0 at parameter #" + std::to_string(agreed) +
               (static_cast<size_t>(agreed) < names.size() ? " ('" + names[agreed] + "' here)" : std::string()) +
               "; see that rank's error";
  }
  throw std::invalid_argument(std::string(who) + ": " + message);
}

namespace {

// Every rank's `values` (their lengths may differ), index = rank.
std::vector<std::vector<int64_t>> all_gather_values(const std::vector<int64_t>& values, const ProcessGroupPtr& group,
                                                    const char* what) {
  const int world = group->getSize();
  auto gather = [&](const at::Tensor& mine) {
    std::vector<at::Tensor> input{mine.to(collective_device(group))};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int r = 0; r < world; ++r) output[0].push_back(at::empty_like(input[0]));
    wait(group->allgather(output, input), what);
    std::vector<at::Tensor> out;
    for (auto& t : output[0]) out.push_back(t.cpu());
    return out;
  };
  int64_t longest = 0;
  for (const auto& length : gather(at::tensor({static_cast<int64_t>(values.size())}, at::kLong))) {
    longest = std::max(longest, length.item<int64_t>());
  }
  at::Tensor padded = at::full({longest + 1}, -1, at::kLong);
  padded[0] = static_cast<int64_t>(values.size());
  std::copy(values.begin(), values.end(), padded.data_ptr<int64_t>() + 1);
  std::vector<std::vector<int64_t>> all;
  for (const auto& theirs : gather(padded)) {
    const int64_t* data = theirs.data_ptr<int64_t>();
    all.emplace_back(data + 1, data + 1 + data[0]);
  }
  return all;
}

}  // namespace

void verify_same_buckets(const std::vector<std::pair<int64_t, c10::ScalarType>>& buckets, const ProcessGroupPtr& group) {
  if (group->getSize() == 1) return;
  std::vector<int64_t> mine;
  for (const auto& [numel, dtype] : buckets) {
    mine.push_back(numel);
    mine.push_back(static_cast<int64_t>(dtype));
  }
  const auto all = all_gather_values(mine, group, "the check that every rank built the same buckets");
  if (std::all_of(all.begin(), all.end(), [&](const auto& theirs) { return theirs == all.front(); })) return;
  std::ostringstream message;
  message << "DistributedDataParallel: the ranks built different gradient buckets, so every reduction would "
             "pair mismatched data (do all ranks pass the same DDPOptions, e.g. bucket_cap_mb?): ";
  for (size_t r = 0; r < all.size(); ++r) {
    message << (r ? "; " : "") << "rank " << r << ": " << all[r].size() / 2 << " bucket(s) [";
    for (size_t b = 0; b < all[r].size(); b += 2) {
      message << (b ? ", " : "") << all[r][b] << " " << c10::toString(static_cast<c10::ScalarType>(all[r][b + 1]));
    }
    message << "]";
  }
  throw CollectiveError(message.str());
}

void verify_same_comm_hook(const std::string& hook, const ProcessGroupPtr& group) {
  if (group->getSize() == 1) return;
  const auto all = all_gather_values(std::vector<int64_t>(hook.begin(), hook.end()), group,
                                     "the check that every rank registered the same communication hook");
  if (std::all_of(all.begin(), all.end(), [&](const auto& theirs) { return theirs == all.front(); })) return;
  std::ostringstream message;
  message << "DistributedDataParallel: the ranks registered different communication hooks, so their "
             "reductions would not pair (call register_comm_hook with the same hook and options on every "
             "rank): ";
  for (size_t r = 0; r < all.size(); ++r) {
    const std::string theirs(all[r].begin(), all[r].end());
    message << (r ? "; " : "") << "rank " << r << ": " << (theirs.empty() ? "no hook" : theirs);
  }
  throw CollectiveError(message.str());
}

TensorBroadcaster::TensorBroadcaster(std::vector<at::Tensor> tensors, ProcessGroupPtr group)
    : tensors_(std::move(tensors)), group_(std::move(group)), check_collectives_(debug_level_of(group_) == DebugLevel::kDetail) {
  std::map<std::pair<std::string, int>, size_t> index;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const auto key = std::make_pair(tensors_[i].device().str(), static_cast<int>(tensors_[i].scalar_type()));
    auto [it, inserted] = index.try_emplace(key, groups_.size());
    if (inserted) groups_.emplace_back();
    groups_[it->second].members.push_back(i);
  }
  for (auto& g : groups_) {
    int64_t total = 0;
    for (size_t m : g.members) total += tensors_[m].numel();
    g.flat = at::empty({total}, tensors_[g.members.front()].options().requires_grad(false));
    int64_t offset = 0;
    for (size_t m : g.members) {
      g.views.push_back(g.flat.narrow(0, offset, tensors_[m].numel()).view(tensors_[m].sizes()));
      offset += tensors_[m].numel();
    }
    g.collective = {g.flat};
  }
}

void TensorBroadcaster::broadcast_from(int root) {
  at::NoGradGuard no_grad;
  const bool is_root = group_->getRank() == root;
  c10d::BroadcastOptions options;
  options.rootRank = root;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (auto& g : groups_) {
    if (is_root) {
      for (size_t k = 0; k < g.members.size(); ++k) g.views[k].copy_(tensors_[g.members[k]]);
    }
    if (check_collectives_) {
      verify_same_collective(group_, {CollectiveOp::kBufferBroadcast, static_cast<int64_t>(&g - groups_.data()),
                                      g.flat.scalar_type(), g.flat.numel(), root},
                             "DistributedDataParallel (TORCH_DISTRIBUTED_DEBUG=DETAIL)");
    }
    c10::OptionalDeviceGuard guard(g.flat.device());
    works.push_back(group_->broadcast(g.collective, options));
  }
  for (size_t i = 0; i < groups_.size(); ++i) {
    wait(works[i], "broadcast of parameters/buffers from rank 0");
    if (!is_root) {
      auto& g = groups_[i];
      for (size_t k = 0; k < g.members.size(); ++k) tensors_[g.members[k]].copy_(g.views[k]);
    }
  }
}

}  // namespace ddp::detail
