#include "ddp/floor/src/backends.h"

#include <algorithm>
#include <cstdlib>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef DDP_HAVE_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "ddp/internal/compat/versions.h"
#include "ddp/floor/src/owned_group.h"
#include "ddp/floor/src/shm/channel.h"

namespace ddp::detail {
namespace {

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::shared_ptr<::gloo::transport::Device> make_gloo_device(const std::string& master_host) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (is_loopback(master_host)) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// The backend's own group (1.13: a ProcessGroup; 2.x: a Backend) over `store`.
c10::intrusive_ptr<compat::CollectiveBackend> make_backend(const GroupRecipe& recipe,
                                                           const c10::intrusive_ptr<c10d::Store>& store,
                                                           const std::shared_ptr<::gloo::transport::Device>& device) {
#ifdef DDP_HAVE_NCCL
  if (recipe.backend == "nccl") {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = recipe.timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, recipe.rank, recipe.size, options);
  }
#endif
  auto options = c10d::ProcessGroupGloo::Options::create(recipe.timeout);
  options->devices.push_back(device);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, recipe.rank, recipe.size, options);
}

// The library's handle around the backend's group, with the shared-memory channel when every
// rank agrees it serves (only Gloo groups: NCCL moves CUDA tensors).
ProcessGroupPtr make_owned(const GroupRecipe& recipe, const std::string& prefix,
                           std::shared_ptr<::gloo::transport::Device> device) {
  if (!device && recipe.backend != "nccl") device = make_gloo_device(recipe.master_host);
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, recipe.store);
  auto inner = make_backend(recipe, store, device);
  std::unique_ptr<shm::Channel> channel;
  if (recipe.backend != "nccl") {
    channel = shm::Channel::open(c10::make_intrusive<c10d::PrefixStore>("shm", store), recipe.rank, recipe.size,
                                 recipe.timeout, recipe.run_id, recipe.shared_memory, recipe.hierarchical, device);
  }
  auto group = c10::make_intrusive<OwnedGroup>(std::move(inner), recipe, std::move(device), std::move(channel));
  const bool nccl = recipe.backend == "nccl";
  return compat::as_process_group(group, store, recipe.timeout,
                                  nccl ? std::initializer_list<c10::DeviceType>{c10::DeviceType::CUDA}
                                       : std::initializer_list<c10::DeviceType>{c10::DeviceType::CPU, c10::DeviceType::CUDA});
}

}  // namespace

ProcessGroupPtr make_group(const GroupRecipe& recipe, const std::string& prefix) {
  return make_owned(recipe, prefix, nullptr);
}

ProcessGroupPtr split_off(const ProcessGroupPtr& parent, const std::string& purpose, bool shared_memory,
                          const std::vector<int>& members) {
  OwnedGroup* made = owned(parent);
  if (made == nullptr) return {};
  // Every rank of the parent splits in the same order (members or not), so the n-th split meets
  // at the same store keys; the split shares the parent's Gloo device (one network event loop).
  GroupRecipe recipe = made->recipe();
  const std::string prefix = recipe.backend + "/split/" + purpose + "/" + std::to_string(made->next_split());
  recipe.shared_memory = recipe.shared_memory && shared_memory;
  recipe.debug = debug_level();  // DDP's own group takes the level its constructor sees
  if (!members.empty()) {
    const auto at = std::find(members.begin(), members.end(), recipe.rank);
    if (at == members.end()) return {};
    std::vector<int> global;
    for (int member : members) global.push_back(recipe.global_ranks.empty() ? member : recipe.global_ranks[member]);
    recipe.rank = static_cast<int>(at - members.begin());
    recipe.size = static_cast<int>(members.size());
    recipe.global_ranks = std::move(global);
  }
  return make_owned(recipe, prefix, made->device());
}

std::chrono::milliseconds timeout_of(const ProcessGroupPtr& group) {
  const OwnedGroup* made = owned(group);
  return made != nullptr ? made->recipe().timeout : kDefaultTimeout;
}

DebugLevel debug_level_of(const ProcessGroupPtr& group) {
  const OwnedGroup* made = owned(group);
  return made != nullptr ? made->recipe().debug : debug_level();
}

std::string transport_of(const ProcessGroupPtr& group) {
  const OwnedGroup* made = owned(group);
  return made != nullptr ? made->transport() : group->getBackendName();
}

}  // namespace ddp::detail

namespace ddp {

std::string nccl_version() {
#ifdef DDP_HAVE_NCCL
  // NCCL_MAJOR/MINOR/PATCH: nccl.h's own macros, from the header backends.cpp compiled against
  // (TorchFeatures.cmake picks the one beside LibTorch's NCCL).
  return std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." + std::to_string(NCCL_PATCH);
#else
  return "";
#endif
}

}  // namespace ddp
