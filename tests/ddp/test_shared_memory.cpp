// The shared-memory channel through the public API (issue 24): a Gloo group whose ranks share this
// host moves CPU collectives through /dev/shm, with the same results as an independent reference
// (every rank's input regenerated here and folded in rank order in double, then cast), the same
// failure behaviour (a killed rank is named, nothing is left in /dev/shm), and Gloo alone when
// switched off. The core's own tests (every step, every wait) are tests/shm.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/distributed_data_parallel.h>

#include "error_of.h"
#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

// Rank r's input of a case: reproducible anywhere from (case, rank).
torch::Tensor input_of(int64_t numel, torch::ScalarType dtype, c10d::ReduceOp op, int rank, int64_t seed) {
  auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(seed * 131 + rank));
  torch::Tensor values;
  if (op == c10d::ReduceOp::PRODUCT) {  // 1 or 2 (products stay exact)
    values = torch::randint(1, 3, {numel}, generator, torch::kDouble);
  } else if (at::isFloatingType(dtype)) {
    values = torch::randn({numel}, generator, torch::kDouble) * 3;
  } else {
    values = torch::randint(0, 100, {numel}, generator, torch::kDouble);
  }
  return values.to(dtype);
}

torch::Tensor reference(int64_t numel, torch::ScalarType dtype, c10d::ReduceOp op, int world, int64_t seed) {
  torch::Tensor acc = input_of(numel, dtype, op, 0, seed).to(torch::kDouble);
  for (int r = 1; r < world; ++r) {
    const torch::Tensor x = input_of(numel, dtype, op, r, seed).to(torch::kDouble);
    switch (static_cast<c10d::ReduceOp::RedOpType>(op)) {
      case c10d::ReduceOp::MAX: acc = torch::maximum(acc, x); break;
      case c10d::ReduceOp::MIN: acc = torch::minimum(acc, x); break;
      case c10d::ReduceOp::PRODUCT: acc = acc * x; break;
      default: acc = acc + x;
    }
  }
  if (op == c10d::ReduceOp::AVG) acc = acc / world;
  return acc;
}

// How far a result may be from the double reference: one rounding of the format per input for
// float32/float64 sums (the channel adds in the format, rank by rank), one rounding of the result
// for bfloat16/float16 (added in float32, rounded once), nothing for integers.
double tolerance(torch::ScalarType dtype, const torch::Tensor& magnitude, int world) {
  const double scale = magnitude.abs().max().item<double>() + 1;
  switch (dtype) {
    case torch::kFloat: return scale * world * 1.2e-7;
    case torch::kDouble: return scale * world * 2.3e-16;
    case torch::kBFloat16: return scale * (1.0 / 128 + world * 1.2e-7);
    case torch::kHalf: return scale * (1.0 / 1024 + world * 1.2e-7);
    default: return 0;
  }
}

DDP_WORKER(shm_numerics) {
  worker_init();
  require(ddp::transport() == "gloo+shm", "expected shared memory, got " + ddp::transport());
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  const int64_t chunk = (int64_t{512} << 10) / 4;  // float32 elements per chunk (shm::Options' default)
  const std::vector<int64_t> sizes = {0, 1, world - 1, 1001, chunk - 1, chunk, chunk + 1, 2 * chunk + 7};
  const std::vector<torch::ScalarType> dtypes = {torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf,
                                                 torch::kInt,   torch::kLong,   torch::kByte};
  const std::vector<c10d::ReduceOp> ops = {c10d::ReduceOp::SUM, c10d::ReduceOp::AVG, c10d::ReduceOp::MAX,
                                           c10d::ReduceOp::MIN, c10d::ReduceOp::PRODUCT};
  int64_t seed = 0;
  for (const auto dtype : dtypes) {
    for (const auto op : ops) {
      if (op == c10d::ReduceOp::AVG && !at::isFloatingType(dtype)) continue;
      for (const int64_t numel : sizes) {
        // Large sizes once per dtype (SUM): the chunk boundaries are the same for every op.
        if (numel > 1001 && op != c10d::ReduceOp::SUM) continue;
        if (dtype == torch::kByte && op == c10d::ReduceOp::SUM && world > 2) continue;  // would wrap
        ++seed;
        torch::Tensor tensor = input_of(numel, dtype, op, rank, seed);
        ddp::all_reduce(tensor, op);
        const torch::Tensor want = reference(numel, dtype, op, world, seed);
        const double off = numel == 0 ? 0 : (tensor.to(torch::kDouble) - want).abs().max().item<double>();
        const double allowed = numel == 0 ? 0 : tolerance(dtype, want, world);
        require(off <= allowed, std::string("all_reduce of ") + std::to_string(numel) + " " +
                                    c10::toString(dtype) + " with op " + std::to_string(static_cast<int>(op)) +
                                    ": off by " + std::to_string(off) + " > " + std::to_string(allowed));
      }
    }
  }
  // broadcast from every root, all_gather, barrier.
  for (int root = 0; root < world; ++root) {
    torch::Tensor tensor = input_of(chunk + 3, torch::kFloat, c10d::ReduceOp::SUM, rank, 1000 + root);
    ddp::broadcast(tensor, root);
    require(torch::equal(tensor, input_of(chunk + 3, torch::kFloat, c10d::ReduceOp::SUM, root, 1000 + root)),
            "broadcast from rank " + std::to_string(root));
  }
  const auto gathered = ddp::all_gather(input_of(77, torch::kLong, c10d::ReduceOp::SUM, rank, 2000));
  for (int r = 0; r < world; ++r) {
    require(torch::equal(gathered[r], input_of(77, torch::kLong, c10d::ReduceOp::SUM, r, 2000)),
            "all_gather part of rank " + std::to_string(r));
  }
  ddp::barrier();
}
TEST(SharedMemory, AllreduceBroadcastGatherMatchTheReferenceAtTwoRanks) {
  EXPECT_WORKERS_OK(run_workers("shm_numerics", 2));
}
TEST(SharedMemory, AllreduceBroadcastGatherMatchTheReferenceAtThreeRanks) {
  EXPECT_WORKERS_OK(run_workers("shm_numerics", 3));
}
TEST(SharedMemory, AllreduceBroadcastGatherMatchTheReferenceAtFourRanks) {
  RunOptions options;
  options.timeout = std::chrono::seconds(180);
  EXPECT_WORKERS_OK(run_workers("shm_numerics", 4, options));
}

// A small collective issued while the channel is idle runs on the caller's thread (it is complete
// when the call returns: no thread switch); one issued behind a running or queued collective
// waits its turn, so the ranks' order of calls is kept. Both give the reference's result.
DDP_WORKER(shm_small_in_order) {
  auto pg = worker_init();
  require(ddp::transport() == "gloo+shm", "expected shared memory, got " + ddp::transport());
  const int world = ddp::get_world_size();
  const float ranks_sum = world * (world + 1) / 2.0f;
  for (int round = 1; round <= 20; ++round) {
    std::vector<at::Tensor> big{torch::full({2 << 20}, static_cast<float>(ddp::get_rank() + 1))};  // 8 MiB
    std::vector<at::Tensor> small{torch::full({16}, static_cast<float>((ddp::get_rank() + 1) * round))};
    auto big_work = pg->allreduce(big);
    auto small_work = pg->allreduce(small);
    small_work->wait();
    require(big_work->isCompleted(), "a small allreduce issued behind a large one finished first");
    big_work->wait();
    require(torch::equal(big[0], torch::full({2 << 20}, ranks_sum)), "the large allreduce's sum");
    require(torch::equal(small[0], torch::full({16}, ranks_sum * round)), "the small allreduce's sum");
  }
  std::vector<at::Tensor> idle{torch::ones({1024})};  // 4 KB
  auto work = pg->allreduce(idle);
  require(work->isCompleted(), "a 4 KB allreduce on an idle channel was handed to another thread");
  require(torch::equal(idle[0], torch::full({1024}, static_cast<float>(world))), "the idle allreduce's sum");
  ddp::barrier();
}
TEST(SharedMemory, SmallCollectivesRunOnTheCallersThreadInTheOrderTheyWereIssued) {
  EXPECT_WORKERS_OK(run_workers("shm_small_in_order", 2));
}

// Two jobs on one host at once, each with its own segments (the nonce rank 0 draws; the run id):
// both correct, neither sees the other's data.
TEST(SharedMemory, TwoJobsOnOneHostAtOnceAreBothCorrect) {
  std::vector<WorkerResult> first, second;
  std::thread other([&] { second = run_workers("shm_numerics", 2); });
  first = run_workers("shm_numerics", 2);
  other.join();
  EXPECT_WORKERS_OK(first);
  EXPECT_WORKERS_OK(second);
}

// Off by the environment (on any rank) or by InitOptions: Gloo alone, and said so.
DDP_WORKER(shm_switched_off) {
  worker_init();
  const char* env = std::getenv("TORCHDDP_SHM");
  require(ddp::transport() == "gloo", "expected Gloo alone (TORCHDDP_SHM=" + std::string(env ? env : "") +
                                          " on rank 1), got " + ddp::transport());
  auto tensor = torch::ones({5});
  ddp::all_reduce(tensor);
  require(tensor.sum().item<float>() == 5 * ddp::get_world_size(), "sum over Gloo");
}
TEST(SharedMemory, OffOnOneRankIsOffForTheWholeGroup) {
  RunOptions options;
  options.rank_env[1] = {{"TORCHDDP_SHM", "0"}};
  EXPECT_WORKERS_OK(run_workers("shm_switched_off", 2, options));
}

// DDP's buckets live in shared memory (issue 24), and without gradient_as_bucket_view a bucket's
// slot becomes a parameter's gradient when nobody else can see it. Whatever the reducer does with
// that, a user sees PyTorch's semantics, checked against one process on the whole batch:
// gradients right after fresh, zeroed, reset and handed-in gradients; a gradient defined before
// backward is the same tensor after it; a gradient the user kept (or a view of it) across a reset
// keeps its values; a parameter unused on every rank keeps its gradient.
DDP_WORKER(shm_bucket_semantics) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  require(ddp::transport() == "gloo+shm", "expected shared memory, got " + ddp::transport());
  torch::manual_seed(3);
  Branchy local, reference;
  ddp::DistributedDataParallel model(local, ddp::DDPOptions().find_unused_parameters(true));
  copy_parameters(*model.module(), *reference);
  const auto params = model.parameters(), expected = reference->parameters();
  int step = 0;
  const auto train = [&](bool use_branch, const std::string& what) {
    auto [x, y] = batch(step++);
    torch::mse_loss(model.forward(shard(x, rank, world), use_branch), shard(y, rank, world)).backward();
    torch::mse_loss(reference->forward(x, use_branch), y).backward();
    for (size_t i = 0; i < params.size(); ++i) {
      require(params[i].grad().defined() == expected[i].grad().defined(), what + ": gradient " + std::to_string(i) + " defined?");
      if (!params[i].grad().defined()) continue;
      require(torch::allclose(params[i].grad(), expected[i].grad(), 1e-5, 1e-6),
              what + ": gradient " + std::to_string(i) + " differs by " +
                  std::to_string((params[i].grad() - expected[i].grad()).abs().max().item<double>()));
    }
  };
  const auto reset = [&] {
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad().reset();
      expected[i].mutable_grad().reset();
    }
  };
  const auto zero = [&] {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad().zero_();
      expected[i].mutable_grad().zero_();
    }
  };

  train(true, "fresh gradients");
  train(true, "fresh gradients again (after the bucket rebuild)");
  zero();
  const torch::Tensor before = params[0].grad();
  train(true, "zeroed gradients");
  require(params[0].grad().is_same(before), "a gradient defined before backward is another tensor after it");

  const torch::Tensor kept = params[0].grad(), kept_view = params[2].grad().view(-1);
  const torch::Tensor kept_values = kept.clone(), kept_view_values = kept_view.clone();
  reset();
  train(true, "reset gradients");
  require(torch::equal(kept, kept_values), "a gradient kept across a reset changed");
  require(torch::equal(kept_view, kept_view_values), "a view of a gradient kept across a reset changed");

  reset();
  const torch::Tensor mine = torch::zeros_like(params[0]);
  params[0].mutable_grad() = mine;
  expected[0].mutable_grad() = torch::zeros_like(expected[0]);
  train(true, "a gradient handed in");
  require(params[0].grad().is_same(mine), "the gradient handed in is not the parameter's gradient after backward");

  train(false, "accumulated, the branch unused on every rank");  // branch keeps its gradient, as the reference's
  train(true, "accumulated, the branch used again");
}
TEST(SharedMemory, BucketsInSharedMemoryKeepPyTorchsGradientSemanticsAtTwoRanks) {
  EXPECT_WORKERS_OK(run_workers("shm_bucket_semantics", 2));
}
TEST(SharedMemory, BucketsInSharedMemoryKeepPyTorchsGradientSemanticsAtThreeRanks) {
  EXPECT_WORKERS_OK(run_workers("shm_bucket_semantics", 3));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Names of this job's segments in /dev/shm (the channel's names start with /torchddp-<run id>).
std::vector<std::string> shm_entries(const std::string& run_id) {
  std::vector<std::string> found;
  if (DIR* dir = opendir("/dev/shm")) {
    while (const dirent* entry = readdir(dir)) {
      const std::string name = entry->d_name;
      if (name.rfind("torchddp-" + run_id, 0) == 0) found.push_back(name);
    }
    closedir(dir);
  }
  return found;
}

// A rank that all-reduces 33.6 MB again and again until something fails; it writes the error.
DDP_WORKER(shm_allreduce_forever) {
  worker_init(std::chrono::seconds(30));
  require(ddp::transport() == "gloo+shm", "expected shared memory, got " + ddp::transport());
  write_shared("ready." + std::to_string(ddp::get_rank()), "1");
  auto tensor = torch::ones({8400000});
  const std::string message = error_of<ddp::CollectiveError>([&] {
    for (;;) ddp::all_reduce(tensor);
  });
  write_shared("error." + std::to_string(ddp::get_rank()), message);
}

// A rank that trains DDP on 33.6 MB of gradients (its buckets in shared memory) until something
// fails; it writes the error.
DDP_WORKER(shm_train_forever) {
  worker_init(std::chrono::seconds(30));
  require(ddp::transport() == "gloo+shm", "expected shared memory, got " + ddp::transport());
  torch::nn::Linear local(2900, 2900);
  ddp::DistributedDataParallel model(local);
  write_shared("ready." + std::to_string(ddp::get_rank()), "1");
  const auto input = torch::randn({4, 2900});
  const std::string message = error_of<ddp::CollectiveError>([&] {
    for (;;) model.forward(input).sum().backward();
  });
  write_shared("error." + std::to_string(ddp::get_rank()), message);
}

// SIGKILL of a random rank in the middle of 33.6 MB allreduces, ten times: eight times in a loop of
// allreduces, twice in DDP training (its buckets in shared memory): every other rank fails within seconds (not the 30 s
// timeout) naming the killed rank, and /dev/shm holds nothing of the job afterwards (every
// segment was unlinked as soon as every rank had mapped it).
TEST(SharedMemory, AKilledRankIsNamedAndNothingIsLeftInDevShm) {
  std::mt19937 random(7);
  for (int round = 0; round < 10; ++round) {
    const char* worker = round < 8 ? "shm_allreduce_forever" : "shm_train_forever";
    const int world = 3;
    const std::string dir = make_temp_dir("shm_kill");
    const std::string run_id = "shmkill" + std::to_string(getpid()) + "r" + std::to_string(round);
    std::vector<pid_t> pids;
    for (int rank = 0; rank < world; ++rank) {
      pids.push_back(spawn_worker(worker,
                                  {{"RANK", std::to_string(rank)}, {"WORLD_SIZE", std::to_string(world)},
                                   {"DDP_TEST_DIR", dir}, {"DDP_TEST_STORE", dir + "/store"},
                                   {"OMP_NUM_THREADS", "1"}, {"TORCHDDP_RUN_ID", run_id}},
                                  dir + "/log." + std::to_string(rank)));
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    auto exists = [&](const std::string& name) { return access((dir + "/" + name).c_str(), F_OK) == 0; };
    for (int rank = 0; rank < world; ++rank) {
      while (!exists("ready." + std::to_string(rank)) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(50, 400)(random)));
    const int victim = std::uniform_int_distribution<int>(0, world - 1)(random);
    ASSERT_EQ(kill(pids[victim], SIGKILL), 0);
    const auto killed_at = std::chrono::steady_clock::now();
    ASSERT_EQ(waitpid(pids[victim], nullptr, 0), pids[victim]);  // gone, as under a launcher that reaps
    for (int rank = 0; rank < world; ++rank) {
      if (rank == victim) continue;
      int status = 0;
      while (waitpid(pids[rank], &status, WNOHANG) == 0) {
        if (std::chrono::steady_clock::now() > killed_at + std::chrono::seconds(25)) {
          for (pid_t pid : pids) kill(pid, SIGKILL);
          FAIL() << "round " << round << ": rank " << rank << " still runs 25 s after rank " << victim << " was killed";
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      const std::string message = read_file(dir + "/error." + std::to_string(rank));
      EXPECT_NE(message.find("rank " + std::to_string(victim)), std::string::npos)
          << "round " << round << ", rank " << rank << " does not name killed rank " << victim << ": " << message;
      // The stall check after it tells an exit from a stop: the killed rank's pid means it here too.
      EXPECT_NE(message.find("rank " + std::to_string(victim) + " exited (no heartbeat for 2.5 s: its process, pid " +
                             std::to_string(pids[victim]) + ", is gone)"),
                std::string::npos)
          << "round " << round << ", rank " << rank << "'s stall check does not say killed rank " << victim << " exited: " << message;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
    EXPECT_LT(seconds, 15) << "round " << round << ": the survivors took " << seconds << " s to fail";
    EXPECT_TRUE(shm_entries(run_id).empty()) << "round " << round << ": left in /dev/shm: " << shm_entries(run_id)[0];
    remove_tree(dir);
  }
}

}  // namespace
