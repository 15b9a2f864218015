#pragma once
// Everything that differs between the LibTorch versions we build against (1.13 and 2.x), and
// nothing else: each branch names the version that introduced the difference.
#include <chrono>
#include <cstdlib>
#include <initializer_list>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <torch/version.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/autograd/variable.h>

#define DDP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace ddp::compat {

// The base class of a backend's collectives, which the library's own group (owned_group.h) derives
// from: 1.13's backends are c10d::ProcessGroup subclasses; 2.0 made them c10d::Backend subclasses
// that a c10d::ProcessGroup dispatches to by device.
#if DDP_TORCH_AT_LEAST(2, 0)
using CollectiveBackend = c10d::Backend;
#else
using CollectiveBackend = c10d::ProcessGroup;
#endif

// The backend behind `group`: the group itself (1.13); its CPU backend, else its CUDA one (2.x).
// Null when it has neither.
inline c10::intrusive_ptr<CollectiveBackend> backend_of(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
#if DDP_TORCH_AT_LEAST(2, 0)
  for (const auto device : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
    try {
      if (auto backend = group->getBackend(device)) return backend;
    } catch (const c10::Error&) {  // no backend for that device
    }
  }
  return {};
#else
  return group;
#endif
}

// A backend (c10d::ProcessGroupGloo or ProcessGroupNCCL) as the c10d::ProcessGroup the rest of
// the code talks to, serving tensors of `devices`.
//  - 1.13: the backends *are* c10d::ProcessGroup subclasses: nothing to do.
//  - 2.0 : they are c10d::Backend subclasses, wrapped by a ProcessGroup that dispatches by device.
template <typename Backend>
c10::intrusive_ptr<c10d::ProcessGroup> as_process_group(c10::intrusive_ptr<Backend> backend,
                                                        const c10::intrusive_ptr<c10d::Store>& store,
                                                        std::chrono::milliseconds timeout,
                                                        std::initializer_list<c10::DeviceType> devices) {
#if DDP_TORCH_AT_LEAST(2, 0)
  const std::string name = backend->getBackendName();
  const auto type = name == "nccl" ? c10d::ProcessGroup::BackendType::NCCL : c10d::ProcessGroup::BackendType::GLOO;
  const int rank = backend->getRank(), size = backend->getSize();
#if DDP_TORCH_AT_LEAST(2, 6)  // 2.6: ProcessGroup's constructor no longer takes Options
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
#else
  auto group = c10::make_intrusive<c10d::ProcessGroup>(
      store, rank, size, c10::make_intrusive<c10d::ProcessGroup::Options>(name, timeout));
#endif
  group->setDefaultBackend(type);
  for (const auto device : devices) group->setBackend(device, type, backend);
  return group;
#else
  return backend;
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

// Whether ProcessGroupGloo reduces bfloat16 tensors. LibTorch 1.13's does not ("Invalid scalar
// type", checked on Debian's 1.13.1); the bf16 hooks then sum by a reduce-scatter of their own
// (comm_hooks.cpp). 2.6's does
// (checked with trixie's python3-torch 2.6: dist.all_reduce of a bfloat16 tensor on Gloo). PyTorch
// added it in late 2023 (pull request 113557), so 2.2-2.5 probably do too; unchecked, they keep
// the reduce-scatter, which is correct everywhere.
inline constexpr bool kGlooReducesBFloat16 = DDP_TORCH_AT_LEAST(2, 6);

// Autocast's per-thread state for one device type. 1.13 has a set of functions per device
// (is_cpu_enabled/set_cpu_enabled, is_enabled/set_enabled for CUDA, get_/set_autocast_cpu_dtype,
// get_/set_autocast_gpu_dtype); 2.4 replaced them with functions taking the device type and made
// the old names deprecated ones that warn (checked: 1.13's and 2.6's headers).
inline bool autocast_enabled(c10::DeviceType device_type) {
#if DDP_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device_type);
#else
  return device_type == c10::kCPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}
inline void set_autocast_enabled(c10::DeviceType device_type, bool enabled) {
#if DDP_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device_type, enabled);
#else
  device_type == c10::kCPU ? at::autocast::set_cpu_enabled(enabled) : at::autocast::set_enabled(enabled);
#endif
}
inline c10::ScalarType autocast_dtype(c10::DeviceType device_type) {
#if DDP_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device_type);
#else
  return device_type == c10::kCPU ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
#endif
}
inline void set_autocast_dtype(c10::DeviceType device_type, c10::ScalarType dtype) {
#if DDP_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device_type, dtype);
#else
  device_type == c10::kCPU ? at::autocast::set_autocast_cpu_dtype(dtype) : at::autocast::set_autocast_gpu_dtype(dtype);
#endif
}
// CPU autocast in float16: 1.13's Python torch.autocast refuses it ("CPU Autocast only supports
// dtype of torch.bfloat16"); 2.x supports it (we build 2.6).
inline constexpr bool kCpuAutocastSupportsHalf = DDP_TORCH_AT_LEAST(2, 6);

// The key of a parameter's entry in torch::optim::Optimizer::state(): its TensorImpl's address, as
// text in 1.13 (c10::guts::to_string, i.e. operator<< of the pointer) and as the pointer itself in
// 2.6 (checked: both versions' optim/*.h). Chosen by the map's key type, not a version number:
// which 2.x release made the change was not checked.
template <typename StateMap>
typename StateMap::key_type optimizer_state_key(const StateMap&, const at::Tensor& param) {
  if constexpr (std::is_same_v<typename StateMap::key_type, std::string>) {
    std::ostringstream text;
    text << param.unsafeGetTensorImpl();
    return text.str();
  } else {
    return param.unsafeGetTensorImpl();
  }
}

// A parameter's gradient accumulator as torch::autograd::impl::grad_accumulator returns it: a
// std::shared_ptr<Node> in 1.13 and 2.6, a c10::intrusive_ptr<Node> in 2.15 (checked: their
// autograd/variable.h). Either has get(), operator bool and -> and compares with its own kind.
using GradAccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// c10d::Store::clone(), "a thread safe copy of this store object that points to the same
// underlying store", which c10d's backends call on the store they are given: absent in 1.13 and
// 2.6, pure virtual in 2.15 (checked: their Store.hpp; the release between that added it was not
// checked). A store of ours declares clone() without `override`, so that it compiles against
// both, and clones the store it wraps with this: its own clone() where it has one, else the same
// store (never called there: no c10d code of those versions clones a store).
template <typename S, typename = void>
struct has_clone : std::false_type {};
template <typename S>
struct has_clone<S, std::void_t<decltype(std::declval<S&>().clone())>> : std::true_type {};

template <typename S = c10d::Store>
c10::intrusive_ptr<c10d::Store> clone_store(const c10::intrusive_ptr<S>& store) {
  if constexpr (has_clone<S>::value) {
    return store->clone();
  } else {
    return store;
  }
}

}  // namespace ddp::compat
