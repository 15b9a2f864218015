#include <ddp/distributed_sampler.h>

#include <algorithm>
#include <deque>
#include <stdexcept>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/serialize/archive.h>
#include <torch/torch.h>

#include <ddp/process_group.h>

namespace ddp {
namespace {

// Samples per rank: PyTorch pads up to a multiple of the world size, or with drop_last cuts down
// to one (its ceil((n - W) / W) is floor(n / W) for every n, including n < W).
size_t samples_per_rank(size_t dataset_size, size_t num_replicas, bool drop_last) {
  return drop_last ? dataset_size / num_replicas : (dataset_size + num_replicas - 1) / num_replicas;
}

void check_size(size_t dataset_size, int64_t num_replicas, bool drop_last) {
  if (drop_last && samples_per_rank(dataset_size, num_replicas, drop_last) == 0) {
    throw std::invalid_argument(
        "DistributedSampler: drop_last with dataset_size " + std::to_string(dataset_size) +
        " and num_replicas " + std::to_string(num_replicas) +
        " leaves every rank 0 samples; use a dataset of at least num_replicas samples or drop_last(false)");
  }
}

int64_t resolve_num_replicas(const DistributedSamplerOptions& options) {
  if (options.num_replicas()) return *options.num_replicas();
  if (!ddp::is_initialized()) {
    throw std::invalid_argument(
        "DistributedSampler: num_replicas is unset and no default process group exists; call "
        "ddp::init_process_group first or pass DistributedSamplerOptions().num_replicas(W)");
  }
  return ddp::get_world_size();
}

int64_t resolve_rank(const DistributedSamplerOptions& options) {
  if (options.rank()) return *options.rank();
  if (!ddp::is_initialized()) {
    throw std::invalid_argument(
        "DistributedSampler: rank is unset and no default process group exists; call "
        "ddp::init_process_group first or pass DistributedSamplerOptions().rank(r)");
  }
  return ddp::get_rank();
}

}  // namespace

std::vector<size_t> distributed_indices(size_t dataset_size, int64_t num_replicas, int64_t rank,
                                        bool shuffle, int64_t seed, int64_t epoch, bool drop_last, bool pad) {
  const size_t world = static_cast<size_t>(num_replicas);
  const size_t total = !drop_last && !pad ? dataset_size : samples_per_rank(dataset_size, world, drop_last) * world;

  std::vector<size_t> order(dataset_size);
  if (shuffle) {
    // The same generator and the same randperm as Python's torch.randperm(n, generator=g). The sum
    // is taken modulo 2^64, as the generator takes a negative seed: no signed overflow at the ends.
    auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(seed) + static_cast<uint64_t>(epoch));
    auto permutation = torch::randperm(static_cast<int64_t>(dataset_size), generator, torch::kLong);
    const int64_t* values = permutation.data_ptr<int64_t>();
    for (size_t i = 0; i < dataset_size; ++i) order[i] = static_cast<size_t>(values[i]);
  } else {
    for (size_t i = 0; i < dataset_size; ++i) order[i] = i;
  }

  // Rank r takes positions r, r + W, ... of the order padded (by wrapping around from the start,
  // as many times as needed) or truncated to `total`.
  std::vector<size_t> mine;
  mine.reserve(total / world);
  for (size_t i = static_cast<size_t>(rank); i < total; i += world) mine.push_back(order[i % dataset_size]);
  return mine;
}

// Which count state() reports. kYielded: the indices next() handed out, which is what the program
// received when the loader asks for a batch only as the program wants one (LibTorch's loader
// without workers). kReceived: what ddp::make_data_loader's loader says reached the program; its
// workers may have fetched more. kNone: LibTorch's loader with workers asks ahead of the program,
// and nothing says which of its batches reached it.
enum class Counting { kYielded, kReceived, kNone };

struct DistributedSampler::Position {
  size_t dataset_size = 0;
  int64_t epoch = 0;
  std::vector<size_t> indices;   // this rank's indices for `epoch`
  size_t yielded = 0;            // indices handed out by next() in this pass
  size_t received = 0;           // of those, the ones that reached the program (kReceived)
  std::deque<size_t> in_flight;  // where each batch handed out and not yet received ends
  Counting counting = Counting::kYielded;
  bool restored = false;  // load_state() was called and next() not yet: reset() and set_epoch() keep the position

  size_t consumed() const { return counting == Counting::kReceived ? received : yielded; }  // not for kNone
  void restart_at(size_t at) {
    yielded = received = at;
    in_flight.clear();
  }
  void start(int64_t new_epoch, std::vector<size_t> new_indices) {
    epoch = new_epoch;
    indices = std::move(new_indices);
    restart_at(0);
    restored = false;
  }
};

DistributedSampler::DistributedSampler(size_t dataset_size, DistributedSamplerOptions options)
    : options_(std::move(options)), position_(std::make_shared<Position>()) {
  num_replicas_ = resolve_num_replicas(options_);
  rank_ = resolve_rank(options_);
  if (num_replicas_ < 1) {
    throw std::invalid_argument("DistributedSampler: num_replicas must be at least 1, got " +
                                std::to_string(num_replicas_));
  }
  if (rank_ < 0 || rank_ >= num_replicas_) {
    throw std::invalid_argument("DistributedSampler: rank " + std::to_string(rank_) +
                                " is outside [0, " + std::to_string(num_replicas_) +
                                "); pass a rank in [0, num_replicas)");
  }
  check_size(dataset_size, num_replicas_, options_.drop_last());
  position_->dataset_size = dataset_size;
  set_epoch(0);
}

std::vector<size_t> DistributedSampler::indices_of(int64_t epoch) const {
  return distributed_indices(position_->dataset_size, num_replicas_, rank_, options_.shuffle(), options_.seed(), epoch,
                             options_.drop_last(), options_.pad());
}

void DistributedSampler::set_epoch(int64_t epoch) {
  Position& position = *position_;
  if (position.restored) {
    // load_state() followed by the program's usual set_epoch(): the loaded position stands.
    if (epoch == position.epoch) return;
    const size_t at = position.consumed();
    if (at > 0 && at < position.indices.size()) {
      throw std::logic_error("DistributedSampler::set_epoch(" + std::to_string(epoch) +
                             "): the sampler was just loaded at epoch " + std::to_string(position.epoch) + " with " +
                             std::to_string(at) + " of its " + std::to_string(position.indices.size()) +
                             " samples consumed; starting another epoch would drop that position and repeat or "
                             "skip samples. Start the epoch loop at the loaded state's epoch");
    }
  }
  position.start(epoch, indices_of(epoch));
}

int64_t DistributedSampler::epoch() const { return position_->epoch; }
size_t DistributedSampler::size() const { return position_->indices.size(); }
size_t DistributedSampler::dataset_size() const { return position_->dataset_size; }
const std::vector<size_t>& DistributedSampler::indices() const { return position_->indices; }

void DistributedSampler::reset(c10::optional<size_t> new_size) {
  Position& position = *position_;
  if (new_size && *new_size != position.dataset_size) {
    check_size(*new_size, num_replicas_, options_.drop_last());
    position.dataset_size = *new_size;
    position.start(position.epoch, indices_of(position.epoch));
    return;
  }
  if (!position.restored) position.restart_at(0);
}

c10::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  Position& position = *position_;
  position.restored = false;
  if (position.yielded >= position.indices.size()) return c10::nullopt;
  const size_t end = std::min(position.indices.size(), position.yielded + batch_size);
  std::vector<size_t> batch(position.indices.begin() + position.yielded, position.indices.begin() + end);
  position.yielded = end;
  // Batches reach the program in the order they were handed out (the loader keeps that order).
  if (position.counting == Counting::kReceived) position.in_flight.push_back(end);
  return batch;
}

void DistributedSampler::count_received() {
  position_->counting = Counting::kReceived;
  position_->restart_at(position_->yielded);
}

void DistributedSampler::count_for_libtorch_loader(size_t workers) {
  position_->counting = workers > 0 ? Counting::kNone : Counting::kYielded;
}

size_t DistributedSampler::consumed(const char* who) const {
  if (position_->counting == Counting::kNone) {
    throw std::logic_error(
        std::string(who) +
        ": this sampler feeds LibTorch's torch::data::make_data_loader with workers, which asks it for batches ahead "
        "of the program (max_jobs, 2 x workers by default), so its count would include samples the program has not "
        "received and a resume from it would skip them. Make the loader with ddp::make_data_loader "
        "(<ddp/data_loader.h>): LibTorch's loader with the same options, whose sampler counts what reached the loop");
  }
  return position_->consumed();
}

void DistributedSampler::mark_received() {
  Position& position = *position_;
  if (position.in_flight.empty()) {
    throw std::logic_error("DistributedSampler: a batch reached the program that the sampler never handed out; was "
                           "the sampler reset (set_epoch, load_state) while a data loader pass was running?");
  }
  position.received = position.in_flight.front();
  position.in_flight.pop_front();
}

SamplerState DistributedSampler::state() const {
  return SamplerState{position_->epoch, static_cast<int64_t>(consumed("DistributedSampler::state()"))};
}

void DistributedSampler::load_state(const SamplerState& state) {
  std::vector<size_t> indices = indices_of(state.epoch);
  const size_t samples = indices.size();
  if (state.consumed < 0 || static_cast<size_t>(state.consumed) > samples) {
    throw std::invalid_argument("DistributedSampler::load_state: consumed " + std::to_string(state.consumed) +
                                " is outside [0, " + std::to_string(samples) +
                                "] (the samples per epoch of this rank); was the state saved with a "
                                "different dataset size or world size?");
  }
  position_->start(state.epoch, std::move(indices));
  position_->restart_at(static_cast<size_t>(state.consumed));
  position_->restored = true;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", torch::tensor(position_->epoch, torch::kInt64), /*is_buffer=*/true);
  archive.write("consumed", torch::tensor(static_cast<int64_t>(consumed("DistributedSampler::save()")), torch::kInt64),
                true);
  archive.write("dataset_size", torch::tensor(static_cast<int64_t>(position_->dataset_size), torch::kInt64), true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  torch::Tensor epoch, consumed, dataset_size;
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("consumed", consumed, true);
  archive.read("dataset_size", dataset_size, true);
  if (static_cast<size_t>(dataset_size.item<int64_t>()) != position_->dataset_size) {
    throw std::invalid_argument("DistributedSampler::load: the archive is for a dataset of " +
                                std::to_string(dataset_size.item<int64_t>()) + " samples, this sampler has " +
                                std::to_string(position_->dataset_size));
  }
  load_state(SamplerState{epoch.item<int64_t>(), consumed.item<int64_t>()});
}

}  // namespace ddp
