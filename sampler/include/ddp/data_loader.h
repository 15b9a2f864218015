#pragma once
// LibTorch's data loader over a DistributedSampler, counting the batches it hands to the program,
// so that the sampler's state() is what the program received, with loader workers too.
//
//   ddp::DistributedSampler sampler(dataset.size().value());
//   auto loader = ddp::make_data_loader(dataset.map(torch::data::transforms::Stack<>()), sampler,
//                                       torch::data::DataLoaderOptions().batch_size(64).workers(2));
//   for (auto& batch : *loader) { ...; save(sampler.state()); }   // resumes at the next batch
//
// Or LibTorch's own form, the sampler made by the loader (PyTorch's defaults: the whole dataset,
// shuffled, the default group's rank and world size) and reached through it:
//
//   auto loader = ddp::make_data_loader(std::move(dataset), torch::data::DataLoaderOptions(64).workers(2));
//   loader->sampler().set_epoch(epoch);   // and {"sampler", loader->sampler()} in a checkpoint
//
// Why: LibTorch's loader with workers(k) asks the sampler for max_jobs (2k by default) batches
// ahead of the program, so the sampler alone counts batches still in the workers' hands; a resume
// from that count would skip them. This loader is LibTorch's own (the same options, workers,
// batches and order); only its iterator differs: it tells the sampler each time a batch reaches
// the loop. With workers(0) the count is the same either way; with workers, LibTorch's own
// torch::data::make_data_loader makes state() refuse (distributed_sampler.h).
//
// Thread-safety: iterate a loader from one thread (the sampler's); LibTorch's workers only read
// the dataset.
#include <cstddef>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <utility>

#include <torch/data/dataloader.h>

#include <ddp/distributed_sampler.h>

namespace ddp {

template <typename Dataset>
class DataLoader {
 public:
  using Inner = torch::data::StatelessDataLoader<Dataset, detail::LoaderSampler>;
  using BatchType = typename Inner::BatchType;

  // An input iterator, as LibTorch's. A batch counts as received when the iterator fetches it
  // (the first comparison or dereference after begin() or ++), before the loop body sees it.
  class Iterator {
   public:
    using difference_type = std::ptrdiff_t;
    using value_type = BatchType;
    using pointer = BatchType*;
    using reference = BatchType&;
    using iterator_category = std::input_iterator_tag;

    Iterator(torch::data::Iterator<BatchType> inner, torch::data::Iterator<BatchType> end, DistributedSampler sampler)
        : inner_(std::move(inner)), end_(std::move(end)), sampler_(std::move(sampler)) {}

    BatchType& operator*() {
      receive();
      return *inner_;
    }
    BatchType* operator->() { return &**this; }
    Iterator& operator++() {
      receive();  // a batch skipped with ++ alone still left the sampler
      ++inner_;
      received_ = false;
      return *this;
    }
    bool operator==(const Iterator& other) const {
      receive();
      other.receive();
      return inner_ == other.inner_;
    }
    bool operator!=(const Iterator& other) const { return !(*this == other); }

   private:
    // Fetches the batch this iterator stands on (LibTorch's iterator does so lazily) and, if
    // there is one, tells the sampler once.
    void receive() const {
      if (received_) return;
      received_ = true;
      if (inner_ != end_) sampler_.mark_received();
    }

    torch::data::Iterator<BatchType> inner_;
    torch::data::Iterator<BatchType> end_;
    mutable DistributedSampler sampler_;  // a handle on the loader's sampler (distributed_sampler.h)
    mutable bool received_ = false;
  };

  // Throws std::invalid_argument for workers with enforce_ordering(false): batches would reach the
  // program in completion order, and no position could say which samples it received.
  DataLoader(Dataset dataset, DistributedSampler sampler, torch::data::DataLoaderOptions options)
      : sampler_(sampler) {
    if (options.workers() > 0 && !options.enforce_ordering()) {
      throw std::invalid_argument(
          "ddp::make_data_loader: enforce_ordering(false) with workers hands batches out in the order the workers "
          "finish them, so the sampler's state() could not name the samples the program received; keep "
          "enforce_ordering(true) (the default)");
    }
    sampler_.count_received();
    inner_ = std::make_unique<Inner>(std::move(dataset), detail::LoaderSampler(std::move(sampler)), std::move(options));
  }

  // A new pass: the sampler restarts its epoch (or continues a loaded position), as with LibTorch.
  Iterator begin() { return Iterator(inner_->begin(), inner_->end(), sampler_); }
  Iterator end() { return Iterator(inner_->end(), inner_->end(), sampler_); }
  // As LibTorch's: stops the workers (the destructor does too).
  void join() { inner_->join(); }
  const torch::data::FullDataLoaderOptions& options() const noexcept { return inner_->options(); }
  // The loader's sampler (a handle on the one it draws from): set_epoch, state(), a checkpoint entry.
  DistributedSampler& sampler() noexcept { return sampler_; }

 private:
  DistributedSampler sampler_;
  std::unique_ptr<Inner> inner_;
};

namespace detail {
// ddp::make_data_loader is an object rather than a function so that argument-dependent lookup
// never finds it: LibTorch's make_data_loader<Sampler>(dataset, options) calls make_data_loader
// unqualified with the sampler it made, and a function of this namespace taking a
// DistributedSampler would be chosen over LibTorch's and return the wrong type.
struct MakeDataLoader {
  template <typename Dataset>
  std::unique_ptr<DataLoader<Dataset>> operator()(Dataset dataset, DistributedSampler sampler,
                                                  torch::data::DataLoaderOptions options) const {
    return std::make_unique<DataLoader<Dataset>>(std::move(dataset), std::move(sampler), std::move(options));
  }
  // The sampler made here over the whole dataset, with DistributedSamplerOptions' defaults.
  template <typename Dataset>
  std::unique_ptr<DataLoader<Dataset>> operator()(Dataset dataset, torch::data::DataLoaderOptions options) const {
    const auto size = dataset.size();
    if (!size) {
      throw std::invalid_argument(
          "ddp::make_data_loader: the dataset does not know its size, so no DistributedSampler can be made for it; "
          "make one yourself and pass it: ddp::make_data_loader(dataset, sampler, options)");
    }
    DistributedSampler sampler(*size);
    return (*this)(std::move(dataset), std::move(sampler), std::move(options));
  }
};
}  // namespace detail

// torch::data::make_data_loader(dataset, sampler, options) with a DistributedSampler, whose state()
// then counts the batches the program received (see above); or (dataset, options), the sampler made
// here and reached as loader->sampler(). `options` may be a batch size.
inline constexpr detail::MakeDataLoader make_data_loader{};

}  // namespace ddp
