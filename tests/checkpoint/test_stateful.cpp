// Stateful objects in checkpoints (CheckpointOptions::state / LoadOptions::state): every rank's
// own snapshot comes back to that rank, bitwise; a larger world's new ranks take rank 0's; a
// missing name is an error naming what the file holds.
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using ddp::test::require;

// A state that differs per rank, with an integer counter and a float tensor.
class RankState : public ddp::Stateful {
 public:
  at::Tensor counter = torch::zeros({}, at::kLong);
  at::Tensor values = torch::zeros({3, 4});

  ddp::TensorDict state_dict() const override { return {{"counter", counter}, {"values", values}}; }
  void load_state_dict(const ddp::TensorDict& state) override {
    counter = state.at("counter").clone();
    values = state.at("values").clone();
  }
};

RankState expected_for(int rank) {
  RankState state;
  state.counter.fill_(100 + rank);
  torch::manual_seed(rank);
  state.values = torch::randn({3, 4}) / 3.0;  // not exactly representable in decimal: tests bitwise
  return state;
}

std::string path_in_shared_dir() { return ddp::test::shared_dir() + "/with-state.pt"; }

DDP_WORKER(save_rank_states) {
  auto pg = ddp::test::worker_init();
  ckpt_test::ToyModel model;
  const RankState state = expected_for(ddp::get_rank());
  ddp::save_checkpoint(path_in_shared_dir(), *model, nullptr, {}, ddp::CheckpointOptions().state("per.rank", &state));
}

DDP_WORKER(load_rank_states) {
  auto pg = ddp::test::worker_init();
  ckpt_test::ToyModel model;
  RankState loaded;
  ddp::load_checkpoint(path_in_shared_dir(), *model, nullptr, ddp::LoadOptions().state("per.rank", &loaded));
  // Ranks the saving world (2) had get their own snapshot; a new rank gets rank 0's.
  const int from = ddp::get_rank() < 2 ? ddp::get_rank() : 0;
  const RankState expected = expected_for(from);
  require(loaded.counter.item<int64_t>() == 100 + from,
          "counter " + std::to_string(loaded.counter.item<int64_t>()) + ", expected " + std::to_string(100 + from));
  require(torch::equal(loaded.values, expected.values), "values differ from rank " + std::to_string(from) + "'s");
}

TEST(CheckpointState, EachRankGetsItsOwnSnapshotBack) {
  const std::string dir = ddp::test::make_temp_dir("ckpt-state");
  ddp::test::RunOptions options;
  options.shared_dir = dir;
  EXPECT_WORKERS_OK(ddp::test::run_workers("save_rank_states", 2, options));
  EXPECT_WORKERS_OK(ddp::test::run_workers("load_rank_states", 2, options));
  EXPECT_WORKERS_OK(ddp::test::run_workers("load_rank_states", 3, options));
  ddp::test::remove_tree(dir);
}

TEST(CheckpointState, AMissingNameIsAnErrorNamingWhatTheFileHolds) {
  const std::string dir = ddp::test::make_temp_dir("ckpt-state-missing");
  const std::string path = dir + "/c.pt";
  ckpt_test::ToyModel model;
  const RankState saved = expected_for(0);
  ddp::save_checkpoint(path, *model, nullptr, {}, ddp::CheckpointOptions().state("scaler", &saved));
  RankState other;
  try {
    ddp::load_checkpoint(path, *model, nullptr, ddp::LoadOptions().state("comm_hook", &other));
    ADD_FAILURE() << "loading a state the file lacks did not throw";
  } catch (const ddp::CheckpointError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("no state named \"comm_hook\""), std::string::npos) << message;
    EXPECT_NE(message.find("it holds: scaler"), std::string::npos) << message;
  }
  // A checkpoint saved with no states at all says so too.
  ddp::save_checkpoint(path, *model, nullptr, {});
  EXPECT_THROW(ddp::load_checkpoint(path, *model, nullptr, ddp::LoadOptions().state("scaler", &other)),
               ddp::CheckpointError);
  ddp::test::remove_tree(dir);
}

}  // namespace
