#include "backends.h"

#include <cstdlib>
#include <map>
#include <mutex>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef DDP_HAVE_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "compat.h"

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

// Every group made here, by address: its recipe, its Gloo device (shared by the groups split off
// it: one network event loop) and how many groups were split off it so far.
struct Made {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
  GroupRecipe recipe;
  std::shared_ptr<::gloo::transport::Device> device;
  int splits = 0;
};
std::mutex g_mutex;
std::map<const c10d::ProcessGroup*, Made> g_made;

ProcessGroupPtr make_backend(const GroupRecipe& recipe, const c10::intrusive_ptr<c10d::Store>& store,
                             const std::shared_ptr<::gloo::transport::Device>& device) {
#ifdef DDP_HAVE_NCCL
  if (recipe.backend == "nccl") {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = recipe.timeout;
    return compat::as_process_group(
        c10::make_intrusive<c10d::ProcessGroupNCCL>(store, recipe.rank, recipe.size, options), store, recipe.timeout,
        {c10::DeviceType::CUDA});
  }
#endif
  auto options = c10d::ProcessGroupGloo::Options::create(recipe.timeout);
  options->devices.push_back(device);
  return compat::as_process_group(
      c10::make_intrusive<c10d::ProcessGroupGloo>(store, recipe.rank, recipe.size, options), store, recipe.timeout,
      {c10::DeviceType::CPU, c10::DeviceType::CUDA});
}

// The entry for `group`, or null (never made here, or a dead group's address reused).
Made* find(const ProcessGroupPtr& group) {
  auto it = g_made.find(group.get());
  if (it == g_made.end() || it->second.group.lock() != group) return nullptr;
  return &it->second;
}

ProcessGroupPtr make_and_remember(const GroupRecipe& recipe, const std::string& prefix,
                                  std::shared_ptr<::gloo::transport::Device> device) {
  if (!device && recipe.backend != "nccl") device = make_gloo_device(recipe.master_host);
  auto group = make_backend(recipe, c10::make_intrusive<c10d::PrefixStore>(prefix, recipe.store), device);
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto it = g_made.begin(); it != g_made.end();) {  // forget groups that are gone
    it = it->second.group.expired() ? g_made.erase(it) : std::next(it);
  }
  g_made.insert_or_assign(group.get(),
                          Made{c10::weak_intrusive_ptr<c10d::ProcessGroup>(group), recipe, std::move(device), 0});
  return group;
}

}  // namespace

ProcessGroupPtr make_group(const GroupRecipe& recipe, const std::string& prefix) {
  return make_and_remember(recipe, prefix, nullptr);
}

ProcessGroupPtr split_off(const ProcessGroupPtr& parent, const std::string& purpose) {
  GroupRecipe recipe;
  std::shared_ptr<::gloo::transport::Device> device;
  std::string prefix;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    Made* made = find(parent);
    if (made == nullptr) return {};
    recipe = made->recipe;
    device = made->device;
    // Every rank splits in the same order, so the n-th split meets at the same store keys.
    prefix = recipe.backend + "/split/" + purpose + "/" + std::to_string(made->splits++);
  }
  return make_and_remember(recipe, prefix, std::move(device));
}

std::chrono::milliseconds timeout_of(const ProcessGroupPtr& group) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const Made* made = find(group);
  return made != nullptr ? made->recipe.timeout : kDefaultTimeout;
}

}  // namespace ddp::detail
