// num_replicas and rank left unset come from the default process group (as in PyTorch, where
// DistributedSampler asks dist.get_world_size() / dist.get_rank()).
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/ddp.h>  // all of it, as a user includes it: ddp::make_data_loader must not capture LibTorch's call

#include "multiprocess.h"

namespace {

using ddp::test::require;

std::string join(const std::vector<size_t>& values) {
  std::ostringstream out;
  for (size_t v : values) out << v << ' ';
  return out.str();
}

// Each rank builds one sampler with the group's values spelled out and one with them unset; both
// must agree on world, rank, size and the indices of two epochs. 11 samples over 2 ranks pads.
DDP_WORKER(sampler_defaults_from_group) {
  auto pg = ddp::test::worker_init();
  const int64_t world = ddp::get_world_size();
  const int64_t rank = ddp::get_rank();
  require(world == 2, "expected a world of 2");
  ddp::DistributedSampler implicit(11, ddp::DistributedSamplerOptions().seed(3));
  ddp::DistributedSampler explicit_(11, ddp::DistributedSamplerOptions().num_replicas(world).rank(rank).seed(3));
  require(implicit.num_replicas() == 2, "num_replicas() = " + std::to_string(implicit.num_replicas()));
  require(implicit.rank() == rank, "rank() = " + std::to_string(implicit.rank()) + ", group rank " +
                                       std::to_string(rank));
  require(implicit.size() == 6, "size() = " + std::to_string(implicit.size()) + ", expected ceil(11 / 2) = 6");
  require(implicit.size() == explicit_.size(), "size differs from the explicit sampler's");
  for (int64_t epoch : {0, 1}) {
    implicit.set_epoch(epoch);
    explicit_.set_epoch(epoch);
    require(implicit.indices() == explicit_.indices(), "epoch " + std::to_string(epoch) + ": indices " +
                                                          join(implicit.indices()) + "differ from " +
                                                          join(explicit_.indices()));
  }
  // The two ranks' shards are different (rank really is the group's, not 0 everywhere).
  ddp::test::write_shared("indices_" + std::to_string(rank), join(implicit.indices()));
}

TEST(DistributedSampler, UnsetWorldAndRankComeFromTheDefaultGroup) {
  ddp::test::RunOptions options;
  options.shared_dir = ddp::test::make_temp_dir("sampler_defaults_");
  EXPECT_WORKERS_OK(ddp::test::run_workers("sampler_defaults_from_group", 2, options));
  // Read the shards back here: the shared dir outlives the workers.
  const auto read = [&](int rank) {
    std::ifstream in(options.shared_dir + "/indices_" + std::to_string(rank));
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  const std::string rank0 = read(0), rank1 = read(1);
  ddp::test::remove_tree(options.shared_dir);
  EXPECT_FALSE(rank0.empty());
  EXPECT_NE(rank0, rank1) << "both ranks got the same shard";
}

// A dataset whose example is its own index, to see which indices a loader fetched.
struct OwnIndexDataset : torch::data::datasets::Dataset<OwnIndexDataset, int64_t> {
  explicit OwnIndexDataset(size_t n) : n(n) {}
  int64_t get(size_t index) override { return static_cast<int64_t>(index); }
  c10::optional<size_t> size() const override { return n; }
  size_t n;
};

template <typename Loader>
std::vector<size_t> indices_fetched(Loader& loader) {
  std::vector<size_t> indices;
  for (auto& batch : loader) {
    for (int64_t index : batch) indices.push_back(static_cast<size_t>(index));
  }
  return indices;
}

// LibTorch's own forms with <ddp/ddp.h> included: make_data_loader<ddp::DistributedSampler>(dataset,
// batch size or options) makes the sampler from the dataset's size (world and rank from the
// default group), and make_data_loader(dataset, sampler, options) takes ours; both are LibTorch's
// loader (not ddp::DataLoader) and give this rank PyTorch's shard.
DDP_WORKER(libtorch_loader_forms) {
  auto pg = ddp::test::worker_init();
  const int64_t rank = ddp::get_rank();
  const auto expected = ddp::distributed_indices(11, 2, rank, true, 0, 0, false);
  auto by_size = torch::data::make_data_loader<ddp::DistributedSampler>(OwnIndexDataset(11), 4);
  static_assert(std::is_same_v<decltype(by_size),
                               std::unique_ptr<torch::data::StatelessDataLoader<OwnIndexDataset, ddp::DistributedSampler>>>,
                "LibTorch's call must build LibTorch's loader");
  require(indices_fetched(*by_size) == expected, "make_data_loader<ddp::DistributedSampler>(dataset, 4) fetched " +
                                             join(indices_fetched(*by_size)) + "expected " + join(expected));
  auto with_options = torch::data::make_data_loader<ddp::DistributedSampler>(
      OwnIndexDataset(11), torch::data::DataLoaderOptions().batch_size(3));
  require(indices_fetched(*with_options) == expected, "make_data_loader<ddp::DistributedSampler>(dataset, options) differs");
  ddp::DistributedSampler sampler(11, ddp::DistributedSamplerOptions().seed(5));
  auto with_sampler = torch::data::make_data_loader(OwnIndexDataset(11), sampler, torch::data::DataLoaderOptions(2));
  sampler.set_epoch(1);
  const auto epoch1 = ddp::distributed_indices(11, 2, rank, true, 5, 1, false);
  require(indices_fetched(*with_sampler) == epoch1, "make_data_loader(dataset, sampler, options) fetched " +
                                                join(indices_fetched(*with_sampler)) + "expected " + join(epoch1));
  // And ours, spelled ddp::, is still ours.
  auto ours = ddp::make_data_loader(OwnIndexDataset(11), ddp::DistributedSampler(11), 4);
  static_assert(std::is_same_v<decltype(ours), std::unique_ptr<ddp::DataLoader<OwnIndexDataset>>>);
  require(indices_fetched(*ours) == expected, "ddp::make_data_loader fetched " + join(indices_fetched(*ours)));
  // LibTorch's two-argument form, spelled ddp::: the sampler made from the dataset's size and the
  // default group, reached through the loader for set_epoch and its state.
  auto own = ddp::make_data_loader(OwnIndexDataset(11), torch::data::DataLoaderOptions(4).workers(1));
  require(indices_fetched(*own) == expected, "ddp::make_data_loader(dataset, options) fetched " + join(indices_fetched(*own)));
  own->sampler().set_epoch(3);
  const auto epoch3 = ddp::distributed_indices(11, 2, rank, true, 0, 3, false);
  require(indices_fetched(*own) == epoch3, "loader->sampler().set_epoch(3) did not reach the loader");
  require(own->sampler().state() == ddp::SamplerState{3, static_cast<int64_t>(epoch3.size())},
          "loader->sampler().state() is not what the loop received");
}

TEST(DistributedSampler, LibTorchsOwnLoaderFormsWorkWithTheWholeLibraryIncluded) {
  EXPECT_WORKERS_OK(ddp::test::run_workers("libtorch_loader_forms", 2));
}

}  // namespace
