// "No per-iteration heap allocation beyond what the collective needs", measured: operator new is
// replaced for the whole binary by a counting one that only counts while a measurement is on.
// Tensor storage comes from c10's allocator, not operator new, but every new tensor also allocates
// its TensorImpl and StorageImpl with new, so it is counted too.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iostream>
#include <new>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/distributed_data_parallel.h>

#include "models.h"
#include "multiprocess.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_news{0};
// When set, only allocations of threads that set t_counted count: at world 2, Gloo's transport
// threads allocate per message in a timing-dependent way, so only the training thread is counted.
std::atomic<bool> g_counted_threads_only{false};
thread_local bool t_counted = false;
}  // namespace

void* operator new(std::size_t size) {
  if (g_counting.load(std::memory_order_relaxed) && (t_counted || !g_counted_threads_only.load(std::memory_order_relaxed))) {
    g_news.fetch_add(1, std::memory_order_relaxed);
  }
  if (void* p = std::malloc(size ? size : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return ::operator new(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace {

using namespace ddp::test;

// operator new calls during each of `steps` calls of `step`.
template <typename Step>
std::vector<int64_t> count_news(int steps, Step&& step) {
  std::vector<int64_t> counts(steps);
  for (auto& count : counts) {
    g_news = 0;
    g_counting = true;
    step();
    g_counting = false;
    count = g_news;
  }
  return counts;
}

std::string show(const std::vector<int64_t>& counts) {
  std::string out;
  for (int64_t count : counts) out += (out.empty() ? "" : " ") + std::to_string(count);
  return out;
}

int64_t median(std::vector<int64_t> counts) {
  std::sort(counts.begin(), counts.end());
  return counts[counts.size() / 2];
}

// Steady-state DDP steps (iterations 11..18, after the first 10 that logging_data() samples) against the same steps without DDP plus one allreduce
// per bucket, launched together and then waited for: what DDP has to send anyway.
//
// Measured on LibTorch 1.13 (6 parameters, one bucket each), both worlds: DDP's backward makes 8
// more allocations (the engine copies the inputs of every node that has a post-hook: one per
// parameter; the end-of-backward callback and its list: 2) and its forward 8 fewer (DDP holds the
// gradient accumulators, which a plain model re-creates on every forward): +1 net per step. Copying
// into buckets, averaging and writing back allocate nothing; one temporary tensor per gradient
// would cost at least 2 allocations per parameter and fail the bound below.
DDP_WORKER(allocations) {
  worker_init();
  const int world = ddp::get_world_size();
  t_counted = true;
  g_counted_threads_only = world > 1;
  torch::manual_seed(3);
  MLP plain, wrapped;
  ddp::DistributedDataParallel model(wrapped, ddp::DDPOptions().first_bucket_cap_mb(0).bucket_cap_mb(0));
  auto x = torch::randn({4, 10});
  auto ddp_step = [&] { model.forward(x).sum().backward(); };

  auto params = model.named_parameters();
  std::vector<std::vector<torch::Tensor>> buckets;
  for (const auto& bucket : model.reduction_stats().buckets) {
    int64_t numel = 0;
    for (const auto& name : bucket) numel += params[name].numel();
    buckets.push_back({torch::zeros({numel})});
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works(buckets.size());
  auto group = ddp::default_group();
  auto plain_step = [&] {
    plain->forward(x).sum().backward();
    for (size_t b = 0; b < buckets.size(); ++b) works[b] = group->allreduce(buckets[b]);
    for (auto& work : works) work->wait();
  };

  // Iterations 0..10 warm up (the one bucket rebuild happens at the second forward; the first 10
  // are timed for logging_data(), which registers a callback per bucket); 11..18 count.
  for (int i = 0; i < 11; ++i) {
    ddp_step();
    plain_step();
  }
  const auto with_ddp = count_news(8, ddp_step);
  const auto without = count_news(8, plain_step);
  const std::string counts = "operator new per step, DDP: " + show(with_ddp) + "; plain + allreduces: " + show(without);
  std::cout << counts << std::endl;
  // Constant: the same count every step (Gloo's work queue growing by a block may add 1 now and then).
  const auto [least, most] = std::minmax_element(with_ddp.begin(), with_ddp.end());
  require(*most - *least <= 2, "DDP's allocations per step vary: " + counts);
  const int64_t bound = static_cast<int64_t>(params.size()) + 2;
  require(median(with_ddp) - median(without) <= bound,
          "DDP allocates more than " + std::to_string(bound) + " times per step beyond plain training and its allreduces: " +
              counts);
}

// World 1: every thread counted, Gloo's included.
TEST(DDPAllocations, SteadyStateWorldOneAllThreads) { EXPECT_WORKERS_OK(run_workers("allocations", 1)); }
// World 2: the averaging path runs too; the training thread is counted.
TEST(DDPAllocations, SteadyStateWorldTwoTrainingThread) { EXPECT_WORKERS_OK(run_workers("allocations", 2)); }

}  // namespace
