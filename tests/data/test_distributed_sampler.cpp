// DistributedSampler: the exact order of PyTorch's sampler, resume mid-epoch, the data loader,
// and bad input.
#include <fstream>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/data_loader.h>
#include <ddp/distributed_sampler.h>
#include "error_of.h"

namespace {

using Indices = std::vector<size_t>;

ddp::DistributedSamplerOptions options(int64_t world, int64_t rank) {
  return ddp::DistributedSamplerOptions().num_replicas(world).rank(rank);
}

Indices drain(ddp::DistributedSampler& sampler, size_t batch_size) {
  Indices all;
  while (auto batch = sampler.next(batch_size)) all.insert(all.end(), batch->begin(), batch->end());
  return all;
}

// --- identical to PyTorch -------------------------------------------------------------------------
// tests/data/recorded/expected_sequences.txt holds what torch.utils.data.distributed.DistributedSampler
// (PyTorch 1.13, Debian's python3-torch) yields for each case; it was written by
// `/usr/bin/python3 tools/gen_sampler_expected.py`. Each line:
//   <dataset_size> <num_replicas> <rank> <shuffle> <seed> <epoch> <drop_last> : <indices...>
struct ExpectedCase {
  size_t dataset_size;
  int64_t world, rank, seed, epoch;
  bool shuffle, drop_last;
  Indices indices;
  std::string line;
};

std::vector<ExpectedCase> read_expected() {
  const std::string path = std::string(DDP_SAMPLER_TEST_DATA) + "/expected_sequences.txt";
  std::ifstream file(path);
  EXPECT_TRUE(file.good()) << "cannot open " << path;
  std::vector<ExpectedCase> cases;
  std::string line;
  while (std::getline(file, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    ExpectedCase c;
    int shuffle = 0, drop_last = 0;
    std::string colon;
    in >> c.dataset_size >> c.world >> c.rank >> shuffle >> c.seed >> c.epoch >> drop_last >> colon;
    EXPECT_EQ(colon, ":") << "malformed line: " << line;
    c.shuffle = shuffle != 0;
    c.drop_last = drop_last != 0;
    for (size_t index; in >> index;) c.indices.push_back(index);
    c.line = line.substr(0, line.find(':'));
    cases.push_back(std::move(c));
  }
  return cases;
}

TEST(DistributedSampler, MatchesPyTorchOrderInEveryCase) {
  const auto cases = read_expected();
  ASSERT_EQ(cases.size(), 1381u);  // every case the generator wrote
  size_t shuffled = 0, dropped = 0, padded = 0;
  for (const auto& c : cases) {
    ddp::DistributedSampler sampler(
        c.dataset_size, options(c.world, c.rank).shuffle(c.shuffle).seed(c.seed).drop_last(c.drop_last));
    sampler.set_epoch(c.epoch);
    ASSERT_EQ(sampler.size(), c.indices.size()) << "case " << c.line;
    ASSERT_EQ(drain(sampler, 7), c.indices) << "case " << c.line;
    shuffled += c.shuffle;
    dropped += c.drop_last && c.dataset_size % c.world != 0;
    padded += !c.drop_last && c.dataset_size % c.world != 0;
  }
  // The file really covers the interesting corners.
  EXPECT_GT(shuffled, 1000u);
  EXPECT_GT(dropped, 100u);
  EXPECT_GT(padded, 100u);
}

// --- semantics, independent of the reference file -------------------------------------------------
TEST(DistributedSampler, PadsByWrappingAroundAndDealsRoundRobin) {
  // 5 samples on 3 ranks: 0 1 2 3 4 | 0 → rank 0: 0 3, rank 1: 1 4, rank 2: 2 0.
  const std::vector<Indices> expected = {{0, 3}, {1, 4}, {2, 0}};
  for (int64_t rank = 0; rank < 3; ++rank) {
    ddp::DistributedSampler sampler(5, options(3, rank).shuffle(false));
    EXPECT_EQ(drain(sampler, 100), expected[rank]) << "rank " << rank;
  }
  // Padding longer than the dataset repeats it whole: 2 samples on 8 ranks → 0 1 0 1 0 1 0 1.
  ddp::DistributedSampler rank7(2, options(8, 7).shuffle(false));
  EXPECT_EQ(drain(rank7, 1), Indices{1});
}

TEST(DistributedSampler, DropLastTruncatesAndRanksPartitionTheDataset) {
  std::set<size_t> seen;
  for (int64_t rank = 0; rank < 4; ++rank) {
    ddp::DistributedSampler sampler(23, options(4, rank).seed(7).drop_last(true));
    EXPECT_EQ(sampler.size(), 5u);
    for (size_t index : drain(sampler, 3)) EXPECT_TRUE(seen.insert(index).second) << "duplicate " << index;
  }
  EXPECT_EQ(seen.size(), 20u);
}

TEST(DistributedSampler, SetEpochChangesTheShuffleAndRestarts) {
  ddp::DistributedSampler sampler(50, options(2, 1).seed(3));
  const Indices epoch0 = drain(sampler, 8);
  sampler.set_epoch(1);
  EXPECT_EQ(sampler.epoch(), 1);
  const Indices epoch1 = drain(sampler, 8);
  EXPECT_EQ(epoch0.size(), 25u);
  EXPECT_EQ(epoch1.size(), 25u);
  EXPECT_NE(epoch0, epoch1);
  sampler.set_epoch(0);
  EXPECT_EQ(drain(sampler, 8), epoch0);  // deterministic
  // A different seed gives a different order for the same epoch.
  ddp::DistributedSampler other_seed(50, options(2, 1).seed(4));
  EXPECT_NE(drain(other_seed, 8), epoch0);
}

// Any 64-bit seed, as PyTorch's generator takes it: seed + epoch modulo 2^64 (a negative seed is
// 2^64 plus it), with no signed overflow at the ends (the main job's --seed takes every int64).
TEST(DistributedSampler, SeedPlusEpochWrapsAroundAsPyTorchsGeneratorTakesIt) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max(), kMin = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(ddp::distributed_indices(40, 2, 1, true, kMax, 1, false),
            ddp::distributed_indices(40, 2, 1, true, kMin, 0, false));
  EXPECT_EQ(ddp::distributed_indices(40, 2, 1, true, -1, 1, false),
            ddp::distributed_indices(40, 2, 1, true, 0, 0, false));
}

TEST(DistributedSampler, ResetRestartsTheEpochAndNewSizeRecomputes) {
  ddp::DistributedSampler sampler(10, options(2, 0).shuffle(false));
  ASSERT_EQ(*sampler.next(3), (Indices{0, 2, 4}));
  sampler.reset();
  EXPECT_EQ(drain(sampler, 3), (Indices{0, 2, 4, 6, 8}));
  sampler.reset(4);
  EXPECT_EQ(sampler.dataset_size(), 4u);
  EXPECT_EQ(drain(sampler, 3), (Indices{0, 2}));
}

TEST(DistributedSampler, StateRestoreContinuesMidEpoch) {
  const auto make = [] { return ddp::DistributedSampler(101, options(3, 2).seed(11)); };
  auto uninterrupted = make();
  uninterrupted.set_epoch(4);
  const Indices whole = drain(uninterrupted, 5);

  auto first = make();
  first.set_epoch(4);
  Indices before;
  for (int step = 0; step < 3; ++step) {
    auto batch = first.next(5);
    before.insert(before.end(), batch->begin(), batch->end());
  }
  const ddp::SamplerState saved = first.state();
  EXPECT_EQ(saved, (ddp::SamplerState{4, 15}));

  auto resumed = make();  // a fresh process: epoch 0, position 0
  resumed.load_state(saved);
  resumed.reset();        // what a data loader's begin() does: must not lose the restored position
  Indices after = drain(resumed, 5);
  before.insert(before.end(), after.begin(), after.end());
  EXPECT_EQ(before, whole);
  // The restored position is used once; the next pass is the whole epoch again.
  resumed.reset();
  EXPECT_EQ(drain(resumed, 5), whole);
}

TEST(DistributedSampler, SaveLoadThroughArchive) {
  ddp::DistributedSampler sampler(40, options(2, 0).seed(5));
  sampler.set_epoch(2);
  sampler.next(6);
  torch::serialize::OutputArchive out;
  sampler.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);

  ddp::DistributedSampler restored(40, options(2, 0).seed(5));
  torch::serialize::InputArchive in;
  std::istringstream input(bytes.str());
  in.load_from(input);
  restored.load(in);
  EXPECT_EQ(restored.state(), (ddp::SamplerState{2, 6}));
  EXPECT_EQ(*restored.next(2), Indices(sampler.indices().begin() + 6, sampler.indices().begin() + 8));

  ddp::DistributedSampler wrong_size(41, options(2, 0).seed(5));
  torch::serialize::InputArchive again;
  std::istringstream input2(bytes.str());
  again.load_from(input2);
  try {
    wrong_size.load(again);
    FAIL() << "loading a 40-sample archive into a 41-sample sampler succeeded";
  } catch (const std::invalid_argument& error) {
    EXPECT_STREQ(error.what(),
                 "DistributedSampler::load: the archive is for a dataset of 40 samples, this sampler has 41");
  }
}

// A dataset whose example is its own index, to see which indices the loader fetched.
struct IndexDataset : torch::data::datasets::Dataset<IndexDataset, int64_t> {
  explicit IndexDataset(size_t n) : n(n) {}
  int64_t get(size_t index) override { return static_cast<int64_t>(index); }
  c10::optional<size_t> size() const override { return n; }
  size_t n;
};

TEST(DistributedSampler, WorksWithMakeDataLoaderAndSetEpochReachesIt) {
  ddp::DistributedSampler sampler(30, options(2, 1).seed(9));
  auto loader = torch::data::make_data_loader(IndexDataset(30), sampler,
                                              torch::data::DataLoaderOptions().batch_size(4));
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    sampler.set_epoch(epoch);  // our handle; the loader holds a copy sharing the position
    Indices fetched;
    size_t batches = 0;
    for (auto& batch : *loader) {
      ++batches;
      for (int64_t index : batch) fetched.push_back(static_cast<size_t>(index));
    }
    EXPECT_EQ(batches, 4u);  // 15 samples in batches of 4
    EXPECT_EQ(fetched, ddp::distributed_indices(30, 2, 1, true, 9, epoch, false)) << "epoch " << epoch;
  }
  // Resume through the loader: its begin() keeps a restored position.
  sampler.load_state({1, 8});
  Indices rest;
  for (auto& batch : *loader) for (int64_t index : batch) rest.push_back(static_cast<size_t>(index));
  const Indices epoch1 = ddp::distributed_indices(30, 2, 1, true, 9, 1, false);
  EXPECT_EQ(rest, Indices(epoch1.begin() + 8, epoch1.end()));
}

// --- resume with loader workers: state() is what the program received ------------------------------
// One rank of two over 100 samples in batches of 4 (25 batches an epoch), through
// ddp::make_data_loader with `workers`. A straight run of 2 epochs is the reference; an interrupted
// run stops after the 5th batch of epoch 1 and saves state(); a fresh sampler and loader resume
// from it. Together they must yield the straight run's batches, each once, in the same order.
using Batches = std::vector<Indices>;
constexpr size_t kSamples = 100, kBatch = 4;

ddp::DistributedSampler rank_sampler(int64_t rank) { return ddp::DistributedSampler(kSamples, options(2, rank).seed(21)); }

std::unique_ptr<ddp::DataLoader<IndexDataset>> loader_for(ddp::DistributedSampler& sampler, size_t workers) {
  return ddp::make_data_loader(IndexDataset(kSamples), sampler,
                               torch::data::DataLoaderOptions().batch_size(kBatch).workers(workers));
}

Indices as_indices(const std::vector<int64_t>& batch) { return Indices(batch.begin(), batch.end()); }

Batches straight_run(int64_t rank, size_t workers) {
  auto sampler = rank_sampler(rank);
  auto loader = loader_for(sampler, workers);
  Batches batches;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    sampler.set_epoch(epoch);
    for (auto& batch : *loader) batches.push_back(as_indices(batch));
  }
  return batches;
}

// Epoch 0 whole, then 5 batches of epoch 1; checks state() after every batch against the samples
// the loop has seen.
Batches interrupted_run(int64_t rank, size_t workers, ddp::SamplerState* saved) {
  auto sampler = rank_sampler(rank);
  auto loader = loader_for(sampler, workers);
  Batches batches;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    sampler.set_epoch(epoch);
    int64_t seen = 0, samples = 0;
    for (auto& batch : *loader) {
      batches.push_back(as_indices(batch));
      ++seen;
      samples += static_cast<int64_t>(batch.size());
      EXPECT_EQ(sampler.state(), (ddp::SamplerState{epoch, samples}))
          << "workers " << workers << ", rank " << rank << ", after batch " << seen << " of epoch " << epoch;
      if (epoch == 1 && seen == 5) break;
    }
  }
  *saved = sampler.state();
  return batches;
}

TEST(DistributedSampler, StateIsWhatTheProgramReceivedWithLoaderWorkers) {
  for (size_t workers : {0u, 1u, 2u}) {
    std::vector<int> seen_in_epoch1(kSamples, 0);
    for (int64_t rank = 0; rank < 2; ++rank) {
      const Batches straight = straight_run(rank, workers);
      ASSERT_EQ(straight.size(), 26u);  // 50 samples a rank an epoch: 12 batches of 4 and one of 2
      ddp::SamplerState saved;
      Batches resumed = interrupted_run(rank, workers, &saved);
      EXPECT_EQ(saved, (ddp::SamplerState{1, 20})) << "workers " << workers << ": 5 batches of 4 reached the loop";

      auto sampler = rank_sampler(rank);  // a new process
      auto loader = loader_for(sampler, workers);
      sampler.load_state(saved);
      for (auto& batch : *loader) resumed.push_back(as_indices(batch));  // the rest of epoch 1
      EXPECT_EQ(resumed, straight) << "workers " << workers << ", rank " << rank;
      for (size_t b = 13; b < resumed.size(); ++b) for (size_t index : resumed[b]) ++seen_in_epoch1.at(index);
    }
    for (size_t i = 0; i < kSamples; ++i) EXPECT_EQ(seen_in_epoch1[i], 1) << "sample " << i << ", workers " << workers;
  }
}

// The program's usual loop resumes as it is: set_epoch() of the loaded epoch keeps the loaded
// position (PyTorch's set_epoch only selects the shuffle; the restart is the loader's). The next
// set_epoch() restarts, and another epoch right after a mid-epoch load is refused.
TEST(DistributedSampler, SetEpochOfTheLoadedEpochKeepsTheLoadedPosition) {
  const Batches straight = straight_run(1, 2);
  ddp::SamplerState saved;
  Batches resumed = interrupted_run(1, 2, &saved);

  auto sampler = rank_sampler(1);
  auto loader = loader_for(sampler, 2);
  sampler.load_state(saved);  // the whole resume block, with start = saved.epoch
  for (int64_t epoch = saved.epoch; epoch < 2; ++epoch) {
    sampler.set_epoch(epoch);
    for (auto& batch : *loader) resumed.push_back(as_indices(batch));
  }
  EXPECT_EQ(resumed, straight);
  // Once used, the loaded position is gone: set_epoch(1) is a whole epoch 1 again.
  sampler.set_epoch(1);
  Batches again;
  for (auto& batch : *loader) again.push_back(as_indices(batch));
  EXPECT_EQ(again, Batches(straight.begin() + 13, straight.end()));

  sampler.load_state(saved);
  EXPECT_EQ(ddp::test::error_of<std::logic_error>([&] { sampler.set_epoch(0); }),
            "DistributedSampler::set_epoch(0): the sampler was just loaded at epoch 1 with 20 of its 50 samples "
            "consumed; starting another epoch would drop that position and repeat or skip samples. Start the "
            "epoch loop at the loaded state's epoch");
  // A state at an epoch's start or end holds no position to lose: any epoch may follow.
  sampler.load_state({1, 0});
  sampler.set_epoch(0);
  EXPECT_EQ(sampler.state(), (ddp::SamplerState{0, 0}));
  sampler.load_state({0, 50});
  sampler.set_epoch(1);
  EXPECT_EQ(sampler.state(), (ddp::SamplerState{1, 0}));
}

// LibTorch's own loader with workers(2) asks the sampler for max_jobs (4) batches ahead of the
// program: after 5 batches of 4 its count said 36 samples, and a resume from it skipped 16. state()
// and save() refuse instead, naming ddp::make_data_loader; without workers LibTorch's loader asks
// only as the program wants a batch, and the count is right. The loader made last decides.
TEST(DistributedSampler, StateRefusesUnderLibTorchsLoaderWithWorkers) {
  auto sampler = rank_sampler(0);
  auto five_batches = [&sampler](size_t workers) {
    auto loader = torch::data::make_data_loader(IndexDataset(kSamples), sampler,
                                                torch::data::DataLoaderOptions().batch_size(kBatch).workers(workers));
    int seen = 0;
    for (auto& batch : *loader) {
      if (++seen == 5) break;
    }
  };
  five_batches(2);
  const std::string why =
      ": this sampler feeds LibTorch's torch::data::make_data_loader with workers, which asks it for batches ahead "
      "of the program (max_jobs, 2 x workers by default), so its count would include samples the program has not "
      "received and a resume from it would skip them. Make the loader with ddp::make_data_loader "
      "(<ddp/data_loader.h>): LibTorch's loader with the same options, whose sampler counts what reached the loop";
  EXPECT_EQ(ddp::test::error_of<std::logic_error>([&] { sampler.state(); }), "DistributedSampler::state()" + why);
  torch::serialize::OutputArchive archive;
  EXPECT_EQ(ddp::test::error_of<std::logic_error>([&] { sampler.save(archive); }), "DistributedSampler::save()" + why);

  sampler.set_epoch(0);
  five_batches(0);
  EXPECT_EQ(sampler.state(), (ddp::SamplerState{0, 20}));
  sampler.set_epoch(0);
  auto loader = loader_for(sampler, 2);  // ddp::make_data_loader: right with workers
  int seen = 0;
  for (auto& batch : *loader) {
    if (++seen == 5) break;
  }
  EXPECT_EQ(sampler.state(), (ddp::SamplerState{0, 20}));
}

TEST(DistributedSampler, MakeDataLoaderRefusesUnorderedWorkers) {
  auto sampler = rank_sampler(0);
  EXPECT_EQ(ddp::test::error_of<std::invalid_argument>([&] {
              ddp::make_data_loader(IndexDataset(kSamples), sampler,
                                    torch::data::DataLoaderOptions().batch_size(4).workers(2).enforce_ordering(false));
            }),
            "ddp::make_data_loader: enforce_ordering(false) with workers hands batches out in the order the workers "
            "finish them, so the sampler's state() could not name the samples the program received; keep "
            "enforce_ordering(true) (the default)");
}

// pad(false), for exact sharded evaluation: disjoint shards that together hold every sample exactly
// once, in PyTorch's order without its padding, sizes differing by at most one. Checked against the
// padded shards (PyTorch's, recorded above): each unpadded shard is a prefix of the padded one.
TEST(DistributedSampler, UnpaddedShardsCoverEverySampleExactlyOnce) {
  for (size_t n : {0u, 1u, 5u, 10u, 10000u, 10001u}) {
    for (int64_t world : {1, 2, 3, 7}) {
      for (bool shuffle : {false, true}) {
        std::vector<int> seen(n, 0);
        size_t smallest = n, largest = 0;
        for (int64_t rank = 0; rank < world; ++rank) {
          ddp::DistributedSampler sampler(n, options(world, rank).shuffle(shuffle).seed(3).pad(false));
          const Indices padded = ddp::distributed_indices(n, world, rank, shuffle, 3, 0, false);
          const Indices& mine = sampler.indices();
          ASSERT_LE(mine.size(), padded.size());
          EXPECT_TRUE(std::equal(mine.begin(), mine.end(), padded.begin())) << "n " << n << " world " << world;
          for (size_t index : mine) ++seen[index];
          smallest = std::min(smallest, mine.size());
          largest = std::max(largest, mine.size());
        }
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], 1) << "sample " << i << " of " << n << ", world " << world;
        EXPECT_LE(largest - std::min(smallest, largest), 1u);
      }
    }
  }
}

// --- bad input ---------------------------------------------------------------------------------------
TEST(DistributedSampler, BadInputNamesTheValueAndTheFix) {
  EXPECT_EQ(ddp::test::error_of<std::invalid_argument>([] { ddp::DistributedSampler(10, options(0, 0)); }),
            "DistributedSampler: num_replicas must be at least 1, got 0");
  EXPECT_EQ(ddp::test::error_of<std::invalid_argument>([] { ddp::DistributedSampler(10, options(2, 2)); }),
            "DistributedSampler: rank 2 is outside [0, 2); pass a rank in [0, num_replicas)");
  EXPECT_EQ(ddp::test::error_of<std::invalid_argument>([] { ddp::DistributedSampler(10, options(2, -1)); }),
            "DistributedSampler: rank -1 is outside [0, 2); pass a rank in [0, num_replicas)");
  EXPECT_EQ(ddp::test::error_of<std::invalid_argument>([] { ddp::DistributedSampler(0, options(2, 0).drop_last(true)); }),
            "DistributedSampler: drop_last with dataset_size 0 and num_replicas 2 leaves every rank 0 "
            "samples; use a dataset of at least num_replicas samples or drop_last(false)");
  EXPECT_EQ(ddp::test::error_of<std::invalid_argument>([] { ddp::DistributedSampler(3, options(4, 0).drop_last(true)); }),
            "DistributedSampler: drop_last with dataset_size 3 and num_replicas 4 leaves every rank 0 "
            "samples; use a dataset of at least num_replicas samples or drop_last(false)");
  EXPECT_EQ(ddp::test::error_of<std::invalid_argument>([] { ddp::DistributedSampler(10, ddp::DistributedSamplerOptions().rank(0)); }),
            "DistributedSampler: num_replicas is unset and no default process group exists; call "
            "ddp::init_process_group first or pass DistributedSamplerOptions().num_replicas(W)");
  EXPECT_EQ(ddp::test::error_of<std::invalid_argument>([] { ddp::DistributedSampler(10, ddp::DistributedSamplerOptions().num_replicas(2)); }),
            "DistributedSampler: rank is unset and no default process group exists; call "
            "ddp::init_process_group first or pass DistributedSamplerOptions().rank(r)");
  EXPECT_EQ(ddp::test::error_of<std::invalid_argument>([] {
              ddp::DistributedSampler sampler(10, options(2, 0));
              sampler.load_state({0, 6});
            }),
            "DistributedSampler::load_state: consumed 6 is outside [0, 5] (the samples per epoch of this "
            "rank); was the state saved with a different dataset size or world size?");
  // An empty dataset without drop_last is fine, as in PyTorch: nothing to yield.
  ddp::DistributedSampler empty(0, options(2, 1));
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_FALSE(empty.next(4).has_value());
}

}  // namespace
