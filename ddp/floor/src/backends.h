#pragma once
// Making a backend's process group (Gloo or NCCL) over a rendezvous store, and later more groups
// over the same ranks: DistributedDataParallel reduces over a group of its own, so that none of its
// collectives can ever pair with a collective the program runs on the group it passed in. Every
// group made here is the library's own handle (owned_group.h), with shared memory where it serves.
#include <chrono>
#include <string>
#include <vector>

#include <ddp/process_group.h>

#include "ddp/floor/src/owned_group.h"

namespace ddp::detail {

// The backend's group over `recipe.store` prefixed by `prefix` (blocks until every rank has
// connected, and has agreed whether shared memory serves the group).
ProcessGroupPtr make_group(const GroupRecipe& recipe, const std::string& prefix);

// A new group over the same ranks as `parent` (or over `members`, ranks of the parent sorted
// ascending), with connections of its own. Collective: every rank of the parent calls it, in the
// same order, members or not. Returns null on a rank outside `members`, and for a group this
// library did not make (one built with c10d directly): there is no store to make another from.
// `shared_memory` false keeps the new group on Gloo alone whatever the parent does.
ProcessGroupPtr split_off(const ProcessGroupPtr& parent, const std::string& purpose, bool shared_memory = true,
                          const std::vector<int>& members = {});

// The timeout a collective on `group` waits: the one it was made with; for a group built with
// c10d directly, whose timeout c10d does not tell, PyTorch's default kDefaultTimeout (30 min).
std::chrono::milliseconds timeout_of(const ProcessGroupPtr& group);

// How `group` moves data: "gloo+shm", "gloo+shm hierarchical (2 hosts x 2)", "gloo", "nccl"; for a group built with c10d directly, its
// backend's name.
std::string transport_of(const ProcessGroupPtr& group);

// TORCH_DISTRIBUTED_DEBUG as it was when `group` was made (read once per group, never per
// collective); for a group built with c10d directly, as it is now.
DebugLevel debug_level_of(const ProcessGroupPtr& group);

}  // namespace ddp::detail
