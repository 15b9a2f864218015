#pragma once
// Making a backend's process group (Gloo or NCCL) over a rendezvous store, and later more groups
// over the same ranks: DistributedDataParallel reduces over a group of its own, so that none of its
// collectives can ever pair with a collective the program runs on the group it passed in.
#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ddp/process_group.h"

namespace ddp::detail {

struct GroupRecipe {
  std::string backend;                     // "gloo" or "nccl"
  c10::intrusive_ptr<c10d::Store> store;   // the rendezvous store, without prefix
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  std::string master_host;                 // picks Gloo's network interface
};

// The backend's group over `recipe.store` prefixed by `prefix` (blocks until every rank has
// connected). Remembers the recipe, so that split_off() works on the result.
ProcessGroupPtr make_group(const GroupRecipe& recipe, const std::string& prefix);

// A new group over the same ranks as `parent`, with connections of its own. Collective: every rank
// calls it, in the same order. Returns null for a group this library did not make (one built with
// c10d directly): there is no store to make another from.
ProcessGroupPtr split_off(const ProcessGroupPtr& parent, const std::string& purpose);

// The timeout `group` was made with (kDefaultTimeout for a group this library did not make).
std::chrono::milliseconds timeout_of(const ProcessGroupPtr& group);

}  // namespace ddp::detail
