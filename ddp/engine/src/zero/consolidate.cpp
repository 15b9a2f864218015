// ZeroRedundancyOptimizer's whole state: consolidate_state_dict gathers every rank's shard on one
// rank; save writes it in Optim's own format (a plain Optim over the same groups reads it); load
// reads such a state and keeps this rank's shard. Shards travel as Optim's own serialization of
// the shard optimizer, so whatever state type Optim has, it arrives intact (PyTorch pickles the
// local state_dict the same way, _broadcast_object).
#include <ddp/zero_redundancy_optimizer.h>

#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "ddp/internal/compat/versions.h"
#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/engine/src/optimizer/group_options.h"
#include "ddp/internal/compat/optimizer_state.h"
#include "ddp/engine/src/zero/who.h"

namespace ddp {

namespace {

using detail::kZeroWho;

std::string serialized(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

// Moves every state entry of `from` to `to`; both are over the same parameter tensors, so an
// entry's key (its parameter's address) is the same in both.
void move_states(torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
  for (auto& entry : from.state()) to.state()[entry.first] = std::move(entry.second);
  from.state().clear();
}

}  // namespace

// An Optim over every parameter group, with the groups' current options and no state.
std::unique_ptr<torch::optim::Optimizer> ZeroRedundancyOptimizerBase::whole_state_optimizer() const {
  return make_optimizer_(std::vector<torch::optim::OptimizerParamGroup>(param_groups_.begin(), param_groups_.end()));
}

void ZeroRedundancyOptimizerBase::consolidate_state_dict(int to) {
  require_overlap_initialized("consolidate_state_dict");
  if (to < 0 || to >= world_size_) {
    raise<std::invalid_argument>(kZeroWho, "consolidate_state_dict(to=" + std::to_string(to) +
                                               "): `to` must be a rank of the group, 0 to " +
                                               std::to_string(world_size_ - 1));
  }
  // The options a scheduler set are part of the state (PyTorch syncs them first too).
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    local_->param_groups()[g].set_options(param_groups_[g].options().clone());
  }
  // Rank by rank: the owner serializes its shard optimizer, `to` reads it into an Optim over the
  // same shard (same parameters, same order: the partition is the same everywhere) and takes its
  // entries. Every rank takes part in every broadcast (a broadcast from each owner, not a gather:
  // PyTorch does the same).
  std::unique_ptr<torch::optim::Optimizer> whole = rank_ == to ? whole_state_optimizer() : nullptr;
  for (int r = 0; r < world_size_; ++r) {
    std::string bytes = r == rank_ ? serialized(*local_) : std::string();
    if (r != to) broadcast_bytes(bytes, r, group_);
    if (rank_ != to) continue;
    auto shard = make_optimizer_(groups_of_rank(r));
    torch::serialize::InputArchive archive;
    archive.load_from(bytes.data(), bytes.size());
    shard->load(archive);
    move_states(*shard, *whole);
  }
  consolidated_ = std::move(whole);
  consolidated_at_ = steps_;
}

void ZeroRedundancyOptimizerBase::save(torch::serialize::OutputArchive& archive) const {
  require_overlap_initialized("state_dict (save)");
  if (!consolidated_) {
    throw std::runtime_error("Optimizer state has not been consolidated on this rank. Please call "
                             "`consolidate_state_dict(to=" + std::to_string(rank_) +
                             ")` on all ranks beforehand if you meant to save the global state.");
  }
  if (consolidated_at_ != steps_) {
    raise<std::runtime_error>(kZeroWho, "the state was consolidated after step " + std::to_string(consolidated_at_) +
                                            " and step() has run " + std::to_string(steps_ - consolidated_at_) +
                                            " time(s) since: call consolidate_state_dict(to=" + std::to_string(rank_) +
                                            ") on all ranks again right before saving");
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    consolidated_->param_groups()[g].set_options(param_groups_[g].options().clone());
  }
  consolidated_->save(archive);
}

// Reads the whole state into an Optim over every group (Optim's load checks the group sizes and
// maps saved entries to parameters by position), then keeps this rank's parameters' entries, each
// moved to its parameter's device. As PyTorch's load_state_dict (and unlike LibTorch's
// Optimizer::load), the saved groups' options replace the ones the optimizer was built with, on
// this wrapper and on its local optimizer (PyTorch's _sync_param_groups).
void ZeroRedundancyOptimizerBase::load(torch::serialize::InputArchive& archive) {
  require_overlap_initialized("load_state_dict (load)");
  auto whole = whole_state_optimizer();
  whole->load(archive);
  auto options = detail::saved_group_options(archive, param_groups_);
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    local_->param_groups()[g].set_options(options[g]->clone());
    param_groups_[g].set_options(std::move(options[g]));
  }
  auto& loaded = whole->state();
  auto& mine = local_->state();
  mine.clear();
  for (const auto& param : params_of(rank_)) {
    const auto found = loaded.find(compat::optimizer_state_key(loaded, param));
    if (found == loaded.end()) continue;  // never stepped when saved: no state yet
    detail::move_state_tensors(*found->second, param.device());
    mine[compat::optimizer_state_key(mine, param)] = std::move(found->second);
  }
  consolidated_.reset();  // a snapshot of the state before the load
}

std::function<void()> ZeroRedundancyOptimizerBase::keep_for_restore() {
  struct Kept {
    detail::OptimizerCopy local;
    std::unique_ptr<torch::optim::Optimizer> consolidated;
    int64_t consolidated_at;
  };
  auto kept = std::make_shared<Kept>(Kept{detail::OptimizerCopy(*local_), nullptr, consolidated_at_});
  if (consolidated_) {  // load() drops it: a copy of its own, over the same parameters
    kept->consolidated = whole_state_optimizer();
    detail::OptimizerCopy(*consolidated_).restore(*kept->consolidated);
  }
  return [this, kept] {
    kept->local.restore(*local_);
    consolidated_ = std::move(kept->consolidated);
    consolidated_at_ = kept->consolidated_at;
  };
}

}  // namespace ddp
