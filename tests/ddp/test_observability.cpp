// Seeing a run: TORCH_DISTRIBUTED_DEBUG (DETAIL's desync check, INFO's log), logging_data(), and
// the TORCHDDP_TIMELINE Chrome trace, parsed here.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <ddp/comm_hooks.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/join.h>
#include <ddp/logging.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using namespace ddp::test;

ddp::DDPOptions small_buckets() { return ddp::DDPOptions().first_bucket_cap_mb(0).bucket_cap_mb(0.001); }

// DETAIL: rank 1 turns its model into float64 after construction (so the construction check
// passed). Its first bucket no longer matches rank 0's: every rank fails within seconds, naming
// the collective and each rank's size and dtype (without the check Gloo would pair 4-byte and
// 8-byte buffers).
DDP_WORKER(desync_detail) {
  worker_init(std::chrono::seconds(60));
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  MLP net;
  ddp::DistributedDataParallel model(net, small_buckets());
  if (rank == 1) model.to(torch::kDouble);
  auto [x, y] = batch(0);
  const auto dtype = rank == 1 ? torch::kDouble : torch::kFloat;
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    torch::mse_loss(model.forward(shard(x, rank, world).to(dtype)), shard(y, rank, world).to(dtype)).backward();
  } catch (const std::exception& error) {
    message = error.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  require(!message.empty(), "rank " + std::to_string(rank) + ": backward succeeded despite the desync");
  require(message.find("TORCH_DISTRIBUTED_DEBUG=DETAIL") != std::string::npos, message);
  require(message.find("rank 0 runs DDP gradient bucket reduction #0 of 5 Float elements in iteration 0") !=
              std::string::npos, message);
  require(message.find("rank 1 runs DDP gradient bucket reduction #0 of 5 Double elements in iteration 0") !=
              std::string::npos, message);
  require(seconds < 10, "the desync took " + std::to_string(seconds) + " s to report (group timeout 60 s)");
}
TEST(Desync, DetailNamesEachRanksCollectiveWithinSeconds) {
  RunOptions options;
  options.env = {{"TORCH_DISTRIBUTED_DEBUG", "DETAIL"}};
  EXPECT_WORKERS_OK(run_workers("desync_detail", 2, options));
}

// DETAIL changes nothing when the ranks agree: same gradients as OFF, with and without a hook.
DDP_WORKER(detail_agrees) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  for (bool hooked : {false, true}) {
    torch::manual_seed(4);
    MLP net, reference;
    copy_parameters(*net, *reference);
    ddp::DistributedDataParallel model(net, small_buckets().find_unused_parameters(true));
    if (hooked) model.register_comm_hook(ddp::hooks::allreduce());
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = batch(step);
      model.zero_grad();
      reference->zero_grad();
      torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
      torch::mse_loss(reference->forward(x), y).backward();
      for (size_t i = 0; i < net->parameters().size(); ++i) {
        require(torch::allclose(net->parameters()[i].grad(), reference->parameters()[i].grad(), 1e-5, 1e-6),
                "DETAIL changed gradient " + std::to_string(i));
      }
    }
  }
}
TEST(Desync, DetailPassesWhenRanksAgree) {
  RunOptions options;
  options.env = {{"TORCH_DISTRIBUTED_DEBUG", "DETAIL"}};
  EXPECT_WORKERS_OK(run_workers("detail_agrees", 2, options));
}

DDP_WORKER(debug_level_typo) {
  try {
    worker_init();  // the group reads the level when it is made
  } catch (const std::invalid_argument& error) {
    const std::string message = error.what();
    require(message.find("TORCH_DISTRIBUTED_DEBUG='DETIAL'") != std::string::npos, message);
    require(message.find("OFF, INFO or DETAIL") != std::string::npos, message);
    return;
  }
  fail("TORCH_DISTRIBUTED_DEBUG=DETIAL was accepted");
}
TEST(Desync, UnknownDebugLevelIsNamed) {
  RunOptions options;
  options.env = {{"TORCH_DISTRIBUTED_DEBUG", "DETIAL"}};
  EXPECT_WORKERS_OK(run_workers("debug_level_typo", 2, options));
}

// INFO: rank 0 logs the model's buckets at construction and the names of parameters no rank used.
DDP_WORKER(info_log) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  Branchy net;
  ddp::DistributedDataParallel model(net, ddp::DDPOptions().find_unused_parameters(true));
  auto [x, y] = batch(0);
  torch::mse_loss(model.forward(shard(x, rank, world), false), shard(y, rank, world)).backward();
  torch::mse_loss(model.forward(shard(x, rank, world), false), shard(y, rank, world)).backward();
}
TEST(Observability, InfoLogsBucketsAndUnusedParameterNames) {
  RunOptions options;
  options.env = {{"TORCH_DISTRIBUTED_DEBUG", "INFO"}};
  const auto results = run_workers("info_log", 2, options);
  EXPECT_WORKERS_OK(results);
  const std::string& rank0 = results[0].output;
  EXPECT_NE(rank0.find("[torchddp INFO] DDP on 2 rank(s) (gloo+shm): 6 parameters"), std::string::npos) << rank0;
  EXPECT_NE(rank0.find("2 parameter(s) got no gradient on any rank: branch.weight, branch.bias"), std::string::npos)
      << rank0;
  EXPECT_EQ(results[1].output.find("[torchddp INFO]"), std::string::npos) << "only rank 0 logs";
}

// logging_data(): options, buckets before and after the rebuild, unused parameter bytes, the hook,
// Join, and sampled timings.
DDP_WORKER(logging_data) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  Branchy net;
  ddp::DistributedDataParallel model(net, small_buckets().find_unused_parameters(true));
  model.register_comm_hook(ddp::hooks::fp16_compress());
  auto before = model.logging_data();
  require(before.world_size == 2 && before.rank == rank && before.backend_name == ddp::transport(), "group fields");
  require(before.num_parameter_tensors == 6 && before.total_parameter_size_bytes == (80 + 8 + 64 + 8 + 40 + 5) * 4,
          "parameter fields: " + std::to_string(before.total_parameter_size_bytes));
  int64_t bucket_total = 0;
  for (auto bytes : before.bucket_sizes) bucket_total += bytes;
  require(bucket_total == before.total_parameter_size_bytes, "buckets hold every parameter once");
  require(before.comm_hook == "fp16_compress" && before.find_unused_parameters && !before.static_graph, "options");
  require(before.sampled_iterations == 0 && before.avg_backward_comm_time == 0, "no timings before training");
  torch::optim::SGD opt(model.parameters(), 0.01);
  ddp::Join join({model});
  join.run([&] {
    for (int step = 0; step < 12; ++step) {
      auto [x, y] = batch(step);
      opt.zero_grad();
      torch::mse_loss(model.forward(shard(x, rank, world), false), shard(y, rank, world)).backward();
      opt.step();
    }
  });
  auto after = model.logging_data();
  require(after.iteration == 12, "iteration " + std::to_string(after.iteration));
  require(after.has_rebuilt_buckets && !after.rebuilt_bucket_sizes.empty(), "the rebuild is reported");
  require(after.unused_parameter_size == (64 + 8) * 4, "unused bytes: " + std::to_string(after.unused_parameter_size));
  require(after.join_uneven_inputs, "ran under Join");
  require(after.sampled_iterations == 10, "the first 10 iterations are sampled, got " +
                                              std::to_string(after.sampled_iterations));
  require(after.avg_forward_compute_time > 0 && after.avg_backward_compute_time > 0 &&
              after.avg_backward_comm_time > 0,
          "timings are positive");
  require(after.avg_backward_compute_comm_overlap_time <= after.avg_backward_compute_time,
          "overlap cannot exceed backward compute");
}
TEST(Observability, LoggingDataReportsOptionsBucketsAndTimings) { EXPECT_WORKERS_OK(run_workers("logging_data", 2)); }

// TORCHDDP_TIMELINE: a valid Chrome trace per rank; in every iteration, one reduction span per
// bucket, inside that iteration's backward span, and at least one starting before the last
// bucket filled up (communication overlapped backward); the program's own span is there too.
DDP_WORKER(timeline) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  MLP net;
  ddp::DistributedDataParallel model(net, small_buckets());
  torch::optim::SGD opt(model.parameters(), 0.01);
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    torch::mse_loss(model.forward(shard(x, rank, world)), shard(y, rank, world)).backward();
    ddp::TimelineSpan span("optimizer.step");
    opt.step();
  }
  write_shared("buckets_" + std::to_string(rank), std::to_string(model.reduction_stats().buckets.size()));
}
TEST(Observability, TimelineIsAChromeTraceWithOneReductionPerBucketInsideBackward) {
  RunOptions options;
  options.shared_dir = make_temp_dir("ddp_timeline");
  options.env = {{"TORCHDDP_TIMELINE", options.shared_dir + "/trace.json"}};
  const auto results = run_workers("timeline", 2, options);
  EXPECT_WORKERS_OK(results);
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream file(options.shared_dir + "/trace.rank" + std::to_string(rank) + ".json");
    ASSERT_TRUE(file) << "no trace file for rank " << rank;
    const auto trace = nlohmann::json::parse(file);  // throws on invalid JSON
    ASSERT_TRUE(trace.contains("traceEvents") && trace["traceEvents"].is_array());
    int buckets = 0;
    std::ifstream(options.shared_dir + "/buckets_" + std::to_string(rank)) >> buckets;
    ASSERT_GT(buckets, 2);
    std::map<int, nlohmann::json> backward;             // iteration -> span
    std::map<int, std::vector<nlohmann::json>> reduce;  // iteration -> spans
    std::map<int, double> last_fill_end;
    int program_spans = 0;
    for (const auto& event : trace["traceEvents"]) {
      ASSERT_TRUE(event.contains("ph") && event.contains("pid") && event.contains("tid")) << event;
      if (event["ph"] != "X") continue;
      ASSERT_TRUE(event.contains("ts") && event.contains("dur") && event["ts"].is_number()) << event;
      EXPECT_EQ(event["pid"], rank);
      const std::string name = event["name"];
      if (name == "optimizer.step") {
        ++program_spans;
        continue;
      }
      const int iteration = event["args"]["iteration"];
      if (name == "backward") backward[iteration] = event;
      if (name.rfind("reduce bucket ", 0) == 0) reduce[iteration].push_back(event);
      if (name.rfind("bucket ", 0) == 0) {
        last_fill_end[iteration] = std::max(last_fill_end[iteration], event["ts"].get<double>() + event["dur"].get<double>());
      }
    }
    EXPECT_EQ(program_spans, 3);
    ASSERT_EQ(backward.size(), 3u) << "one backward span per step";
    for (const auto& [iteration, span] : backward) {
      const double begin = span["ts"], end = begin + span["dur"].get<double>();
      ASSERT_EQ(reduce[iteration].size(), static_cast<size_t>(buckets)) << "iteration " << iteration;
      double first_launch = end;
      for (const auto& r : reduce[iteration]) {
        const double ts = r["ts"], finish = ts + r["dur"].get<double>();
        EXPECT_GE(ts, begin) << "a reduction started before its backward";
        EXPECT_LE(finish, end + 1) << "a reduction ended after its backward";
        first_launch = std::min(first_launch, ts);
      }
      EXPECT_LT(first_launch, last_fill_end[iteration]) << "no reduction overlapped the filling of later buckets";
    }
  }
  remove_tree(options.shared_dir);
}

// TORCHDDP_TIMELINE naming a directory (existing, or written with a trailing '/'): each rank's
// trace goes inside it as timeline.rank<r>.json, as a user naming a folder expects (PyTorch's
// profiler handler does the same), not next to it (traces.rank0.json) nor hidden in it (.rank0.json).
TEST(Observability, TimelineNamingADirectoryWritesInsideIt) {
  for (const std::string slash : {"", "/"}) {
    RunOptions options;
    options.shared_dir = make_temp_dir("ddp_timeline_dir");
    const std::string dir = options.shared_dir + "/traces";
    ASSERT_TRUE(std::filesystem::create_directory(dir));
    options.env = {{"TORCHDDP_TIMELINE", dir + slash}};
    EXPECT_WORKERS_OK(run_workers("timeline", 2, options));
    for (int rank = 0; rank < 2; ++rank) {
      const std::string inside = dir + "/timeline.rank" + std::to_string(rank) + ".json";
      std::ifstream file(inside);
      ASSERT_TRUE(file) << "no " << inside << " (TORCHDDP_TIMELINE=" << dir + slash << ")";
      EXPECT_TRUE(nlohmann::json::parse(file).contains("traceEvents"));
      EXPECT_FALSE(std::filesystem::exists(dir + ".rank" + std::to_string(rank) + ".json")) << "a sibling file";
      EXPECT_FALSE(std::filesystem::exists(dir + "/.rank" + std::to_string(rank) + ".json")) << "a hidden file";
    }
    remove_tree(options.shared_dir);
  }
}

}  // namespace
