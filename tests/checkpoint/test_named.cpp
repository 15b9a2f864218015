// Issue 27 item 2: LibTorch's module holders in checkpoints, and one checkpoint of several named
// models, optimizers and states (a GAN's), loaded by name. Item 4: load_checkpoint_if_exists.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/checkpoint.h>
#include <ddp/comm_hooks.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/powersgd.h>

#include "error_of.h"
#include "models.h"
#include "multiprocess.h"

namespace {

using ckpt_test::ToyModel;
using ddp::test::error_of;
using ddp::test::require;

// A generator-like Sequential: no TORCH_MODULE of ours, LibTorch's own holder.
torch::nn::Sequential make_generator() {
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 10));
}

// A user's Stateful, as a program's own counter.
struct Counter : ddp::Stateful {
  int64_t value = 0;
  ddp::TensorDict state_dict() const override { return {{"value", torch::tensor(value)}}; }
  void load_state_dict(const ddp::TensorDict& state) override { value = state.at("value").item<int64_t>(); }
};

// One step of a toy adversarial game: the discriminator (ToyModel: 10 -> 5) scores the
// generator's output; each optimizer steps its own model.
struct Gan {
  explicit Gan(uint64_t seed) {
    torch::manual_seed(seed);
    generator = make_generator();
    discriminator = ToyModel();
    optimizer_g = std::make_unique<torch::optim::Adam>(generator->parameters(), torch::optim::AdamOptions(1e-2));
    optimizer_d = std::make_unique<torch::optim::SGD>(discriminator->parameters(),
                                                      torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  void step(int64_t i) {
    const auto noise = torch::arange(12, torch::kFloat).view({3, 4}).mul(0.1 * (i + 1)).sin();
    optimizer_d->zero_grad();
    discriminator->forward(generator->forward(noise).detach()).pow(2).mean().backward();
    optimizer_d->step();
    optimizer_g->zero_grad();
    discriminator->forward(generator->forward(noise)).mean().neg().backward();
    optimizer_g->step();
  }
  std::vector<ddp::CheckpointEntry> entries() {
    return {{"generator", generator}, {"discriminator", discriminator}, {"optimizerG", *optimizer_g},
            {"optimizerD", *optimizer_d}, {"counter", counter}};
  }
  torch::nn::Sequential generator{nullptr};
  ToyModel discriminator{nullptr};
  std::unique_ptr<torch::optim::Adam> optimizer_g;
  std::unique_ptr<torch::optim::SGD> optimizer_d;
  Counter counter;
};

class Named : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = ddp::test::make_temp_dir("ckpt-named"); }
  void TearDown() override { ddp::test::remove_tree(dir_); }
  std::string dir_;
};

// Item 2, first half: a Sequential, a TORCH_MODULE holder and a shared_ptr go in as they are (the
// holder failed to compile: "has no member named 'module'"), the single-model file is unchanged.
TEST_F(Named, ModuleHoldersAndSharedPointersSaveAndLoad) {
  torch::manual_seed(1);
  torch::nn::Sequential sequential = make_generator();
  torch::optim::Adam adam(sequential->parameters());
  ddp::save_checkpoint(dir_ + "/sequential.pt", sequential, &adam, {});
  torch::manual_seed(2);
  torch::nn::Sequential loaded = make_generator();
  torch::optim::Adam loaded_adam(loaded->parameters());
  ddp::load_checkpoint(dir_ + "/sequential.pt", loaded, &loaded_adam);
  EXPECT_TRUE(ckpt_test::same_state(*loaded, *sequential));
  EXPECT_EQ(ddp::load_state_dict(dir_ + "/sequential.pt").keys(),
            (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));  // a plain state_dict

  torch::manual_seed(3);
  ToyModel holder;
  ddp::save_checkpoint(dir_ + "/holder.pt", holder, nullptr, {});
  auto shared = std::make_shared<ckpt_test::ToyModelImpl>();
  ddp::load_checkpoint(dir_ + "/holder.pt", shared, nullptr);
  EXPECT_TRUE(ckpt_test::same_state(*shared, *holder));
  ToyModel empty{nullptr};
  EXPECT_NE(error_of([&] { ddp::save_checkpoint(dir_ + "/empty.pt", empty, nullptr, {}); }), "");
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              ddp::load_checkpoint(dir_ + "/holder.pt", std::shared_ptr<ckpt_test::ToyModelImpl>(), nullptr);
            }),
            "a checkpoint model is an empty pointer: it holds no module");
}

// Reference: the same game played straight on. Saved after 3 steps, loaded into a game with other
// weights, 3 more steps give bitwise the straight run's weights (Adam's and momentum's state came
// back), and the training state and the user's Stateful come back.
TEST_F(Named, TwoModelsTwoOptimizersAndAStateInOneFileResumeExactly) {
  Gan straight(5);
  for (int64_t i = 0; i < 3; ++i) straight.step(i);
  straight.counter.value = 3;
  ddp::TrainingState state;
  state.epoch = 2;
  state.global_step = 3;
  state.sampler = ddp::SamplerState{2, 48};
  const std::string path = dir_ + "/gan.pt";
  ddp::save_checkpoint(path, straight.entries(), state);
  for (int64_t i = 3; i < 6; ++i) straight.step(i);

  Gan resumed(6);
  const auto restored = ddp::load_checkpoint(path, resumed.entries());
  EXPECT_EQ(restored.epoch, 2);
  EXPECT_EQ(restored.global_step, 3);
  EXPECT_EQ(restored.sampler, (ddp::SamplerState{2, 48}));
  EXPECT_EQ(resumed.counter.value, 3);
  for (int64_t i = 3; i < 6; ++i) resumed.step(i);
  EXPECT_TRUE(ckpt_test::same_state(*resumed.generator, *straight.generator));
  EXPECT_TRUE(ckpt_test::same_state(*resumed.discriminator, *straight.discriminator));
}

// Loaded by name: any subset, in any order (the generator alone, to sample from it).
TEST_F(Named, ASubsetLoadsByName) {
  Gan saved(7);
  saved.step(0);
  ddp::save_checkpoint(dir_ + "/gan.pt", saved.entries(), {});
  torch::manual_seed(8);
  auto generator = make_generator();
  ddp::load_checkpoint(dir_ + "/gan.pt", {{"generator", generator}});
  EXPECT_TRUE(ckpt_test::same_state(*generator, *saved.generator));
}

TEST_F(Named, ANameUsedTwiceIsRefusedBeforeAnythingIsWritten) {
  Gan gan(9);
  const std::string path = dir_ + "/twice.pt";
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              ddp::save_checkpoint(path, {{"model", gan.generator}, {"model", gan.discriminator}}, {});
            }),
            "save_checkpoint: the name \"model\" is used twice; every model, optimizer and state in one checkpoint "
            "needs its own name");
  EXPECT_FALSE(std::filesystem::exists(path));
  // Across kinds too, and against CheckpointOptions::state names.
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              ddp::save_checkpoint(path, {{"g", gan.generator}}, {},
                                   ddp::CheckpointOptions().state("g", &gan.counter));
            }),
            "save_checkpoint: the name \"g\" is used twice; every model, optimizer and state in one checkpoint "
            "needs its own name");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { ddp::save_checkpoint(path, {{"", gan.generator}}, {}); }),
            "save_checkpoint: an entry has an empty name; give every model, optimizer and state a name");
  ddp::save_checkpoint(path, gan.entries(), {});
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              ddp::load_checkpoint(path, {{"generator", gan.generator}, {"generator", *gan.optimizer_g}});
            }),
            "load_checkpoint: the name \"generator\" is used twice; every model, optimizer and state in one "
            "checkpoint needs its own name");
}

TEST_F(Named, AMissingNameIsNamedWithWhatTheFileHolds) {
  Gan gan(10);
  const std::string path = dir_ + "/gan.pt";
  ddp::save_checkpoint(path, gan.entries(), {});
  ToyModel critic;
  EXPECT_EQ(error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint(path, {{"critic", critic}}); }),
            "checkpoint " + path + " holds no model named \"critic\" (its models: generator, discriminator)");
  torch::optim::Adam adam(critic->parameters());
  EXPECT_EQ(error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint(path, {{"optimizerC", adam}}); }),
            "checkpoint " + path + " holds no optimizer named \"optimizerC\" (its optimizers: optimizerG, optimizerD)");
  Counter other;
  EXPECT_EQ(error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint(path, {{"steps", other}}); }),
            "checkpoint " + path + " holds no state named \"steps\" (it holds: counter); save it with "
            "CheckpointOptions().state(\"steps\", ...)");
  // An optimizer of another type under the right name.
  torch::optim::SGD sgd(gan.generator->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_EQ(error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint(path, {{"optimizerG", sgd}}); }),
            "checkpoint " + path + " holds torch::optim::Adam state under \"optimizerG\", the optimizer is "
            "torch::optim::SGD");
}

TEST_F(Named, AModelThatDoesNotMatchIsNamedWithEveryMismatch) {
  Gan gan(11);
  const std::string path = dir_ + "/gan.pt";
  ddp::save_checkpoint(path, gan.entries(), {});
  ckpt_test::OtherModel other;
  EXPECT_EQ(error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint(path, {{"discriminator", other}}); }),
            "checkpoint " + path + " (model \"discriminator\") does not match the model:\n"
            "  shape mismatch: net2.weight is [5, 10] in checkpoint " + path + " (model \"discriminator\"), [7, 10] "
            "in the model, net2.bias is [5] in checkpoint " + path + " (model \"discriminator\"), [7] in the model\n"
            "  missing in checkpoint " + path + " (model \"discriminator\"): extra");
}

// A file of one kind read by the call of the other says which call reads it.
TEST_F(Named, SingleAndNamedFilesPointToEachOthersCall) {
  Gan gan(12);
  const std::string named = dir_ + "/gan.pt", single = dir_ + "/single.pt";
  ddp::save_checkpoint(named, gan.entries(), {});
  ddp::save_checkpoint(single, gan.discriminator, gan.optimizer_d.get(), {});
  EXPECT_EQ(error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint(named, gan.discriminator, nullptr); }),
            named + " holds several named models (generator, discriminator), not one: load them with "
            "ddp::load_checkpoint(path, {{\"<name>\", model}, ...})");
  EXPECT_EQ(error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint(single, {{"discriminator", gan.discriminator}}); }),
            "checkpoint " + single + " holds one unnamed model (saved by save_checkpoint(path, model, &optimizer, "
            "state)): load it with ddp::load_checkpoint(path, model, &optimizer)");
  EXPECT_EQ(error_of<ddp::CheckpointError>([&] { ddp::load_state_dict(named); }),
            named + " holds several named models (generator, discriminator), not one state_dict: load them with "
            "ddp::load_checkpoint(path, {{\"<name>\", model}, ...})");
}

// Item 4: nothing to resume from is not an error; a damaged file still is.
TEST_F(Named, IfExistsStartsFreshWithoutAFileAndLoadsOne) {
  Gan gan(13);
  const auto none = ddp::load_checkpoint_if_exists(dir_ + "/gan.pt", gan.entries());
  EXPECT_FALSE(none.loaded);
  EXPECT_EQ(none.path, "");
  const auto empty_dir = ddp::load_checkpoint_if_exists(dir_, gan.discriminator, nullptr);
  EXPECT_FALSE(empty_dir.loaded);
  EXPECT_FALSE(ddp::load_checkpoint_if_exists(dir_ + "/no/such/dir", gan.discriminator, nullptr).loaded);

  ddp::TrainingState state;
  state.epoch = 3;
  ddp::save_checkpoint(dir_ + "/gan.pt", gan.entries(), state);
  Gan other(14);
  const auto found = ddp::load_checkpoint_if_exists(dir_ + "/gan.pt", other.entries());
  EXPECT_TRUE(found.loaded);
  EXPECT_EQ(found.path, dir_ + "/gan.pt");
  EXPECT_EQ(found.state.epoch, 3);
  EXPECT_TRUE(ckpt_test::same_state(*other.generator, *gan.generator));

  // A directory: its newest checkpoint.
  ddp::save_checkpoint(ddp::checkpoint_path(dir_, 7), gan.discriminator, nullptr, state);
  const auto newest = ddp::load_checkpoint_if_exists(dir_, other.discriminator, nullptr);
  EXPECT_TRUE(newest.loaded);
  EXPECT_EQ(newest.path, ddp::checkpoint_path(dir_, 7));

  std::ofstream(dir_ + "/torn.pt") << "PK\x03\x04 not all of it";  // 18 bytes
  EXPECT_EQ(error_of<ddp::CheckpointError>(
                [&] { ddp::load_checkpoint_if_exists(dir_ + "/torn.pt", gan.discriminator, nullptr); }),
            "checkpoint " + dir_ + "/torn.pt is truncated at byte 18: its end-of-checkpoint trailer is missing (an "
            "interrupted write or a cut copy)");
}

// --- several ranks ------------------------------------------------------------------------------

// The named save is the same collective as the single one: rank 0 writes (the other rank's path
// could not be written), DDP wrappers go in by name, every rank loads rank 0's weights.
DDP_WORKER(named_ddp_save_load) {
  auto pg = ddp::test::worker_init();
  const int rank = ddp::get_rank();
  torch::manual_seed(20 + rank);
  ddp::DistributedDataParallel generator(std::make_shared<torch::nn::SequentialImpl>(
                                             torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 10)),
                                         pg);
  ddp::DistributedDataParallel discriminator(std::make_shared<ckpt_test::ToyModelImpl>(), pg);
  torch::optim::Adam optimizer_g(generator.parameters());
  const std::string path = ddp::test::shared_dir() + "/gan.pt";
  ddp::save_checkpoint(rank == 0 ? path : "/nonexistent-dir/gan.pt",
                       {{"generator", generator}, {"discriminator", discriminator}, {"optimizerG", optimizer_g}}, {});
  require(std::filesystem::exists(path), "file not visible after save_checkpoint returned");
  torch::manual_seed(30 + rank);
  auto loaded = make_generator();
  ToyModel loaded_d;
  torch::optim::Adam loaded_optimizer(loaded->parameters());
  ddp::load_checkpoint(path, {{"discriminator", loaded_d}, {"optimizerG", loaded_optimizer}, {"generator", loaded}});
  require(ckpt_test::same_state(*loaded, *generator.module()), "generator differs from rank 0's");
  require(ckpt_test::same_state(*loaded_d, *discriminator.module()), "discriminator differs from rank 0's");
}

TEST(NamedRanks, Rank0SavesNamedModelsEveryRankLoadsThem) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("named_ddp_save_load", 2));
}

// A named DDP wrapper brings its comm hook's state along ("<name>/comm_hook"), each its own.
DDP_WORKER(named_wrappers_keep_their_hook_states) {
  auto pg = ddp::test::worker_init();
  auto make = [&](uint64_t seed) {
    torch::manual_seed(seed);
    auto model = std::make_unique<ddp::DistributedDataParallel<ckpt_test::ToyModelImpl>>(
        std::make_shared<ckpt_test::ToyModelImpl>(), pg);
    model->register_comm_hook(ddp::hooks::powersgd(
        ddp::hooks::PowerSGDOptions().matrix_approximation_rank(1).start_powerSGD_iter(2)));
    return model;
  };
  auto iteration = [](const auto& model) {
    return dynamic_cast<const ddp::hooks::PowerSGDState&>(*model->comm_hook_state()).iteration();
  };
  auto first = make(1), second = make(2);
  for (int step = 0; step < 3; ++step) first->forward(torch::ones({2, 10})).sum().backward();  // 3 iterations
  second->forward(torch::ones({2, 10})).sum().backward();                                        // 1 iteration
  const std::string path = ddp::test::shared_dir() + "/hooks.pt";
  ddp::save_checkpoint(path, {{"first", *first}, {"second", *second}}, {});
  auto first_again = make(3), second_again = make(4);
  ddp::load_checkpoint(path, {{"second", *second_again}, {"first", *first_again}});
  require(iteration(first_again) == 3 && iteration(second_again) == 1,
          "hook iterations after loading: " + std::to_string(iteration(first_again)) + " and " +
              std::to_string(iteration(second_again)) + ", saved 3 and 1");
}

TEST(NamedRanks, NamedWrappersKeepTheirCommHookStates) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("named_wrappers_keep_their_hook_states", 2));
}

// Rank 0 decides: here only rank 1's path holds a checkpoint, and neither rank loads.
DDP_WORKER(if_exists_rank0_decides) {
  auto pg = ddp::test::worker_init();
  const int rank = ddp::get_rank();
  const std::string dir = ddp::test::shared_dir() + "/rank" + std::to_string(rank);
  std::filesystem::create_directories(dir);
  ToyModel model;
  ddp::save_checkpoint(ddp::test::shared_dir() + "/ckpt.pt", model, nullptr, {});
  if (rank == 1) std::filesystem::copy_file(ddp::test::shared_dir() + "/ckpt.pt", dir + "/ckpt.pt");
  const auto restored = ddp::load_checkpoint_if_exists(dir + "/ckpt.pt", model, nullptr);
  require(!restored.loaded, "rank " + std::to_string(rank) + " loaded a checkpoint rank 0 does not have");
}

TEST(NamedRanks, IfExistsFollowsRank0sAnswerOnEveryRank) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("if_exists_rank0_decides", 2));
}

// One rank cannot load (another model): it throws its error, the other is told, none trains on.
DDP_WORKER(if_exists_failure_on_one_rank) {
  auto pg = ddp::test::worker_init();
  const int rank = ddp::get_rank();
  const std::string path = ddp::test::shared_dir() + "/ckpt.pt";
  ToyModel model;
  ddp::save_checkpoint(path, model, nullptr, {});
  ckpt_test::OtherModel other;
  const std::string message = rank == 1
      ? error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint_if_exists(path, other, nullptr); })
      : error_of<ddp::CheckpointError>([&] { ddp::load_checkpoint_if_exists(path, model, nullptr); });
  if (rank == 0) {
    require(message == "rank 1 failed to load checkpoint " + path + " (its error is in its output)",
            "rank 0 message: " + message);
  } else {
    require(ckpt_test::contains(message, "checkpoint " + path + " does not match the model:"),
            "rank 1 message: " + message);
  }
}

TEST(NamedRanks, IfExistsFailsOnEveryRankWhenOneCannotLoad) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("if_exists_failure_on_one_rank", 2));
}

}  // namespace
