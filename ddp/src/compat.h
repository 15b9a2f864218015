#pragma once
// Everything that differs between LibTorch 1.13 and 2.x, in one place.
//  - 1.13: ProcessGroupGloo/NCCL *are* c10d::ProcessGroup subclasses.
//  - 2.x : they are c10d::Backend subclasses, wrapped by a c10d::ProcessGroup that dispatches
//          by device type.
#include <chrono>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#ifdef DDP_HAVE_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#define DDP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace ddp::compat {

inline c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout,
    std::shared_ptr<::gloo::transport::Device> device) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(std::move(device));
#if DDP_TORCH_AT_LEAST(2, 0)  // 2.0: ProcessGroupGloo is a c10d::Backend behind a ProcessGroup
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
#if DDP_TORCH_AT_LEAST(2, 6)  // 2.6: ProcessGroup's constructor no longer takes Options
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
#else
  auto group = c10::make_intrusive<c10d::ProcessGroup>(
      store, rank, size, c10::make_intrusive<c10d::ProcessGroup::Options>("gloo", timeout));
#endif
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, backend);
  return group;
#else
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
#endif
}

// TCPStore. 2.2+ has TCPStoreOptions::useLibUV, true by default since 2.4; LibTorch builds without
// the libuv store backend (Debian trixie's 2.6) then throw "use_libuv was requested but PyTorch was
// build without libuv support" on every rank. Like torchrun, USE_LIBUV=0 asks for the classic
// backend; otherwise libuv is tried and, where this LibTorch lacks it, the classic backend is used.
// Both backends speak the same protocol to clients. (A template so that the useLibUV branch is
// only compiled where the member exists: 1.13 has none.)
template <typename T, typename = void>
struct has_use_libuv : std::false_type {};
template <typename T>
struct has_use_libuv<T, std::void_t<decltype(std::declval<T&>().useLibUV)>> : std::true_type {};

template <typename Options = c10d::TCPStoreOptions>
c10::intrusive_ptr<c10d::TCPStore> make_tcp_store(const std::string& host, Options options) {
  if constexpr (has_use_libuv<Options>::value) {
    if (const char* env = std::getenv("USE_LIBUV"); env != nullptr && std::string(env) == "0") {
      options.useLibUV = false;
    }
    if (options.useLibUV) {
      try {
        return c10::make_intrusive<c10d::TCPStore>(host, options);
      } catch (const c10::Error& error) {
        if (std::string(error.what()).find("without libuv support") == std::string::npos) throw;
        options.useLibUV = false;
      }
    }
  }
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

inline bool have_nccl() {
#ifdef DDP_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

#ifdef DDP_HAVE_NCCL
inline c10::intrusive_ptr<c10d::ProcessGroup> make_nccl_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
#if DDP_TORCH_AT_LEAST(2, 0)  // 2.0: ProcessGroupNCCL is a c10d::Backend behind a ProcessGroup
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#if DDP_TORCH_AT_LEAST(2, 6)  // 2.6: ProcessGroup's constructor no longer takes Options
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
#else
  auto group = c10::make_intrusive<c10d::ProcessGroup>(
      store, rank, size, c10::make_intrusive<c10d::ProcessGroup::Options>("nccl", timeout));
#endif
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, backend);
  return group;
#else
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#endif
}
#endif

// A post-hook on an autograd node (the gradient accumulator of a parameter).
template <typename Fn>
void add_post_hook(torch::autograd::Node& node, Fn fn) {
  node.add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [fn = std::move(fn)](const torch::autograd::variable_list& outputs,
                           const torch::autograd::variable_list& /*inputs*/) {
        fn();
        return outputs;
      }));
}

}  // namespace ddp::compat
