#pragma once
// DistributedSampler: gives each rank its own shard of a dataset, in the same order as PyTorch's
// torch.utils.data.distributed.DistributedSampler (same seed, epoch, world size and rank give the
// same indices), so a C++ run can be compared with, or resumed from, a Python one.
//
//   ddp::DistributedSampler sampler(dataset.size().value(),
//       ddp::DistributedSamplerOptions().num_replicas(W).rank(r).shuffle(true).seed(0));
//   auto loader = ddp::make_data_loader(dataset, sampler, batch_size);   // <ddp/data_loader.h>
//   int64_t start = 0;
//   if (resuming) { sampler.load_state(saved); start = saved.epoch; }  // saved: a SamplerState
//   for (int64_t epoch = start; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);            // a new shuffle every epoch, as in Python
//     for (auto& batch : *loader) { ... }  // state() counts the batches that reached this loop
//   }
//
// A DistributedSampler is a handle: copies share one position. A data loader keeps its own copy
// of the sampler, and this sharing is what lets set_epoch() on your handle reach it (Python gets
// the same effect because its DataLoader holds a reference to the sampler).
//
// LibTorch's own torch::data::make_data_loader over a DistributedSampler is LibTorch's loader, which
// first tells the sampler how it asks for batches (the end of this file): with workers it asks
// ahead of the program, and state() then refuses rather than count samples the program never got.
//
// Thread-safety: a sampler belongs to one thread, the one that iterates the data loader (with
// loader workers too: LibTorch's loader asks the sampler for indices from that thread).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/data/dataloader/stateless.h>
#include <torch/data/dataloader_options.h>
#include <torch/data/samplers/base.h>

#include <ddp/sampler_state.h>

namespace ddp {

template <typename Dataset>
class DataLoader;  // data_loader.h

struct DistributedSamplerOptions {
  // Number of ranks sharing the dataset; unset: the default process group's world size.
  TORCH_ARG(c10::optional<int64_t>, num_replicas) = c10::nullopt;
  // This process's rank in [0, num_replicas); unset: its rank in the default process group.
  TORCH_ARG(c10::optional<int64_t>, rank) = c10::nullopt;
  // Permute with a CPU generator seeded seed + epoch (identical on every rank).
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(int64_t, seed) = 0;
  // Drop the tail that does not divide evenly instead of padding it with repeated indices.
  TORCH_ARG(bool, drop_last) = false;
  // false: neither pad nor drop. Rank r takes positions r, r + W, ... of the order below the
  // dataset size, so the ranks' shards are disjoint, cover every sample exactly once, and differ
  // in size by at most one. Meant for sharded evaluation, where a count over all ranks must be
  // exact (PyTorch's padding counts some samples twice); training under DDP wants the same number
  // of batches on every rank (the default, or ddp::Join). Ignored with drop_last.
  TORCH_ARG(bool, pad) = true;
};

class DistributedSampler : public torch::data::samplers::Sampler<> {
 public:
  // Throws std::invalid_argument on a bad world size or rank, or when drop_last leaves a rank
  // with nothing to do.
  explicit DistributedSampler(size_t dataset_size, DistributedSamplerOptions options = {});

  // Selects the shuffle of `epoch` and restarts at its beginning, as PyTorch's set_epoch does for
  // the next pass. One exception makes a resume block short: right after load_state() (before
  // any batch was drawn), set_epoch() of the loaded epoch keeps the loaded position, so a program
  // resumes with its usual loop. set_epoch() of another epoch then, while the loaded position is
  // mid-epoch, throws std::logic_error: it would silently repeat or skip samples (start the epoch
  // loop at the loaded state's epoch).
  void set_epoch(int64_t epoch);
  int64_t epoch() const;
  // Samples this rank yields per epoch (the same on every rank, unless pad(false)).
  size_t size() const;
  size_t dataset_size() const;
  int64_t num_replicas() const { return num_replicas_; }
  int64_t rank() const { return rank_; }
  const DistributedSamplerOptions& options() const { return options_; }
  // This rank's indices for the current epoch, in order.
  const std::vector<size_t>& indices() const;

  // Restarts the current epoch (the data loader calls this at the start of every pass). A new size
  // means a new dataset: the epoch's indices are recomputed. Right after load_state() the restored
  // position is kept, so that a data loader's first pass resumes instead of starting over.
  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  // Up to batch_size of this rank's next indices; nullopt once the epoch is exhausted.
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;

  // Where this rank stands, for checkpoints: the epoch and how many of its indices the program
  // has received. Under ddp::make_data_loader (data_loader.h) that counts the batches the loop
  // has been handed, the one it holds included, whatever the loader's workers fetched ahead; so
  // save after the step on a batch. Under torch::data::make_data_loader with workers(0) it counts
  // what the loader asked for, which is what the program received. With workers(k) LibTorch's
  // loader asks for max_jobs (2k by default) batches ahead, and a resume from that count would
  // skip them: state() (and save()) then throw std::logic_error naming ddp::make_data_loader. The
  // loader made last over this sampler decides.
  SamplerState state() const;
  // Continues exactly where a sampler with this state stopped (same dataset size and options):
  // the next pass (a data loader's begin(), or next()) starts at the loaded position, and
  // set_epoch(state.epoch) keeps it (see set_epoch()).
  void load_state(const SamplerState& state);

  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct Position;  // shared between copies, see above
  // ddp::make_data_loader's loader tells the sampler which batches reached the program.
  template <typename Dataset>
  friend class DataLoader;
  // LibTorch's loader tells it whether its workers ask ahead (below).
  template <typename Dataset, typename Sampler>
  friend class torch::data::StatelessDataLoader;
  // From now on state() counts received batches (mark_received), not yielded ones.
  void count_received();
  // LibTorch's own loader with `workers` now asks this sampler for batches: state() counts the
  // yielded ones (workers 0: asked as the program wants each) or refuses (workers ask ahead).
  void count_for_libtorch_loader(size_t workers);
  // The count state() and save() report, or std::logic_error from `who` when there is none.
  size_t consumed(const char* who) const;
  // The oldest batch handed out by next() and not yet received has reached the program.
  void mark_received();
  // This rank's indices in `epoch`.
  std::vector<size_t> indices_of(int64_t epoch) const;
  DistributedSamplerOptions options_;
  int64_t num_replicas_ = 1;
  int64_t rank_ = 0;
  std::shared_ptr<Position> position_;
};

// The indices rank `rank` of `num_replicas` gets in `epoch`, exactly as PyTorch computes them
// (with pad false: the same order, without the padding).
std::vector<size_t> distributed_indices(size_t dataset_size, int64_t num_replicas, int64_t rank,
                                        bool shuffle, int64_t seed, int64_t epoch, bool drop_last,
                                        bool pad = true);

namespace detail {
// The sampler as a loader holds it: the same position, a type of its own, so that a loader over it
// is LibTorch's unchanged (ddp::make_data_loader's, and the one below).
class LoaderSampler : public DistributedSampler {
 public:
  explicit LoaderSampler(DistributedSampler sampler) : DistributedSampler(std::move(sampler)) {}
};
}  // namespace detail

}  // namespace ddp

namespace torch::data {

// What torch::data::make_data_loader(dataset, ddp::DistributedSampler, options) builds: LibTorch's
// own loader (the same options, workers, batches and order), which tells the sampler first
// whether its workers ask ahead of the program, so that state() is right or refuses.
template <typename Dataset>
class StatelessDataLoader<Dataset, ddp::DistributedSampler>
    : public StatelessDataLoader<Dataset, ddp::detail::LoaderSampler> {
 public:
  StatelessDataLoader(Dataset dataset, ddp::DistributedSampler sampler, DataLoaderOptions options)
      : StatelessDataLoader<Dataset, ddp::detail::LoaderSampler>(std::move(dataset), told(std::move(sampler), options),
                                                                 options) {}

 private:
  static ddp::detail::LoaderSampler told(ddp::DistributedSampler sampler, const DataLoaderOptions& options) {
    sampler.count_for_libtorch_loader(options.workers());
    return ddp::detail::LoaderSampler(std::move(sampler));
  }
};

}  // namespace torch::data
