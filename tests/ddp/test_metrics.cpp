// Metrics: per-rank (sum, count) pairs become global sums and means on every rank.
#include <cmath>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/metrics.h>

#include "multiprocess.h"

namespace {

using ddp::test::require;

TEST(Metrics, AddAccumulatesAndUnknownNamesAreNamed) {
  ddp::Metrics metrics;
  metrics.add("loss", 6.0, 4);
  metrics.add("loss", 2.0, 4);
  EXPECT_EQ(metrics.sum("loss"), 8.0);
  EXPECT_EQ(metrics.count("loss"), 8.0);
  EXPECT_EQ(metrics.mean("loss"), 1.0);
  try {
    metrics.mean("accuracy");
    FAIL() << "mean of an unknown metric succeeded";
  } catch (const std::out_of_range& error) {
    EXPECT_STREQ(error.what(), "Metrics: no metric named 'accuracy' was added");
  }
}

// Rank r: loss sum 10 (r + 1) over 2 (r + 1) samples, r + 1 correct of 4, and a rank-0-only count.
DDP_WORKER(metrics_global) {
  auto pg = ddp::test::worker_init();
  const int rank = ddp::get_rank();
  const int world = ddp::get_world_size();
  ddp::Metrics metrics;
  metrics.add("loss", 10.0 * (rank + 1), 2.0 * (rank + 1));
  metrics.add("correct", rank + 1, 4);
  metrics.add("skipped", rank == 0 ? 5 : 0, 0);
  auto global = metrics.all_reduce();      // default group
  auto again = metrics.all_reduce(pg);     // explicit group, same answer
  const double ranks_sum = world * (world + 1) / 2.0;  // 1 + 2 + ... + W
  for (const auto* m : {&global, &again}) {
    require(m->sum("loss") == 10 * ranks_sum && m->count("loss") == 2 * ranks_sum,
            "loss sum/count: " + std::to_string(m->sum("loss")) + "/" + std::to_string(m->count("loss")));
    require(m->mean("loss") == 5.0, "global mean loss " + std::to_string(m->mean("loss")));
    require(std::abs(m->mean("correct") - ranks_sum / (4.0 * world)) < 1e-12,
            "global accuracy " + std::to_string(m->mean("correct")));
    require(m->sum("skipped") == 5 && m->mean("skipped") == 0, "zero-count metric");
  }
  // The local figures are untouched.
  require(metrics.sum("loss") == 10.0 * (rank + 1), "all_reduce changed the local metrics");
}

TEST(Metrics, EveryRankGetsTheGlobalFigures) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("metrics_global", 3));
}

DDP_WORKER(metrics_mismatch) {
  ddp::test::worker_init();
  ddp::Metrics metrics;
  metrics.add(ddp::get_rank() == 0 ? "loss" : "lost", 1.0);
  try {
    metrics.all_reduce();
  } catch (const std::runtime_error& error) {
    const std::string expected = "Metrics::all_reduce: the ranks hold different metric names (rank " +
                                 std::to_string(ddp::get_rank()) + " has [" +
                                 (ddp::get_rank() == 0 ? "loss" : "lost") +
                                 "]); add the same names on every rank before reducing";
    require(error.what() == expected, std::string("message: ") + error.what());
    return;
  }
  ddp::test::fail("different metric names were not detected");
}

TEST(Metrics, DifferentNamesOnTheRanksAreAnError) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("metrics_mismatch", 2));
}

}  // namespace
