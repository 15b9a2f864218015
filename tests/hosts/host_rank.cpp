// One rank of a job whose ranks run on several simulated hosts (sim_hosts.sh); two_hosts_test.sh and
// hierarchical_test.sh start it with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and HOST_GROUP_INIT, a tcp:// address on this host for
// a group of its ranks only. HOST_RANK_NO_HIERARCHICAL=1: InitOptions().hierarchical(false).
// HOST_RANK_TIMEOUT_S: the groups' timeout (60 s unless given).
//   host_rank            prints one line of facts per step, for the test to check:
//     rank=R host=H world_transport=T   the hostname it runs on; how the world group moves data
//     world_sum=S world_max=M           all_reduce(rank + 1) over the world; MAX of the rank, int64
//     world_avg=A                       AVG of rank + 1, float64 (hierarchical worlds only)
//     host_transport=T host_sum=S       the same over the group of this host's ranks
//     flat_transport=T flat_match=yes|no|differs between ranks
//                                       a group of the same ranks on Gloo alone; whether its
//                                       all_reduce of 2M+13 random floats equals the world's
//                                       within fp32 rounding (and the world's has the same bits
//                                       on every rank)
//     ddp_grads=match|differ            DDP's averaged gradients on the world against one process
//                                       on the whole batch (computed here, without DDP)
//     ddp_buckets=shared|private        where the world's DDP gradients lie after backward: in a
//                                       mapping of /dev/shm (its buckets in shared memory, the
//                                       slots adopted as gradients) or not (/proc/self/maps)
//     ddp_grads_flat=match|differ       ... and against DDP's on the Gloo-alone group
//   host_rank halves     reduce_scatter_tensor and all_gather_into_tensor over the world, every
//                        dtype and reduction they take, sizes within one slice crossing the hosts
//                        and past it, in place too, each against the result computed here from
//                        every rank's known input; prints one line per wrong result
//                        ("rank=R wrong=...") and then:
//     halves_checked=N halves_wrong=K   how many results were checked, and how many were wrong
//     halves_link rs_world=B rs_flat=B ag_world=B ag_flat=B input=B
//                                       bytes this host's link sent during one reduce-scatter of an
//                                       8 MiB input per rank and one all-gather into an 8 MiB
//                                       output, over the world and over a Gloo-alone group
//   host_rank forever [ddp|halves|desync]  all-reduces 8.4M floats over the world (ddp: trains
//                        DDP, 1.3M parameters; halves: reduce-scatters them and all-gathers the
//                        pieces back; desync: after one all-reduce, the first host's ranks
//                        reduce-scatter while the others all-gather) until a collective fails
//                        (after writing "rank=R ready" once), then prints "rank=R error=<message>"
// Exit 0 when every step ran (the test judges the values), 1 with the error otherwise.
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <ddp/ddp.h>

namespace {

// A lost peer fails the test, never hangs it; HOST_RANK_TIMEOUT_S shortens it (a stopped rank's test).
std::chrono::milliseconds timeout() {
  const char* seconds = std::getenv("HOST_RANK_TIMEOUT_S");
  return std::chrono::seconds(seconds != nullptr ? std::stoi(seconds) : 60);
}

std::string env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) throw std::runtime_error(std::string(name) + " is not set");
  return value;
}

std::string hostname() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

float sum_of_ranks_plus_one(const ddp::ProcessGroupPtr& group) {
  auto value = torch::full({4}, static_cast<float>(ddp::get_rank(group) + 1));
  ddp::all_reduce(value, c10d::ReduceOp::SUM, group);
  return value[0].item<float>();
}

int64_t max_of_ranks(const ddp::ProcessGroupPtr& group) {
  auto value = torch::full({3}, static_cast<int64_t>(ddp::get_rank(group)), torch::kLong);
  ddp::all_reduce(value, c10d::ReduceOp::MAX, group);
  return value[2].item<int64_t>();
}

double average_of_ranks_plus_one(const ddp::ProcessGroupPtr& group) {
  auto value = torch::full({5}, static_cast<double>(ddp::get_rank(group) + 1), torch::kDouble);
  ddp::all_reduce(value, c10d::ReduceOp::AVG, group);
  return value[4].item<double>();
}

// The same random floats (seeded by the rank) all-reduced over `world` and over `flat`: 2M + 13 of
// them: three windows of the hierarchical scratch array, the last of 13 (an empty slice on one
// local rank), and slices that do not divide evenly. "yes" when the results
// agree within fp32 rounding and the world's is bit for bit the same on every rank.
std::string same_sum_as(const ddp::ProcessGroupPtr& world, const ddp::ProcessGroupPtr& flat) {
  torch::manual_seed(100 + ddp::get_rank(world));
  auto mine = torch::randn({(1 << 21) + 13});
  auto over_world = mine.clone(), over_flat = mine.clone();
  ddp::all_reduce(over_world, c10d::ReduceOp::SUM, world);
  ddp::all_reduce(over_flat, c10d::ReduceOp::SUM, flat);
  if (!torch::allclose(over_world, over_flat, 1e-5, 1e-5)) return "no";
  // The bits as int32, each times its position (any change moves the sum), summed in int64; the
  // lowest and highest over the ranks are equal when every rank holds the same bits.
  const auto positions = torch::arange(over_world.numel(), torch::kLong);
  auto checksum = (over_world.view(torch::kInt).to(torch::kLong) * positions).sum().reshape({1});
  auto lowest = checksum.clone(), highest = checksum.clone();
  ddp::all_reduce(lowest, c10d::ReduceOp::MIN, flat);
  ddp::all_reduce(highest, c10d::ReduceOp::MAX, flat);
  return lowest.item<int64_t>() == highest.item<int64_t>() ? "yes" : "differs between ranks";
}

// A two-layer MLP on a fixed batch of 4 rows per rank. Two DDP buckets: the first one is capped at
// 1 MiB; the other holds the 4.7 MiB weight, whose halves (one per local rank) cross the hosts in
// three pieces each (1 MiB pieces, two in flight: Hierarchical::allreduce_shared).
constexpr int64_t kInputs = 300, kHidden = 4096;
torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(kInputs, kHidden), torch::nn::ReLU(), torch::nn::Linear(kHidden, 8));
}

struct Batch {
  torch::Tensor inputs, targets;
};
Batch make_batch(int64_t rows) {
  torch::manual_seed(1);
  auto inputs = torch::randn({rows, kInputs});
  return {inputs, torch::randn({rows, 8})};
}

// "shared" when `tensor`'s memory is a mapping of a file in /dev/shm (torchddp's segments are
// unlinked once mapped: "(deleted)"), "private" otherwise: what the kernel says, in /proc/self/maps.
std::string memory_of(const torch::Tensor& tensor) {
  const auto address = reinterpret_cast<std::uintptr_t>(tensor.data_ptr());
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::uintptr_t from = 0, to = 0;
    if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR, &from, &to) != 2 || address < from || address >= to) continue;
    return line.find("/dev/shm/torchddp-") != std::string::npos ? "shared" : "private";
  }
  return "private";
}

// DDP's averaged gradients after one backward over this rank's quarter of the batch; `memory`, if
// given, is where the largest one lies (memory_of).
std::vector<torch::Tensor> ddp_gradients(const ddp::ProcessGroupPtr& group, std::string* memory = nullptr) {
  const int rank = ddp::get_rank(group), size = ddp::get_world_size(group);
  const Batch batch = make_batch(4 * size);
  auto model = make_model();
  ddp::DistributedDataParallel ddp_model(model.ptr(), group);
  const auto mine = torch::indexing::Slice(4 * rank, 4 * (rank + 1));
  torch::mse_loss(ddp_model.forward(batch.inputs.index({mine})), batch.targets.index({mine})).backward();
  std::vector<torch::Tensor> grads;
  for (const auto& parameter : model->parameters()) grads.push_back(parameter.grad().clone());
  if (memory != nullptr) *memory = memory_of(model->parameters()[0].grad());
  return grads;
}

// One process on the whole batch, without DDP.
std::vector<torch::Tensor> reference_gradients(int size) {
  const Batch batch = make_batch(4 * size);
  auto model = make_model();
  torch::mse_loss(model->forward(batch.inputs), batch.targets).backward();
  std::vector<torch::Tensor> grads;
  for (const auto& parameter : model->parameters()) grads.push_back(parameter.grad().clone());
  return grads;
}

bool close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  bool same = a.size() == b.size();
  for (size_t i = 0; same && i < a.size(); ++i) same = torch::allclose(a[i], b[i], 1e-5, 1e-6);
  return same;
}

ddp::ProcessGroupPtr init_world() {
  ddp::InitOptions world_options{"gloo", "env://"};
  world_options.timeout = timeout();
  world_options.hierarchical(std::getenv("HOST_RANK_NO_HIERARCHICAL") == nullptr);
  return ddp::init_process_group(world_options);
}

int check() {
  auto world = init_world();
  const int rank = ddp::get_rank();
  std::cout << "rank=" << rank << " host=" << hostname() << " world_transport=" << ddp::transport(world) << std::endl;
  std::cout << "rank=" << rank << " world_sum=" << sum_of_ranks_plus_one(world) << " world_max=" << max_of_ranks(world)
            << std::endl;
  // AVG: Gloo itself has none (LibTorch 1.13); the hierarchical allreduce sums, scaled.
  if (ddp::transport(world).find("hierarchical") != std::string::npos) {
    std::cout << "rank=" << rank << " world_avg=" << average_of_ranks_plus_one(world) << std::endl;
  }

  ddp::InitOptions host_options{"gloo", env("HOST_GROUP_INIT")};
  host_options.rank = std::stoi(env("LOCAL_RANK"));
  host_options.world_size = std::stoi(env("LOCAL_WORLD_SIZE"));
  host_options.timeout = timeout();
  auto host = ddp::new_process_group(host_options);
  std::cout << "rank=" << rank << " host_transport=" << ddp::transport(host)
            << " host_sum=" << sum_of_ranks_plus_one(host) << std::endl;

  auto flat = ddp::new_group(ddp::NewGroupOptions().shared_memory(false));
  std::cout << "rank=" << rank << " flat_transport=" << ddp::transport(flat)
            << " flat_match=" << same_sum_as(world, flat) << std::endl;

  std::string memory;
  const auto grads = ddp_gradients(world, &memory);
  std::cout << "rank=" << rank << " ddp_grads=" << (close(grads, reference_gradients(ddp::get_world_size())) ? "match" : "differ")
            << std::endl;
  std::cout << "rank=" << rank << " ddp_buckets=" << memory << std::endl;
  std::cout << "rank=" << rank << " ddp_grads_flat=" << (close(grads, ddp_gradients(flat)) ? "match" : "differ") << std::endl;
  ddp::barrier();  // nobody tears down the store while a peer still needs it
  ddp::destroy_process_group();
  return 0;
}

// --- halves: the reduce-scatter and all-gather over the world -----------------------------------

// Rank q's element i of its input: small integers, so that every sum, product and average of four
// is exact in every dtype; non-negative for uint8.
torch::Tensor known_input(int q, int64_t first, int64_t count, torch::ScalarType dtype) {
  auto i = torch::arange(first, first + count, torch::kLong);
  auto value = (i * 3 + q * 5 + torch::div(i, 7, "floor")) % 7;
  if (dtype != torch::kByte) value = value - 3;
  return value.to(dtype);
}

// The reduction of elements [first, first + count) of every rank's input, computed here (in float64
// or int64, then cast as the collective's dtype casts: exact for these inputs, uint8 wrapping).
torch::Tensor reduced_here(int size, int64_t first, int64_t count, torch::ScalarType dtype, c10d::ReduceOp op) {
  const bool floating = torch::isFloatingType(dtype);
  const auto wide = floating ? torch::kDouble : torch::kLong;
  std::vector<torch::Tensor> all;
  for (int q = 0; q < size; ++q) all.push_back(known_input(q, first, count, dtype).to(wide));
  auto stacked = torch::stack(all);
  torch::Tensor result;
  switch (static_cast<c10d::ReduceOp::RedOpType>(op)) {
    case c10d::ReduceOp::AVG: result = stacked.sum(0) / size; break;
    case c10d::ReduceOp::MAX: result = std::get<0>(stacked.max(0)); break;
    case c10d::ReduceOp::MIN: result = std::get<0>(stacked.min(0)); break;
    case c10d::ReduceOp::PRODUCT: result = stacked.prod(0); break;
    default: result = stacked.sum(0); break;
  }
  return result.to(dtype);
}

struct HalvesCount {
  int checked = 0, wrong = 0;
  void check(const torch::Tensor& got, const torch::Tensor& expected, int rank, const std::string& what) {
    ++checked;
    if (torch::equal(got, expected)) return;
    ++wrong;
    const auto differ = (got.to(torch::kDouble) != expected.to(torch::kDouble)).nonzero();
    const int64_t at = differ.numel() > 0 ? differ[0].item<int64_t>() : 0;
    std::cout << "rank=" << rank << " wrong=" << what << " (element " << at << " is " << got[at].item<double>()
              << ", expected " << expected[at].item<double>() << ")" << std::endl;
  }
};

void check_reduce_scatters(const ddp::ProcessGroupPtr& world, torch::ScalarType dtype, int64_t per_rank, HalvesCount& count) {
  const int rank = ddp::get_rank(world), size = ddp::get_world_size(world);
  std::vector<c10d::ReduceOp> ops{c10d::ReduceOp::SUM, c10d::ReduceOp::MAX, c10d::ReduceOp::MIN, c10d::ReduceOp::PRODUCT};
  if (torch::isFloatingType(dtype)) ops.push_back(c10d::ReduceOp::AVG);
  for (const auto& op : ops) {
    const auto expected = reduced_here(size, rank * per_rank, per_rank, dtype, op);
    const std::string what = "reduce_scatter " + std::string(c10::toString(dtype)) + " x " + std::to_string(per_rank) +
                             " op " + std::to_string(static_cast<int>(static_cast<c10d::ReduceOp::RedOpType>(op)));
    auto input = known_input(rank, 0, size * per_rank, dtype);
    auto output = torch::full({per_rank}, 99, dtype);
    ddp::reduce_scatter_tensor(output, input, op, world);
    count.check(output, expected, rank, what);
    // In place: the output is this rank's piece of the input.
    auto piece = input.narrow(0, rank * per_rank, per_rank);
    ddp::reduce_scatter_tensor(piece, input, op, world);
    count.check(piece, expected, rank, what + " in place");
  }
}

void check_all_gathers(const ddp::ProcessGroupPtr& world, torch::ScalarType dtype, int64_t per_rank, HalvesCount& count) {
  const int rank = ddp::get_rank(world), size = ddp::get_world_size(world);
  std::vector<torch::Tensor> all;
  for (int q = 0; q < size; ++q) all.push_back(known_input(q, 0, per_rank, dtype));
  const auto expected = torch::cat(all);
  const std::string what = "all_gather " + std::string(c10::toString(dtype)) + " x " + std::to_string(per_rank);
  auto output = torch::full({size * per_rank}, 99, dtype);
  ddp::all_gather_into_tensor(output, known_input(rank, 0, per_rank, dtype), world);
  count.check(output, expected, rank, what);
  auto in_place = torch::full({size * per_rank}, 99, dtype);
  auto piece = in_place.narrow(0, rank * per_rank, per_rank);
  piece.copy_(known_input(rank, 0, per_rank, dtype));
  ddp::all_gather_into_tensor(in_place, piece, world);
  count.check(in_place, expected, rank, what + " in place");
}

// This network namespace's bytes sent on eth0 (its link to the other hosts), from /proc/net/dev.
int64_t link_bytes_sent() {
  std::ifstream dev("/proc/net/dev");
  std::string line;
  while (std::getline(dev, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos || line.substr(0, colon).find("eth0") == std::string::npos) continue;
    std::istringstream fields(line.substr(colon + 1));
    int64_t value = 0;
    for (int field = 0; field < 9; ++field) fields >> value;  // received: 8 fields; then bytes sent
    return value;
  }
  return -1;
}

// Bytes this host sent while every rank ran `collective` once (the world's barriers around it).
template <typename Collective>
int64_t sent_during(const ddp::ProcessGroupPtr& world, Collective&& collective) {
  ddp::barrier(world);
  const int64_t before = link_bytes_sent();
  collective();
  ddp::barrier(world);
  return link_bytes_sent() - before;
}

int halves() {
  auto world = init_world();
  auto flat = ddp::new_group(ddp::NewGroupOptions().shared_memory(false));
  const int rank = ddp::get_rank(), size = ddp::get_world_size();
  std::cout << "rank=" << rank << " host=" << hostname() << " world_transport=" << ddp::transport(world) << std::endl;
  HalvesCount count;
  const std::vector<torch::ScalarType> dtypes{torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf,
                                              torch::kInt, torch::kLong, torch::kByte};
  for (const auto dtype : dtypes) {
    // One element; 13; just past one slice of 1 MiB crossing the hosts; three slices and a bit
    // (more than cross at once).
    const int64_t slice = (int64_t{1} << 20) / c10::elementSize(dtype);
    for (const int64_t per_rank : {int64_t{1}, int64_t{13}, slice + 7, 3 * slice + 5}) {
      check_reduce_scatters(world, dtype, per_rank, count);
      check_all_gathers(world, dtype, per_rank, count);
    }
  }
  std::cout << "rank=" << rank << " halves_checked=" << count.checked << " halves_wrong=" << count.wrong << std::endl;
  // What crossed the link: 8 MiB of input per rank reduce-scattered, 8 MiB of output gathered.
  const int64_t total = (int64_t{1} << 21) / size * size;  // float32 elements, a piece per rank
  auto input = torch::ones({total}), piece = torch::empty({total / size});
  auto gathered = torch::empty({total});
  const auto rs = [&](const ddp::ProcessGroupPtr& group) {
    return sent_during(world, [&] { ddp::reduce_scatter_tensor(piece, input, c10d::ReduceOp::SUM, group); });
  };
  const auto ag = [&](const ddp::ProcessGroupPtr& group) {
    return sent_during(world, [&] { ddp::all_gather_into_tensor(gathered, piece, group); });
  };
  const int64_t rs_world = rs(world), rs_flat = rs(flat), ag_world = ag(world), ag_flat = ag(flat);
  std::cout << "rank=" << rank << " halves_link rs_world=" << rs_world << " rs_flat=" << rs_flat << " ag_world=" << ag_world
            << " ag_flat=" << ag_flat << " input=" << total * 4 << std::endl;
  ddp::barrier();
  ddp::destroy_process_group();
  return count.wrong == 0 ? 0 : 1;
}

int forever(const std::string& what) {
  auto world = init_world();
  const int rank = ddp::get_rank(), size = ddp::get_world_size();
  auto tensor = torch::ones({8400000}), piece = torch::ones({8400000 / size});
  auto model = make_model();
  ddp::DistributedDataParallel ddp_model(model.ptr(), world);
  const Batch batch = make_batch(4);
  bool first = true;
  const auto step = [&] {
    if (what == "ddp") {
      torch::mse_loss(ddp_model.forward(batch.inputs), batch.targets).backward();
    } else if (what == "halves") {
      ddp::reduce_scatter_tensor(piece, tensor, c10d::ReduceOp::SUM, world);
      ddp::all_gather_into_tensor(tensor, piece, world);
    } else if (what == "desync" && !first) {  // the first host's ranks reduce-scatter, the others all-gather
      if (rank < size / 2) {
        ddp::reduce_scatter_tensor(piece, tensor, c10d::ReduceOp::SUM, world);
      } else {
        ddp::all_gather_into_tensor(tensor, piece, world);
      }
    } else if (what == "desync_allreduce" && !first) {  // the first host's ranks allreduce, the others reduce-scatter
      if (rank < size / 2) {
        ddp::all_reduce(tensor);
      } else {
        ddp::reduce_scatter_tensor(piece, tensor, c10d::ReduceOp::SUM, world);
      }
    } else {
      ddp::all_reduce(tensor);
    }
    first = false;
  };
  step();
  std::cout << "rank=" << rank << " ready transport=" << ddp::transport(world) << std::endl;
  try {
    for (;;) step();
  } catch (const ddp::CollectiveError& error) {
    std::string message = error.what();
    for (char& c : message) c = c == '\n' ? ' ' : c;
    std::cout << "rank=" << rank << " error=" << message << std::endl;
  }
  // Out at once: the test judges the message, not how a group with a dead peer tears down.
  std::_Exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  // As under Python: Gloo writes to a partner with writev, so a rank resumed after its partner left
  // would die of SIGPIPE before it reports its error.
  std::signal(SIGPIPE, SIG_IGN);
  try {
    if (argc > 1 && std::string(argv[1]) == "forever") return forever(argc > 2 ? argv[2] : "");
    if (argc > 1 && std::string(argv[1]) == "halves") return halves();
    return check();
  } catch (const std::exception& error) {
    std::cerr << "host_rank: error: " << error.what() << std::endl;
    return 1;
  }
}
