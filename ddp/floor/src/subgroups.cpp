// Groups over some or all ranks of a group (torch.distributed's new_group, new_subgroups,
// get_global_rank): each is a split of its parent (backends.h) with its own connections.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <ddp/process_group.h>

#include "ddp/floor/src/backends.h"
#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/floor/src/owned_group.h"
#include "ddp/internal/diagnostics/text.h"

namespace ddp {
namespace {

std::string list(const std::vector<int>& ranks) {
  return "{" + detail::join_limited(ranks, 16, ", ", [](int rank) { return std::to_string(rank); }) + "}";
}

// The ranks sorted; each in range and once, else the same error on every rank (each passed them).
std::vector<int> checked_members(std::vector<int> ranks, int parent_size) {
  const std::vector<int> given = ranks;
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= parent_size) {
      raise<std::invalid_argument>("ddp::new_group", "rank " + std::to_string(ranks[i]) + " of ranks " + list(given) +
                                   " is not a rank of the parent group, whose ranks are 0 to " +
                                   std::to_string(parent_size - 1));
    }
    if (i > 0 && ranks[i] == ranks[i - 1]) {
      raise<std::invalid_argument>("ddp::new_group", "rank " + std::to_string(ranks[i]) + " appears twice in ranks " +
                                   list(given) + "; name each member once");
    }
  }
  return ranks;
}

// Every rank of the parent must have passed the same members: one small collective on the parent
// (the largest and the smallest fingerprint) finds out before any rank waits for a group that
// the others are not making.
void require_same_members_everywhere(const std::vector<int>& members, const ProcessGroupPtr& parent) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the count and the ranks
  auto mix = [&hash](uint64_t value) { hash = (hash ^ value) * 1099511628211ull; };
  mix(members.size());
  for (int member : members) mix(static_cast<uint64_t>(member));
  const auto mine = static_cast<int64_t>(hash >> 1);  // non-negative, so its negation is too
  std::vector<int64_t> bounds{mine, -mine};
  all_reduce(bounds, c10d::ReduceOp::MAX, parent);
  if (bounds[0] != -bounds[1]) {
    raise<std::invalid_argument>("ddp::new_group", "the ranks of the parent group passed different member lists "
                                 "(this rank passed " + list(members) + "); every rank of the parent must pass the "
                                 "same ranks, in the same order of new_group calls");
  }
}

}  // namespace

ProcessGroupPtr new_group(const NewGroupOptions& options) {
  const ProcessGroupPtr parent = options.parent() ? options.parent() : default_group();
  if (detail::owned(parent) == nullptr) {
    raise<std::invalid_argument>("ddp::new_group", "the parent group was built with c10d directly; make it with "
                                 "ddp::init_process_group or ddp::new_process_group, whose rendezvous more groups can "
                                 "be made from");
  }
  std::vector<int> members;
  if (!options.ranks().empty()) {
    members = checked_members(options.ranks(), parent->getSize());
    require_same_members_everywhere(members, parent);
  }
  return detail::split_off(parent, "new_group", options.shared_memory(), members);
}

ProcessGroupPtr new_subgroups(int group_size) {
  const ProcessGroupPtr world = default_group();
  const int size = world->getSize();
  if (group_size < 1 || size % group_size != 0) {
    raise<std::invalid_argument>("ddp::new_subgroups", "group_size " + std::to_string(group_size) +
                                 " does not divide the world size " + std::to_string(size) +
                                 " into whole blocks of consecutive ranks");
  }
  ProcessGroupPtr mine;
  for (int first = 0; first < size; first += group_size) {  // every rank makes every block, in order
    std::vector<int> block(static_cast<size_t>(group_size));
    std::iota(block.begin(), block.end(), first);
    ProcessGroupPtr group = new_group(NewGroupOptions().parent(world).ranks(block));
    if (group) mine = group;
  }
  return mine;
}

int get_global_rank(const ProcessGroupPtr& group, int group_rank) {
  const ProcessGroupPtr pg = group ? group : default_group();
  if (group_rank < 0 || group_rank >= pg->getSize()) {
    raise<std::invalid_argument>("ddp::get_global_rank", "rank " + std::to_string(group_rank) +
                                 " is not a rank of the group, whose ranks are 0 to " + std::to_string(pg->getSize() - 1));
  }
  const detail::OwnedGroup* made = detail::owned(pg);
  if (made == nullptr || made->recipe().global_ranks.empty()) return group_rank;
  return made->recipe().global_ranks[static_cast<size_t>(group_rank)];
}

int get_group_rank(const ProcessGroupPtr& group, int global_rank) {
  const ProcessGroupPtr pg = group ? group : default_group();
  for (int r = 0; r < pg->getSize(); ++r) {
    if (get_global_rank(pg, r) == global_rank) return r;
  }
  return -1;
}

}  // namespace ddp
