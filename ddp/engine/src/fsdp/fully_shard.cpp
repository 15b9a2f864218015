// fully_shard's entry points: which parameters one call takes (and the refusals), the registry
// sharded_forward finds a block's unit in, and the tree a root adopts its blocks into.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>

#include <ddp/fully_shard.h>

#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/engine/src/fsdp/sharded_unit.h"
#include "ddp/engine/src/reducer/state_sync.h"
#include "ddp/engine/src/engine_claims.h"

namespace ddp::detail {
namespace {

constexpr const char* kWho = "ddp::fully_shard";

// Every unit of the process, until its module is gone. fully_shard's result may be dropped (a
// block's usually is): the registry keeps the unit for sharded_forward to find.
struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<ShardedUnit>> units;
  // units.size(), read without the mutex: a program that shards nothing (the same model in one
  // process, or under DDP) pays one atomic load per sharded_forward call, not a lock and a scan.
  std::atomic<size_t> count{0};

  void add(std::shared_ptr<ShardedUnit> unit) {
    units.push_back(std::move(unit));
    count.store(units.size(), std::memory_order_release);
  }
  void prune() {
    std::vector<std::shared_ptr<ShardedUnit>> alive;
    for (auto& unit : units) {
      if (unit->module_alive()) alive.push_back(std::move(unit));
    }
    units = std::move(alive);
    count.store(units.size(), std::memory_order_release);
  }
};

Registry& registry() {
  static Registry instance;
  return instance;
}

std::string unit_text(const ShardedUnit& unit) {
  auto module = unit.module();
  std::string text = "'" + (module ? module->name() : std::string("?")) + "'";
  if (!unit.names().empty()) text += " (parameters " + unit.names().front() + ", ...)";
  return text;
}

ShardGroups groups_of(const FSDPOptions& options) {
  ShardGroups groups;
  if (const auto& mesh = options.mesh()) {
    if (mesh->ndim() == 1) {
      groups.shard = mesh->group(0);
    } else if (mesh->ndim() == 2) {
      groups.replicate = mesh->group(0);
      groups.shard = mesh->group(1);
    } else {
      raise<std::invalid_argument>(kWho, "the mesh has " + std::to_string(mesh->ndim()) +
                                             " dimensions; give a 1-D mesh (shard) or a 2-D mesh (replicate, shard)");
    }
    return groups;
  }
  groups.shard = options.process_group() ? options.process_group() : default_group();
  return groups;
}

}  // namespace

std::shared_ptr<ShardedUnit> shard_module(const std::shared_ptr<torch::nn::Module>& module, const FSDPOptions& options) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  reg.prune();
  for (const auto& unit : reg.units) {
    if (unit->is_of(*module)) {
      raise<std::invalid_argument>(kWho, "the module " + unit_text(*unit) +
                                             " is already sharded: call fully_shard once per module");
    }
  }
  std::unordered_set<const torch::nn::Module*> inside;
  for (const auto& child : module->modules(/*include_self=*/false)) inside.insert(child.get());

  // 1. This call's parameters: the module's, less those of blocks sharded inside it before.
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<std::shared_ptr<ShardedUnit>> blocks;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    const at::Tensor& param = item.value();
    std::shared_ptr<ShardedUnit> owner;
    for (const auto& unit : reg.units) {
      if (unit->owns(param)) owner = unit;
    }
    if (owner) {
      auto owner_module = owner->module();
      if (owner_module && inside.count(owner_module.get())) continue;  // a block's, sharded before
      raise<std::invalid_argument>(
          kWho, "parameter '" + item.key() + "' already belongs to the fully_shard call on " + unit_text(*owner) +
                    ", which is not inside this module. Either it is shared between blocks (then shard the blocks' "
                    "common parent instead, so that one call holds it), or this module's parent was sharded "
                    "before it (call fully_shard bottom-up: the blocks first, then their parent)");
    }
    if (!param.is_floating_point()) {
      raise<std::invalid_argument>(kWho, "parameter '" + item.key() + "' has dtype " +
                                             std::string(c10::toString(param.scalar_type())) +
                                             "; only floating-point parameters can be sharded (register integer "
                                             "state as a buffer)");
    }
    if (const char* engine = engine_wrapping(param)) {
      raise<std::invalid_argument>(kWho, "parameter '" + item.key() + "' is already driven by " + engine +
                                             "; a module is trained by DistributedDataParallel or by fully_shard, "
                                             "not both (drop the DistributedDataParallel wrapper)");
    }
    if (!params.empty() && param.scalar_type() != params.front().scalar_type()) {
      raise<std::invalid_argument>(kWho, "parameter '" + item.key() + "' is " +
                                             std::string(c10::toString(param.scalar_type())) + " but '" + names.front() +
                                             "' is " + c10::toString(params.front().scalar_type()) +
                                             ": one fully_shard call shards parameters of one dtype");
    }
    names.push_back(item.key());
    params.push_back(param);
  }
  for (const auto& unit : reg.units) {
    auto unit_module = unit->module();
    if (unit_module && inside.count(unit_module.get())) blocks.push_back(unit);
  }

  // 2. The same parameters (count, shapes, dtypes) on every rank, as DDP checks them: a different
  // model on one rank would otherwise pair the wrong chunks silently. Then the shards.
  ShardGroups groups = groups_of(options);
  if (groups.replicate) verify_same_parameters(params, names, groups.replicate, kWho);
  verify_same_parameters(params, names, groups.shard, kWho);
  auto unit = std::make_shared<ShardedUnit>(module, std::move(names), std::move(params), options, std::move(groups));

  // 3. This unit is the root of the blocks inside it: their backward ends with its.
  auto tree = std::make_shared<ShardTree>(unit);
  for (const auto& block : blocks) {
    block->set_tree(tree);
    tree->add(block);
  }
  tree->add(unit);
  unit->set_tree(tree);
  reg.add(unit);
  return unit;
}

std::shared_ptr<ShardedUnit> unit_of(const torch::nn::Module& module) {
  Registry& reg = registry();
  if (reg.count.load(std::memory_order_acquire) == 0) return nullptr;  // nothing sharded in this process
  std::lock_guard<std::mutex> lock(reg.mutex);
  for (const auto& unit : reg.units) {
    if (unit->is_of(module)) return unit;
  }
  return nullptr;
}

bool is_fully_sharded(const at::Tensor& param) {
  Registry& reg = registry();
  if (reg.count.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lock(reg.mutex);
  for (const auto& unit : reg.units) {
    if (unit->module_alive() && unit->owns(param)) return true;
  }
  return false;
}

void before_forward(ShardedUnit& unit) { unit.before_forward(); }
at::Tensor cast_forward_input(const ShardedUnit& unit, const at::Tensor& input) { return unit.cast_input(input); }
void after_forward(ShardedUnit& unit, const std::vector<at::Tensor>& outputs) { unit.after_forward(outputs); }
void unshard(ShardedUnit& unit) { unit.unshard(); }
void reshard(ShardedUnit& unit) { unit.reshard(); }
const FSDPOptions& options_of(const ShardedUnit& unit) { return unit.options(); }

torch::OrderedDict<std::string, at::Tensor> full_state_dict(ShardedUnit& unit) {
  // The unit and the blocks inside it gathered one at a time, each copied then freed again.
  torch::OrderedDict<std::string, at::Tensor> state;
  auto module = unit.module();
  for (const auto& weak : unit.tree()->units()) {
    auto member = weak.lock();
    if (!member) continue;
    member->unshard();
    for (const auto& item : module->named_parameters(/*recurse=*/true)) {
      if (member->owns(item.value())) state.insert(item.key(), item.value().detach().clone());
    }
    member->reshard();
  }
  // In the module's own order, buffers after.
  torch::OrderedDict<std::string, at::Tensor> ordered;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    if (const at::Tensor* value = state.find(item.key())) ordered.insert(item.key(), *value);
  }
  for (const auto& item : module->named_buffers(/*recurse=*/true)) ordered.insert(item.key(), item.value().detach().clone());
  return ordered;
}

FSDPMemoryStats memory_stats(const ShardedUnit& unit) {
  FSDPMemoryStats stats;
  for (const auto& weak : unit.tree()->units()) {
    auto member = weak.lock();
    if (!member) continue;
    stats.parameter_bytes += member->shard_bytes();
    stats.gradient_bytes += member->shard_grad_bytes();
  }
  stats.peak_unsharded_bytes = unit.tree()->peak_unsharded_bytes();
  return stats;
}

namespace {
// Every unit of the tree (the blocks, then the root) whole for a checkpoint, and back.
class WholeModel final : public ShardedState {
 public:
  explicit WholeModel(std::weak_ptr<ShardedUnit> root) : root_(std::move(root)) {}
  void gather_whole(torch::optim::Optimizer* optimizer) override {
    for (const auto& unit : units()) unit->gather_whole(optimizer);
  }
  void shard_again(torch::optim::Optimizer* optimizer, bool take_whole) override {
    for (const auto& unit : units()) unit->shard_again(optimizer, take_whole);
  }
  std::vector<LocalShard> local_shards() override {
    const auto all = units();
    for (const auto& unit : all) unit->reshard();
    std::vector<LocalShard> shards;
    auto root = root_.lock();
    if (!root) return shards;
    auto module = root->module();
    if (!module) return shards;
    for (const auto& item : module->named_parameters(/*recurse=*/true)) {
      for (const auto& unit : all) {
        const size_t i = unit->index_of(item.value());
        if (i == unit->names().size()) continue;
        const ShardSlot& slot = unit->layout().slots()[i];
        const int64_t first_row = std::min(unit->layout().rank() * slot.chunk_rows, slot.rows);  // an empty chunk: at the end
        shards.push_back({item.key(), item.value(), slot.shape, first_row, slot.local_rows});
        break;
      }
    }
    return shards;
  }
  std::vector<ProcessGroupPtr> groups() const override {
    std::vector<ProcessGroupPtr> groups;
    if (auto root = root_.lock()) {
      const ShardGroups& mine = root->groups();
      groups.push_back(mine.shard);
      if (mine.replicate) groups.push_back(mine.replicate);
    }
    return groups;
  }

 private:
  std::vector<std::shared_ptr<ShardedUnit>> units() const {
    std::vector<std::shared_ptr<ShardedUnit>> all;
    if (auto root = root_.lock()) {
      for (const auto& weak : root->tree()->units()) {
        if (auto unit = weak.lock()) all.push_back(unit);
      }
    }
    return all;
  }
  std::weak_ptr<ShardedUnit> root_;
};
}  // namespace

std::shared_ptr<ShardedState> whole_model_state(const std::shared_ptr<ShardedUnit>& unit) {
  return std::make_shared<WholeModel>(unit);
}

void set_requires_gradient_sync(ShardedUnit& unit, bool sync) {
  if (!unit.tree()->is_root(&unit)) {
    unit.set_requires_gradient_sync(sync);
    return;
  }
  for (const auto& weak : unit.tree()->units()) {
    if (auto member = weak.lock()) member->set_requires_gradient_sync(sync);
  }
}

}  // namespace ddp::detail
