// Communication hooks: the built-ins against independent references (DDP without a hook, every
// rank's local gradients gathered and averaged here), the GradBucket a hook sees, the options they
// combine with, and every misuse.
#include <cmath>

#include <functional>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/comm_hooks.h>
#include <ddp/distributed_data_parallel.h>

#include "models.h"
#include "multiprocess.h"
#include "error_of.h"

namespace {

using namespace ddp::test;

// Several buckets, so that hooks run on more than one and in order.
ddp::DDPOptions small_buckets() { return ddp::DDPOptions().first_bucket_cap_mb(0).bucket_cap_mb(0.001); }

std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.grad().clone());
  return out;
}

// The allreduce() hook gives the gradients of DDP without a hook, bit for bit, over 5 SGD steps,
// with every option it must combine with.
DDP_WORKER(allreduce_hook_bitwise) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  struct Config {
    const char* name;
    ddp::DDPOptions options;
    bool accumulate;  // two no_sync backward passes before each synced one
  };
  const Config configs[] = {
      {"plain", small_buckets(), false},
      {"one bucket", ddp::DDPOptions(), false},
      {"no_sync", small_buckets(), true},
      {"gradient_as_bucket_view", small_buckets().gradient_as_bucket_view(true), false},
      {"find_unused_parameters", small_buckets().find_unused_parameters(true), false},
      {"static_graph", small_buckets().static_graph(true), false},
  };
  for (const auto& config : configs) {
    torch::manual_seed(3);
    MLP plain_net, hooked_net;
    copy_parameters(*plain_net, *hooked_net);
    ddp::DistributedDataParallel plain(plain_net, config.options);
    ddp::DistributedDataParallel hooked(hooked_net, config.options);
    hooked.register_comm_hook(ddp::hooks::allreduce());
    torch::optim::SGD plain_opt(plain.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD hooked_opt(hooked.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 5; ++step) {
      for (auto* pair : {&plain_opt, &hooked_opt}) pair->zero_grad();
      auto train = [&](auto& model) {
        if (config.accumulate) {
          auto guard = model.no_sync();
          for (int micro = 0; micro < 2; ++micro) {
            auto [x, y] = batch(100 * step + micro);
            torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
          }
        }
        auto [x, y] = batch(step);
        torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
      };
      train(plain);
      train(hooked);
      const auto want = grads_of(plain.parameters()), got = grads_of(hooked.parameters());
      for (size_t i = 0; i < want.size(); ++i) {
        require(torch::equal(want[i], got[i]), std::string(config.name) + ": step " + std::to_string(step) +
                                                   " gradient " + std::to_string(i) + " differs from no hook");
      }
      plain_opt.step();
      hooked_opt.step();
    }
    require(hooked.reduction_stats().iterations_reduced == 5, std::string(config.name) + ": iterations");
  }
}
TEST(CommHooks, AllreduceHookIsBitwiseEqualToNoHookWorld2) { EXPECT_WORKERS_OK(run_workers("allreduce_hook_bitwise", 2)); }
TEST(CommHooks, AllreduceHookIsBitwiseEqualToNoHookWorld3) { EXPECT_WORKERS_OK(run_workers("allreduce_hook_bitwise", 3)); }

// fp16 / bf16: the average of every rank's local gradient, within the format's rounding.
// Each rank contributes x_r = g_r / W rounded once to the format (relative error u: 2^-11 for
// float16, 2^-8 for bfloat16), and the sum adds at most W - 1 more roundings of a partial sum,
// each at most u * sum_r |x_r|; float16 also loses up to 2^-25 absolute per rounding in its
// subnormal range. So elementwise
//     |hook - mean_r g_r|  <=  W * u * sum_r |g_r| / W  +  (2W - 1) * tiny
// with tiny = 2^-25 for float16 and 0 for bfloat16 (its range is float32's).
void check_compression(const std::string& name, const ddp::CommHook& hook, double unit_roundoff, double tiny) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(5);
  MLP net, local;
  copy_parameters(*net, *local);
  ddp::DistributedDataParallel model(net, small_buckets());
  model.register_comm_hook(hook);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    // The independent reference: this rank's own gradient, without DDP, gathered from every rank.
    local->zero_grad();
    torch::mse_loss(local->forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    model.zero_grad();
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    bool rounded_somewhere = false;
    const auto params = model.parameters(), locals = local->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      auto all = ddp::all_gather(locals[i].grad());
      torch::Tensor mean = torch::zeros_like(all[0]), magnitude = torch::zeros_like(all[0]);
      for (const auto& g : all) {
        mean += g;
        magnitude += g.abs();
      }
      mean /= world;
      const auto bound = magnitude * unit_roundoff + (2 * world - 1) * tiny + 1e-12;
      const auto error = (params[i].grad() - mean).abs();
      const auto worst = (error - bound).max().item<double>();
      require(worst <= 0, name + ": step " + std::to_string(step) + " gradient " + std::to_string(i) +
                              " off the fp32 average by more than the bound (excess " + std::to_string(worst) + ")");
      rounded_somewhere = rounded_somewhere || !torch::equal(params[i].grad(), mean);
    }
    // A hook that did not compress at all would pass the bound: it must not.
    require(rounded_somewhere, name + ": no gradient shows any rounding; was anything compressed?");
    for (auto& p : local->parameters()) p.grad().zero_();
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {  // the same SGD step on both, from the DDP gradient
      params[i].sub_(0.1 * params[i].grad());
      locals[i].copy_(params[i]);
    }
  }
}

DDP_WORKER(compression_bounds) {
  worker_init();
  check_compression("fp16_compress", ddp::hooks::fp16_compress(), std::ldexp(1.0, -11), std::ldexp(1.0, -25));
  check_compression("bf16_compress", ddp::hooks::bf16_compress(), std::ldexp(1.0, -8), 0.0);
  // The wrappers around the allreduce hook: the same formats, the same bounds.
  check_compression("fp16_compress_wrapper(allreduce)", ddp::hooks::fp16_compress_wrapper(ddp::hooks::allreduce()),
                    std::ldexp(1.0, -11), std::ldexp(1.0, -25));
}
TEST(CommHooks, CompressionStaysWithinTheFormatsRoundingWorld2) { EXPECT_WORKERS_OK(run_workers("compression_bounds", 2)); }
TEST(CommHooks, CompressionStaysWithinTheFormatsRoundingWorld3) { EXPECT_WORKERS_OK(run_workers("compression_bounds", 3)); }

// What a hook sees: buckets in launch order, the last one flagged, the raw (undivided) local
// gradients in buffer(), views and offsets that agree with it, and state kept across calls.
DDP_WORKER(grad_bucket_contents) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  torch::manual_seed(9);
  MLP net, local;
  copy_parameters(*net, *local);
  ddp::DistributedDataParallel model(net, small_buckets());
  struct Seen {
    std::vector<size_t> indices;
    std::vector<bool> last;
    std::map<const void*, torch::Tensor> raw;  // parameter -> its buffer slice when the hook ran
  };
  auto seen = std::make_shared<Seen>();
  model.register_comm_hook([seen](ddp::GradBucket& bucket) {
    seen->indices.push_back(bucket.index());
    seen->last.push_back(bucket.is_last());
    require(bucket.gradients().size() == bucket.parameters().size(), "one gradient view per parameter");
    for (size_t k = 0; k < bucket.parameters().size(); ++k) {
      const auto& p = bucket.parameters()[k];
      const auto slice = bucket.buffer().narrow(0, bucket.offsets()[k], p.numel()).view(p.sizes());
      require(torch::equal(slice, bucket.gradients()[k]), "gradients() disagrees with buffer() at offsets()");
      seen->raw[p.unsafeGetTensorImpl()] = slice.clone();
    }
    bucket.buffer().div_(bucket.world_size());
    return ddp::hooks::allreduce_future(bucket.process_group(), bucket.buffer());
  });
  auto [x, y] = batch(0);
  torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
  torch::mse_loss(local->forward(shard(x, rank, world)), shard(y, rank, world)).backward();
  const size_t buckets = model.reduction_stats().buckets.size();
  require(buckets > 2, "the test needs several buckets");
  require(seen->indices.size() == buckets, "the hook ran " + std::to_string(seen->indices.size()) + " times for " +
                                               std::to_string(buckets) + " buckets");
  for (size_t b = 0; b < buckets; ++b) {
    require(seen->indices[b] == b, "buckets reached the hook out of order");
    require(seen->last[b] == (b + 1 == buckets), "is_last() wrong for bucket " + std::to_string(b));
  }
  // buffer() held this rank's own, undivided gradient.
  const auto params = model.parameters(), locals = local->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    require(torch::allclose(seen->raw.at(params[i].unsafeGetTensorImpl()), locals[i].grad(), 1e-6, 1e-7),
            "buffer() is not this rank's raw gradient for parameter " + std::to_string(i));
  }
}
TEST(CommHooks, GradBucketHoldsRawGradientsInLaunchOrder) { EXPECT_WORKERS_OK(run_workers("grad_bucket_contents", 2)); }

// --- misuse -----------------------------------------------------------------------------------------

DDP_WORKER(register_misuse) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  MLP net;
  ddp::DistributedDataParallel model(net);
  model.register_comm_hook(ddp::hooks::fp16_compress());
  auto twice = error_of([&] { model.register_comm_hook(ddp::hooks::allreduce()); });
  require_mentions(twice, "already registered", "second registration");
  require_mentions(twice, "fp16_compress", "second registration names the first hook");

  MLP other_net;
  ddp::DistributedDataParallel other(other_net);
  auto [x, y] = batch(0);
  torch::mse_loss(other.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
  auto late = error_of([&] { other.register_comm_hook(ddp::hooks::allreduce()); });
  require_mentions(late, "before training starts", "registration after training began");
}
TEST(CommHooksErrors, RegisteringTwiceOrAfterTrainingStarted) { EXPECT_WORKERS_OK(run_workers("register_misuse", 2)); }

// Hooks are registered rank by rank; ranks that registered different ones (or options) used to
// abort in Gloo at the first bucket ("op.preamble.length <= op.nbytes"). Now every rank's first
// backward throws, listing each rank's hook, and nothing is reduced.
DDP_WORKER(different_hooks) {
  worker_init(std::chrono::seconds(10));
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  auto [x, y] = batch(0);
  auto first_backward = [&](const std::function<void(ddp::DistributedDataParallel<MLPImpl>&)>& register_hook) {
    MLP net;
    ddp::DistributedDataParallel model(net, small_buckets());
    register_hook(model);
    return error_of([&] { torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward(); });
  };
  auto none_here = first_backward([&](auto& model) {
    if (rank == 0) model.register_comm_hook(ddp::hooks::fp16_compress());
  });
  require_mentions(none_here, "different communication hooks", "fp16 on rank 0 only");
  require_mentions(none_here, "rank 0: 'fp16_compress'; rank 1: no hook", "fp16 on rank 0 only");

  auto other_rank = first_backward([&](auto& model) {
    model.register_comm_hook(ddp::hooks::powersgd(
        ddp::hooks::PowerSGDOptions().matrix_approximation_rank(1 + rank).start_powerSGD_iter(2)));
  });
  require_mentions(other_rank, "rank 0: 'powersgd' (matrix_approximation_rank=1,", "PowerSGD ranks");
  require_mentions(other_rank, "rank 1: 'powersgd' (matrix_approximation_rank=2,", "PowerSGD ranks");

  // The same hook everywhere still trains (wrappers carry their inner hook's settings).
  auto same = first_backward([&](auto& model) {
    model.register_comm_hook(ddp::hooks::fp16_compress_wrapper(ddp::hooks::powersgd(
        ddp::hooks::PowerSGDOptions().matrix_approximation_rank(2).start_powerSGD_iter(2))));
  });
  require(same.empty(), "the same hook on every rank failed: " + same);
}
TEST(CommHooksErrors, RanksWithDifferentHooksFailNamingEachRanksHook) {
  EXPECT_WORKERS_OK(run_workers("different_hooks", 2));
  RunOptions gloo_only;  // where it used to abort the process
  gloo_only.env["TORCHDDP_SHM"] = "0";
  EXPECT_WORKERS_OK(run_workers("different_hooks", 2, gloo_only));
}

// A hook whose future holds the wrong shape or dtype: the end of backward names the bucket and
// what was expected, on every rank (every rank runs the same faulty hook).
DDP_WORKER(wrong_result) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  for (const std::string fault : {"shape", "dtype"}) {
    MLP net;
    ddp::DistributedDataParallel model(net, small_buckets());
    model.register_comm_hook([fault](ddp::GradBucket& bucket) {
      auto result = fault == "shape" ? bucket.buffer().narrow(0, 0, 1).clone() : bucket.buffer().to(torch::kDouble);
      return ddp::hooks::completed_future(result);
    });
    auto [x, y] = batch(0);
    auto message = error_of([&] {
      torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    });
    require_mentions(message, "gradient bucket 0", fault);
    require_mentions(message, "buffer is", fault);
    require_mentions(message, fault == "shape" ? "[1]" : "Double", fault);
  }
}
TEST(CommHooksErrors, FutureWithWrongShapeOrDtypeNamesTheBucket) { EXPECT_WORKERS_OK(run_workers("wrong_result", 2)); }

// A hook that throws on rank 0's bucket 1: rank 0 gets the error at the end of backward naming the
// bucket and the hook's message; rank 1, whose bucket-1 collective has no partner, gets a clear
// error within the timeout instead of hanging. `thrower` throws what the hook throws.
void check_throwing_hook(const std::function<void()>& thrower, const std::string& rank0_hears) {
  worker_init(std::chrono::seconds(5));
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  MLP net;
  ddp::DistributedDataParallel model(net, small_buckets());
  model.register_comm_hook([rank, thrower](ddp::GradBucket& bucket) {
    if (rank == 0 && bucket.index() == 1) thrower();
    bucket.buffer().div_(bucket.world_size());
    return ddp::hooks::allreduce_future(bucket.process_group(), bucket.buffer());
  });
  auto [x, y] = batch(0);
  const auto start = std::chrono::steady_clock::now();
  auto message = error_of([&] {
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (rank == 0) {
    require_mentions(message, "gradient bucket 1", "rank 0");
    require_mentions(message, rank0_hears, "rank 0");
  } else {
    require(!message.empty(), "rank 1's backward succeeded although rank 0 never reduced bucket 1");
    require_mentions(message, "gradient bucket 1", "rank 1");
    require(seconds < 30, "rank 1 took " + std::to_string(seconds) + " s to fail");
  }
}
DDP_WORKER(throwing_hook) {
  check_throwing_hook([] { throw std::runtime_error("deliberate failure in the hook"); }, "deliberate failure in the hook");
}
// Something that is not a std::exception used to end the process (std::terminate on the hook thread).
DDP_WORKER(throwing_hook_not_std) {
  check_throwing_hook([] { throw 42; }, "it threw something that is not a std::exception");
}
TEST(CommHooksErrors, AHookThrowingANonStdExceptionIsTheBucketsError) {
  RunOptions options;
  options.timeout = std::chrono::seconds(60);
  EXPECT_WORKERS_OK(run_workers("throwing_hook_not_std", 2, options));
}
TEST(CommHooksErrors, ThrowingHookReachesTheUserAndPeersFailInsteadOfHanging) {
  RunOptions options;
  options.timeout = std::chrono::seconds(60);
  EXPECT_WORKERS_OK(run_workers("throwing_hook", 2, options));
}

}  // namespace
