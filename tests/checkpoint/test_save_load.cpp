// Rank 0 saves, every rank loads: contents, map_location, the DDP wrapper, failures, keep_last.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/atomic_file.h>
#include <ddp/checkpoint.h>
#include <ddp/distributed_data_parallel.h>

#include "models.h"
#include "multiprocess.h"

namespace {

using ckpt_test::ToyModel;
using ddp::test::require;

ddp::TrainingState sample_state() {
  ddp::TrainingState state;
  state.epoch = 4;
  state.global_step = 1234;
  state.sampler = ddp::SamplerState{4, 96};
  state.metadata = {{"run", "toy"}, {"lr", "0.01"}};
  return state;
}

DDP_WORKER(rank0_saves_all_load) {
  auto pg = ddp::test::worker_init();
  const int rank = ddp::get_rank();
  torch::manual_seed(100 + rank);  // every rank starts different; the checkpoint must make them equal
  ToyModel saved;
  torch::optim::SGD optimizer(saved->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const std::string path = ddp::test::shared_dir() + "/ckpt.pt";
  // Only rank 0 writes: any other rank trying to would fail on this path.
  const std::string my_path = rank == 0 ? path : "/nonexistent-dir/ckpt.pt";
  ddp::save_checkpoint(my_path, *saved, &optimizer, sample_state());
  require(std::filesystem::exists(path), "file not visible after save_checkpoint returned");
  require(!std::filesystem::exists(ddp::temporary_path_for(path)), "temporary file left behind");

  torch::manual_seed(999);
  ToyModel loaded;
  torch::optim::SGD loaded_optimizer(loaded->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto state = ddp::load_checkpoint(
      path, *loaded, &loaded_optimizer,
      ddp::LoadOptions().map_location(ddp::MapLocation::remap({{"cpu", "cpu"}})));
  // Rank 0's parameters, as the reference every rank must now hold.
  for (const auto& item : saved->named_parameters()) {
    at::Tensor reference = item.value().detach().clone();
    ddp::broadcast(reference, 0);
    require(torch::equal(*loaded->named_parameters().find(item.key()), reference),
            "parameter " + item.key() + " differs from rank 0's");
  }
  require(state.epoch == 4 && state.global_step == 1234, "epoch/step not restored");
  require(state.sampler == ddp::SamplerState{4, 96}, "sampler state not restored");
  require(state.metadata == sample_state().metadata, "metadata not restored");
  require(state.world_size == 2, "world size: " + std::to_string(state.world_size));
}

TEST(SaveLoad, Rank0SavesEveryRankLoadsWithMapLocation) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("rank0_saves_all_load", 2));
}

// The DDP wrapper saves and loads its bare module: no "module." prefix, interchangeable files.
DDP_WORKER(ddp_wrapper_round_trip) {
  auto pg = ddp::test::worker_init();
  torch::manual_seed(7);
  ddp::DistributedDataParallel model(std::make_shared<ckpt_test::ToyModelImpl>(), pg);
  const std::string path = ddp::test::shared_dir() + "/wrapped.pt";
  ddp::save_checkpoint(path, model, nullptr, {});
  const auto names = ddp::load_state_dict(path).keys();
  require(names == std::vector<std::string>{"net1.weight", "net1.bias", "net2.weight", "net2.bias"},
          "unexpected names in a checkpoint of the wrapper");
  torch::manual_seed(8);
  ToyModel bare;
  ddp::load_checkpoint(path, *bare, nullptr);
  require(ckpt_test::same_state(*bare, *model.module()), "bare module differs from the wrapped one");
  torch::manual_seed(9);
  ddp::DistributedDataParallel other(std::make_shared<ckpt_test::ToyModelImpl>(), pg);
  ddp::load_checkpoint(path, other, nullptr);
  require(ckpt_test::same_state(*other.module(), *model.module()), "wrapper did not load");
}

TEST(SaveLoad, DdpWrapperAndBareModuleShareCheckpoints) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("ddp_wrapper_round_trip", 2));
}

// Rank 0 cannot write (the directory would be inside a regular file): every rank fails, none hangs.
DDP_WORKER(rank0_write_fails) {
  auto pg = ddp::test::worker_init();
  ToyModel model;
  const std::string file = ddp::test::shared_dir() + "/a-file";
  if (ddp::get_rank() == 0) std::ofstream(file) << "not a directory";
  const std::string path = file + "/ckpt.pt";
  try {
    ddp::save_checkpoint(path, *model, nullptr, {});
  } catch (const ddp::CheckpointError& error) {
    const std::string message = error.what();
    if (ddp::get_rank() == 0) {
      require(ckpt_test::contains(message, "cannot save checkpoint " + path + ": "), "rank 0 message: " + message);
      require(ckpt_test::contains(message, "Not a directory"), "rank 0 message: " + message);
    } else {
      require(message == "rank 0 failed to save checkpoint " + path + " (its error is in rank 0's output)",
              "rank 1 message: " + message);
    }
    return;
  }
  ddp::test::fail("save_checkpoint inside a regular file succeeded");
}

// A missing directory is made, nested ones too.
DDP_WORKER(save_makes_its_directory) {
  auto pg = ddp::test::worker_init();
  ToyModel model;
  const std::string path = ddp::test::shared_dir() + "/runs/today/ckpt.pt";
  ddp::save_checkpoint(path, *model, nullptr, {});
  require(std::filesystem::is_regular_file(path), "no checkpoint at " + path);
}
TEST(SaveLoad, SaveMakesAMissingDirectory) { EXPECT_WORKERS_OK(ddp::test::run_workers("save_makes_its_directory", 2)); }

TEST(SaveLoad, Rank0FailureIsReportedOnEveryRank) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("rank0_write_fails", 2));
}

// --- single process (no process group) --------------------------------------------------------
class CheckpointDir : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = ddp::test::make_temp_dir("ckpt"); }
  void TearDown() override { ddp::test::remove_tree(dir_); }
  std::string dir_;
};

TEST_F(CheckpointDir, KeepLastAndLatestSkipsCorruptedFiles) {
  ToyModel model;
  for (int64_t step = 1; step <= 5; ++step) {
    ddp::TrainingState state;
    state.global_step = step;
    ddp::save_checkpoint(ddp::checkpoint_path(dir_, step), *model, nullptr, state,
                         ddp::CheckpointOptions().keep_last(3));
  }
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) files.push_back(entry.path().filename());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{".torchddp-checkpoint.lock", "checkpoint-00000003.pt",
                                             "checkpoint-00000004.pt", "checkpoint-00000005.pt"}));
  EXPECT_EQ(ddp::latest_checkpoint(dir_), ddp::checkpoint_path(dir_, 5));
  // A torn newest file (as a crash of a non-atomic writer would leave) is skipped.
  std::filesystem::resize_file(ddp::checkpoint_path(dir_, 5), 100);
  EXPECT_EQ(ddp::latest_checkpoint(dir_), ddp::checkpoint_path(dir_, 4));
  // Temporary files and other names are never candidates.
  std::ofstream(ddp::checkpoint_path(dir_, 9) + ".tmp.123") << "partial";
  std::ofstream(dir_ + "/checkpoint-x.pt") << "junk";
  EXPECT_EQ(ddp::latest_checkpoint(dir_), ddp::checkpoint_path(dir_, 4));
  EXPECT_EQ(ddp::latest_checkpoint(dir_, "other"), std::nullopt);
  EXPECT_EQ(ddp::latest_checkpoint(dir_ + "/missing"), std::nullopt);
}

TEST_F(CheckpointDir, CheckpointPathNamesAndRejectsNegativeSteps) {
  EXPECT_EQ(ddp::checkpoint_path("/tmp/run", 42), "/tmp/run/checkpoint-00000042.pt");
  EXPECT_EQ(ddp::checkpoint_path("/tmp/run", 123456789012, "ema"), "/tmp/run/ema-123456789012.pt");
  try {
    ddp::checkpoint_path("/tmp/run", -1);
    FAIL() << "accepted a negative step";
  } catch (const std::invalid_argument& error) {
    EXPECT_STREQ(error.what(), "checkpoint_path: global_step must be >= 0, got -1");
  }
}

TEST_F(CheckpointDir, OverwritingKeepsTheNewestContents) {
  const std::string path = dir_ + "/same.pt";
  ToyModel model;
  ddp::TrainingState state;
  state.global_step = 1;
  ddp::save_checkpoint(path, *model, nullptr, state);
  { torch::NoGradGuard no_grad; model->net1->weight.fill_(3.0); }
  state.global_step = 2;
  ddp::save_checkpoint(path, *model, nullptr, state);
  ToyModel loaded;
  EXPECT_EQ(ddp::load_checkpoint(path, *loaded, nullptr).global_step, 2);
  EXPECT_TRUE(torch::equal(loaded->net1->weight, torch::full({10, 10}, 3.0)));
}

// A state_dict saved by Python's DDP carries "module." on every name; a bare module takes it.
TEST_F(CheckpointDir, ModulePrefixedStateDictLoadsIntoBareModule) {
  ToyModel source;
  ddp::StateDict prefixed;
  for (const auto& item : ddp::state_dict(*source)) prefixed.insert("module." + item.key(), item.value());
  ToyModel target;
  ddp::load_state_dict(*target, prefixed);
  EXPECT_TRUE(ckpt_test::same_state(*source, *target));
}

TEST_F(CheckpointDir, NonStrictIgnoresMissingAndUnexpectedNames) {
  ToyModel source;
  ddp::StateDict partial;
  partial.insert("net1.weight", ddp::state_dict(*source)["net1.weight"]);
  partial.insert("unused.weight", torch::ones({2}));
  ToyModel target;
  const at::Tensor bias_before = target->net1->bias.clone();
  ddp::load_state_dict(*target, partial, /*strict=*/false);
  EXPECT_TRUE(torch::equal(target->net1->weight, source->net1->weight));
  EXPECT_TRUE(torch::equal(target->net1->bias, bias_before));
}

TEST_F(CheckpointDir, StateDictFileRoundTripsWithMapLocation) {
  ToyModel model;
  const std::string path = dir_ + "/model.pt";
  ddp::save_state_dict(path, *model);
  std::vector<std::string> seen;
  const auto state = ddp::load_state_dict(path, ddp::MapLocation::function([&](const std::string& saved) {
    seen.push_back(saved);
    return std::string("cpu");
  }));
  EXPECT_EQ(seen, std::vector<std::string>(4, "cpu"));  // the device each tensor was saved from
  ToyModel loaded;
  ddp::load_state_dict(*loaded, state);
  EXPECT_TRUE(ckpt_test::same_state(*model, *loaded));
}

}  // namespace
