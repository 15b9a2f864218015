// Rendezvous and the default process group.
#include <ddp/process_group.h>

#include <algorithm>
#include <cctype>
#include <csignal>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <sstream>
#include <stdexcept>

#ifndef _WIN32
#include <netdb.h>
#include <signal.h>
#endif

#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "ddp/floor/src/backends.h"
#include "ddp/internal/compat/versions.h"
#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/floor/src/heap_reuse.h"
#include "ddp/floor/src/heartbeat.h"
#include "ddp/internal/numbers/parse_int.h"
#include "ddp/floor/src/bounded_store.h"
#include "ddp/floor/src/store_text.h"
#include "ddp/internal/diagnostics/text.h"
#include <ddp/launch_environment.h>

namespace ddp {
namespace {

// TORCHDDP_SHM, TORCHDDP_HIERARCHICAL: anything but "0" (or unset) allows.
bool environment_allows(const char* variable) {
  const char* value = std::getenv(variable);
  return value == nullptr || std::string(value) != "0";
}

std::mutex g_default_mutex;
ProcessGroupPtr g_default_group;

[[noreturn]] void fail(const std::string& message) { raise<std::invalid_argument>("ddp::init_process_group", message); }

long parse_int(const std::string& text, const std::string& what, long lo, long hi) {
  return detail::parse_int(text, what, lo, hi, "ddp::init_process_group: ");
}

struct Endpoint {
  std::string host;
  int port = 0;
};

Endpoint parse_tcp_endpoint(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    fail("init_method 'tcp://" + address + "' needs host:port, e.g. tcp://10.0.0.1:29500");
  }
  Endpoint endpoint;
  endpoint.host = address.substr(0, colon);
  if (endpoint.host.size() > 2 && endpoint.host.front() == '[' && endpoint.host.back() == ']') {
    endpoint.host = endpoint.host.substr(1, endpoint.host.size() - 2);  // [::1]:port
  }
  endpoint.port = static_cast<int>(parse_int(address.substr(colon + 1), "port in tcp://" + address, 1, 65535));
  return endpoint;
}

// The file a file:// URL names. On Windows "file:///C:/jobs/store" is C:/jobs/store: the URL's path
// keeps a slash before the drive letter, which Python's url2pathname (PyTorch's file:// rendezvous) drops too.
std::string file_store_path(const std::string& url_path) {
#ifdef _WIN32
  const bool drive = url_path.size() >= 3 && url_path[0] == '/' && url_path[2] == ':' &&
                     std::isalpha(static_cast<unsigned char>(url_path[1]));
  if (drive) return url_path.substr(1);
#endif
  return url_path;
}

// A host name no resolver knows is a typo, not a slow master: say so at once instead of retrying
// until the timeout. Transient resolver errors (EAI_AGAIN) are left to the store's own retries.
// `what` names the setting (it includes the host), `fix` says what to do.
void check_resolvable(const std::string& host, const std::string& what, const std::string& fix) {
#ifndef _WIN32
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int status = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (found != nullptr) freeaddrinfo(found);
  if (status == EAI_NONAME || status == EAI_FAIL) {
    fail(what + " cannot be resolved (" + gai_strerror(status) + "): " + fix);
  }
#endif
}

constexpr bool kHaveNccl =
#ifdef DDP_HAVE_NCCL
    true;
#else
    false;
#endif

// What a store call may take beyond the store's own timeout before its host counts as frozen.
constexpr std::chrono::milliseconds kStoreSlack{5000};

std::string describe_ranks(const std::vector<int>& ranks) {
  return detail::join_limited(ranks, 8, ", ", [](int rank) { return std::to_string(rank); });
}

// The rendezvous. Every rank announces itself and waits for all the others, checking on the way
// what a plain store wait would hide, so that a mis-started job fails at once with a message
// naming the fault instead of hanging or pairing wrong ranks:
//   1. the job: the first rank to arrive records its run id (launch_environment.h); a rank of
//      another job that reached this store (two jobs on one MASTER_PORT) is refused before it
//      touches anything of this job;
//   2. the world size: the first rank records it; a rank started with another one is refused;
//   3. the rank: each rank claims its number with an atomic add; a second claimant (the same
//      RANK given to two processes) is refused;
//   4. the wait, polling: ends when every rank has announced itself, when a refusal from steps 2-3
//      appears (published under ".../error", so every rank fails with the same message at once),
//      when the store goes away (its host, rank 0, exited), or at the timeout, naming the ranks
//      that never came. Meanwhile a notice every few seconds names the ranks still missing.
// The second stage ("connected", after the backend connected) only waits (step 4).
struct Arrival {
  std::string stage;     // key namespace: "rendezvous" or "connected"
  int rank = 0;
  int world_size = 1;
  std::string run_id;    // "" when the launcher gave none
  bool check_identity = false;  // steps 1-3
};

using detail::bytes_of;
using detail::text_of;

[[noreturn]] void refuse(c10d::Store& store, const Arrival& me, const std::string& message) {
  const std::string full = "ddp::init_process_group: " + message;
  store.set("ddp/" + me.stage + "/error", bytes_of(full));  // the other ranks' step 4 sees it
  throw std::runtime_error(full);
}

void check_identity(c10d::Store& store, const Arrival& me, const std::string& where) {
  const std::string prefix = "ddp/" + me.stage + "/";
  // 1. The same job. compareSet with an empty expected value sets the key if it is absent and
  //    returns what the key holds: the first arrival's value.
  const std::string run = me.run_id.empty() ? "(none)" : me.run_id;
  const std::string first_run = text_of(store.compareSet(prefix + "run_id", {}, bytes_of(run)));
  if (first_run != run) {
    throw std::runtime_error("ddp::init_process_group: rank " + std::to_string(me.rank) + " reached a store at " +
                             where + " that belongs to another job (run id '" + first_run + "', this rank's is '" +
                             run + "'): two jobs are using the same MASTER_PORT. Give each job its own port "
                             "(ddprun --master-port, or MASTER_PORT)");
  }
  // 2. The same world size.
  const std::string world = std::to_string(me.world_size);
  const std::string first_world = text_of(store.compareSet(prefix + "world_size", {}, bytes_of(world)));
  if (first_world != world) {
    refuse(store, me, "the ranks disagree on WORLD_SIZE: rank " + std::to_string(me.rank) + " was started with " +
                          world + ", a rank that arrived before it with " + first_world +
                          ". Start every rank with the same WORLD_SIZE");
  }
  // 3. Each rank once.
  const int64_t claims = store.add(prefix + "claims_" + std::to_string(me.rank), 1);
  if (claims > 1) {
    refuse(store, me, "RANK=" + std::to_string(me.rank) + " was given to " + std::to_string(claims) +
                          " processes: each of the ranks 0.." + std::to_string(me.world_size - 1) +
                          " must be started exactly once (check the RANK each process gets)");
  }
}

// While ranks are missing, a waiting rank says so on stderr: first after kFirstNotice (a job whose
// ranks start together never sees it), then at doubling intervals up to kMaxNoticeInterval, so that
// even the 30-minute default timeout prints a bounded number of lines.
constexpr std::chrono::seconds kFirstNotice{5};
constexpr std::chrono::seconds kMaxNoticeInterval{60};

void rendezvous(c10d::Store& store, const Arrival& me, std::chrono::milliseconds timeout, const std::string& where) {
  const auto start = std::chrono::steady_clock::now();
  const std::string prefix = "ddp/" + me.stage + "/";
  std::vector<std::string> keys;
  for (int r = 0; r < me.world_size; ++r) keys.push_back(prefix + "rank_" + std::to_string(r));
  const auto waited = [&] {
    std::ostringstream text;
    text << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return text.str();
  };
  const auto missing_ranks = [&] {
    std::vector<int> missing;
    for (int r = 0; r < me.world_size; ++r) {
      if (!store.check({keys[r]})) missing.push_back(r);
    }
    return missing;
  };
  try {
    if (me.check_identity) check_identity(store, me, where);
    store.set(keys[me.rank], bytes_of("1"));
    // 4. Wait, polling with a growing interval (5 ms to 200 ms): cheap for the store, quick to notice.
    auto pause = std::chrono::milliseconds(5);
    auto notice_interval = std::chrono::duration_cast<std::chrono::milliseconds>(kFirstNotice);
    auto next_notice = start + notice_interval;
    while (!store.check(keys)) {
      if (store.check({prefix + "error"})) throw std::runtime_error(text_of(store.get(prefix + "error")));
      const auto now = std::chrono::steady_clock::now();
      if (now - start >= timeout) {
        std::ostringstream message;
        message << "ddp::init_process_group: rank " << me.rank << " waited " << waited() << " s at " << where
                << " for ranks [" << describe_ranks(missing_ranks()) << "] of world_size " << me.world_size
                << ", which never joined. Check that every rank was started with the same init_method and "
                   "WORLD_SIZE, and that none of them failed before reaching init_process_group";
        throw std::runtime_error(message.str());
      }
      if (now >= next_notice) {
        const std::vector<int> missing = missing_ranks();
        std::fprintf(stderr, "[torchddp] rank %d: waiting for ranks [%s] at %s, %d/%d joined (%.0f s of the %.0f s timeout)\n",
                     me.rank, describe_ranks(missing).c_str(), where.c_str(),
                     me.world_size - static_cast<int>(missing.size()), me.world_size,
                     std::chrono::duration<double>(now - start).count(), timeout.count() / 1000.0);
        notice_interval = std::min(notice_interval * 2, std::chrono::duration_cast<std::chrono::milliseconds>(kMaxNoticeInterval));
        next_notice = now + notice_interval;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(200));
    }
  } catch (const std::exception& error) {
    if (std::string(error.what()).rfind("ddp::init_process_group: ", 0) == 0) throw;
    // The store itself failed: its host went away, or froze (bounded_store.h), while we waited.
    throw std::runtime_error("ddp::init_process_group: rank " + std::to_string(me.rank) +
                             " lost the store at " + where + " after " + waited() +
                             " s: the process hosting it (rank 0, or the launcher) exited, crashed or froze. (" +
                             error_text(error) + ")");
  }
}

// What env:// needs and the launcher did not give: the fix depends on who started the ranks.
std::string master_hint(const LaunchEnvironment& launch, const char* name) {
  const std::string what = std::string(name) == "MASTER_ADDR" ? "the address of rank 0's host, e.g. 127.0.0.1"
                                                                : "a free TCP port on rank 0's host, e.g. 29500";
  if (launch.source == LaunchEnvironment::Source::kOpenMpi) {
    return what + ". Open MPI knows no master: export it to every rank (mpirun -x MASTER_ADDR=<first host> "
                  "-x MASTER_PORT=29500 ...)";
  }
  return what + " (init_method env://; ddprun and torchrun set it)";
}

// A connected group, and how its heartbeat reaches the store (null: a world of one has none).
struct Connection {
  ProcessGroupPtr group;
  std::function<c10::intrusive_ptr<c10d::Store>()> heartbeat_store;
  int rank = 0;
  int world_size = 1;
};

Connection connect_group(const InitOptions& options) {
  // Rank and world size: explicit options win, then the launcher's variables (launch_environment.h).
  const LaunchEnvironment launch = launch_environment();
  const detail::DebugLevel debug = detail::debug_level();  // a misspelt level is refused before connecting
  const bool alone = launch.source == LaunchEnvironment::Source::kNone && options.world_size < 0;
  if (alone && options.require_launcher) {
    fail("no launcher variables are set (RANK/WORLD_SIZE from ddprun or torchrun, SLURM_PROCID from srun, "
         "OMPI_COMM_WORLD_RANK from mpirun) and InitOptions.require_launcher is true: start the program with a "
         "launcher, or pass InitOptions.rank and world_size");
  }
  if (options.timeout.count() <= 0) {
    fail("InitOptions.timeout must be positive, got " + std::to_string(options.timeout.count()) +
         " ms: it bounds the rendezvous and every collective (PyTorch's default is 30 minutes)");
  }
  const int world_size = options.world_size >= 0 ? options.world_size : launch.world_size;
  if (world_size < 1) fail("world_size=" + std::to_string(world_size) + " must be at least 1");
  const int rank = options.rank >= 0 ? options.rank : launch.rank;
  if (rank >= world_size) {
    fail("rank " + std::to_string(rank) + " is out of range for world_size " +
         std::to_string(world_size) + " (valid ranks: 0.." + std::to_string(world_size - 1) + ")");
  }
  if (rank == 0 && (alone || launch.source == LaunchEnvironment::Source::kSlurm ||
                    launch.source == LaunchEnvironment::Source::kOpenMpi)) {
    // Said once, by rank 0, where the job's shape was inferred rather than given.
    std::fprintf(stderr, "[torchddp] %s\n",
                 alone ? "no launcher (RANK/WORLD_SIZE, Slurm or Open MPI variables): running as a world of 1"
                       : ("world of " + std::to_string(world_size) + " from " + launch.describe() + ", master " +
                          launch.master_addr + ":" + std::to_string(launch.master_port))
                             .c_str());
  }

  std::string backend = options.backend;
  if (backend == "auto") {
    backend = (kHaveNccl && torch::cuda::is_available()) ? "nccl" : "gloo";
  }
  if (backend != "gloo" && backend != "nccl") {
    fail("unknown backend '" + options.backend + "': use \"gloo\", \"nccl\" or \"auto\"");
  }
  if (backend == "nccl" && !kHaveNccl) {
    fail("backend \"nccl\" is not available: this LibTorch was built without NCCL (CPU-only). "
         "Use \"gloo\" or link a CUDA build of LibTorch.");
  }
  if (backend == "nccl" && !torch::cuda::is_available()) {
    // ProcessGroupNCCL moves CUDA tensors only; PyTorch refuses it without a GPU too.
    fail("backend \"nccl\" needs a CUDA device, and this process sees none (torch::cuda::is_available() is "
         "false; check CUDA_VISIBLE_DEVICES and the driver). Use \"gloo\", or \"auto\" to take NCCL only where "
         "a GPU is.");
  }

  // The store every rank meets at.
  const std::string& method = options.init_method;
  c10::intrusive_ptr<c10d::Store> store;
  std::function<c10::intrusive_ptr<c10d::Store>()> heartbeat_store;
  std::string master_host = "127.0.0.1";
  std::string where = method;  // for messages: the method, and the store's address under env://
  if (alone && method.rfind("env://", 0) == 0) {
    store = c10::make_intrusive<c10d::HashStore>();  // a world of one meets no one
  } else if (method.rfind("env://", 0) == 0 || method.rfind("tcp://", 0) == 0) {
    Endpoint endpoint;
    if (method.rfind("env://", 0) == 0) {
      if (launch.master_addr.empty()) fail("MASTER_ADDR is not set: " + master_hint(launch, "MASTER_ADDR"));
      if (launch.master_port == 0) fail("MASTER_PORT is not set: " + master_hint(launch, "MASTER_PORT"));
      endpoint.host = launch.master_addr;
      endpoint.port = launch.master_port;
      check_resolvable(endpoint.host, "MASTER_ADDR='" + endpoint.host + "'",
                       "set it to the host name or IP address of rank 0's machine");
    } else {
      endpoint = parse_tcp_endpoint(method.substr(6));
      check_resolvable(endpoint.host, "host '" + endpoint.host + "' of init_method '" + method + "'",
                       "use the host name or IP address of rank 0's machine");
    }
    master_host = endpoint.host;
    if (method.rfind("env://", 0) == 0) where = method + " (" + endpoint.host + ":" + std::to_string(endpoint.port) + ")";
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(endpoint.port);
    // torchrun 2.x hosts the store in its agent (TORCHELASTIC_USE_AGENT_STORE): every rank is a client.
    const bool agent_store = launch.agent_store && method.rfind("env://", 0) == 0;
    store_options.isServer = rank == 0 && !agent_store;
    store_options.numWorkers = world_size;
    store_options.waitWorkers = false;  // our own rendezvous below names the missing ranks
    store_options.timeout = options.timeout;
    // Every call to the store is bounded (bounded_store.h): a frozen store host must end the job,
    // not hang it. The rendezvous and Gloo's connection set-up wait up to the timeout themselves.
    const std::string host = std::string(agent_store ? "the launcher's agent" : "rank 0") + " at " + endpoint.host + ":" +
                             std::to_string(endpoint.port);
    try {
      store = detail::BoundedStore::connect([address = endpoint.host, store_options] { return compat::make_tcp_store(address, store_options); },
                                    host, options.timeout + kStoreSlack, kStoreSlack);
    } catch (const std::exception& error) {
      std::ostringstream message;
      if (rank == 0) {
        message << "rank 0 could not host the store on port " << endpoint.port
                << " (is the port already in use? pick another MASTER_PORT): " << error_text(error);
      } else {
        message << "rank " << rank << " could not reach the master store at " << endpoint.host << ":"
                << endpoint.port << " within " << options.timeout.count() / 1000.0
                << " s: is rank 0 running, and are MASTER_ADDR/MASTER_PORT right? (" << error_text(error) << ")";
      }
      throw std::runtime_error("ddp::init_process_group: " + message.str());
    }
    // The agent's store outlives restarts: each attempt keeps its keys apart, as torch.distributed does.
    const std::string attempt = "/worker/attempt_" + std::to_string(launch.restart_count);
    if (agent_store) store = c10::make_intrusive<c10d::PrefixStore>(attempt, store);
    // The heartbeat's own client: a short timeout, and no lock shared with the group's store.
    heartbeat_store = [address = endpoint.host, port = store_options.port, agent_store, attempt, host] {
      c10d::TCPStoreOptions client;
      client.port = port;
      client.isServer = false;
      client.waitWorkers = false;
      client.timeout = std::chrono::seconds(5);
      c10::intrusive_ptr<c10d::Store> connection = detail::BoundedStore::connect(
          [address, client] { return compat::make_tcp_store(address, client); }, host, client.timeout + kStoreSlack, kStoreSlack);
      if (agent_store) connection = c10::make_intrusive<c10d::PrefixStore>(attempt, connection);
      return connection;
    };
  } else if (method.rfind("file://", 0) == 0) {
    const std::string path = file_store_path(method.substr(7));
    if (path.empty()) fail("init_method 'file://' needs a path, e.g. file:///tmp/ddp_rendezvous");
    store = c10::make_intrusive<c10d::FileStore>(path, world_size);
    heartbeat_store = [store] { return store; };  // a file has no connection to lose
  } else {
    fail("unknown init_method scheme in '" + method +
         "': use env:// (MASTER_ADDR/MASTER_PORT), tcp://host:port or file:///path");
  }
  store->setTimeout(options.timeout);
  rendezvous(*store, Arrival{"rendezvous", rank, world_size, launch.run_id, /*check_identity=*/true},
             options.timeout, where);

  // The settings the environment gives, read once here into the group's recipe.
  const detail::GroupRecipe recipe{backend,
                                   store,
                                   rank,
                                   world_size,
                                   options.timeout,
                                   master_host,
                                   options.shared_memory() && environment_allows("TORCHDDP_SHM"),
                                   options.hierarchical() && environment_allows("TORCHDDP_HIERARCHICAL"),
                                   debug,
                                   launch.run_id,
                                   /*global_ranks=*/{}};
  ProcessGroupPtr group = detail::make_group(recipe, backend);
  // Return only once every rank has finished connecting (like torch.distributed's store-based
  // barrier): a rank that finishes first and exits at once would otherwise break a peer still in
  // Gloo's connectFullMesh ("Connection closed by peer").
  rendezvous(*store, Arrival{"connected", rank, world_size, /*run_id=*/"", /*check_identity=*/false}, options.timeout,
             where + " (after connecting " + backend + ")");
  return Connection{group, world_size > 1 ? heartbeat_store : nullptr, rank, world_size};
}

}  // namespace

ProcessGroupPtr new_process_group(const InitOptions& options) { return connect_group(options).group; }

// The default group also gets the heartbeat that names a stalled rank when a collective fails.
namespace {
// SIGPIPE's default ends the process; a handler or SIG_IGN the program chose is left alone.
void ignore_sigpipe_unless_handled() {
#ifndef _WIN32
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);
#endif
}
}  // namespace

ProcessGroupPtr init_process_group(const InitOptions& options) {
  ignore_sigpipe_unless_handled();
  detail::keep_freed_memory_for_reuse();
  Connection connection = connect_group(options);
  if (connection.heartbeat_store) {
    detail::start_heartbeat(connection.heartbeat_store, connection.rank, connection.world_size);
  } else {
    detail::stop_heartbeat();
  }
  std::lock_guard<std::mutex> lock(g_default_mutex);
  g_default_group = connection.group;
  return connection.group;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  return static_cast<bool>(g_default_group);
}

ProcessGroupPtr default_group() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  if (!g_default_group) {
    throw std::logic_error(
        "ddp: no default process group: call ddp::init_process_group() first (or pass a group)");
  }
  return g_default_group;
}

void destroy_process_group() {
  detail::stop_heartbeat();
  std::lock_guard<std::mutex> lock(g_default_mutex);
  g_default_group.reset();
}

int local_rank() { return launch_environment().local_rank; }

}  // namespace ddp
