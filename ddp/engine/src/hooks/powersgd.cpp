// PowerSGD (ddp/powersgd.h): reduce() takes the header's eight steps top to bottom.
#include <ddp/powersgd.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ddp/wait_collective.h>

#include "ddp/internal/numbers/check_number.h"

namespace ddp::hooks {

// One bucket layout's state, contiguous so that every step works in place: the error shaped like
// the buffer, and every compressed gradient's P and Q one after another.
struct PowerSGDState::BucketMemory {
  // Gradients multiplied together: one, or (batch_tensors_with_same_shape) all of one shape.
  struct Unit {
    std::vector<size_t> members;  // positions in the bucket
    int64_t rows = 0, cols = 0, rank = 0;
    int64_t p_offset = 0, q_offset = 0;  // in p and q
    bool fresh = true;                   // Q holds no state yet: random values are drawn
  };
  std::vector<size_t> parameters;  // the layout: parameter indices in bucket order
  std::vector<int64_t> offsets;    // each parameter's place in the buffer (and in error)
  std::vector<int64_t> numels;
  std::vector<bool> compressed;    // per position
  std::vector<Unit> units;         // PyTorch's order: by shape, shapes in order of first appearance
  at::Tensor error;                // with error feedback
  at::Tensor p, q;
  int64_t numel_before = 0, numel_after = 0;  // elements sent without and with compression
  bool new_parameters = false;  // holds a parameter PowerSGD never saw: PyTorch draws a seed for it
};

namespace {

// A gradient seen as a matrix: its first dimension by the rest (a scalar is 1 x 1).
struct MatrixShape {
  int64_t rows, cols;
};

MatrixShape matrix_shape(const at::Tensor& parameter) {
  const int64_t rows = parameter.dim() > 0 ? parameter.size(0) : 1;
  return {rows, rows > 0 ? parameter.numel() / rows : 0};
}

void allreduce_sum(const ProcessGroupPtr& group, const at::Tensor& tensor, const char* what, size_t bucket) {
  std::vector<at::Tensor> tensors{tensor};
  ddp::wait_collective(group->allreduce(tensors), [&] {
    return "PowerSGD: allreduce of " + std::string(what) + " of gradient bucket " + std::to_string(bucket);
  });
}

// Makes the columns of each matrix in a batch [k, rows, r] orthonormal: Gram-Schmidt for r <= 2
// and 16-bit types (QR has no half precision), QR otherwise (PyTorch's choice).
void orthogonalize(const at::Tensor& matrices, double epsilon) {
  const int64_t rank = matrices.size(2);
  const bool half = matrices.scalar_type() == at::kHalf || matrices.scalar_type() == at::kBFloat16;
  if (rank > 2 && !half) {
    matrices.copy_(std::get<0>(at::linalg_qr(matrices)));
    return;
  }
  for (int64_t i = 0; i < rank; ++i) {
    at::Tensor column = matrices.narrow(2, i, 1);
    at::Tensor norm = at::linalg_vector_norm(column, 2, at::IntArrayRef{1}, /*keepdim=*/true, c10::nullopt);
    column.div_(epsilon == 0 ? norm : norm + epsilon);
    if (i + 1 < rank) {
      at::Tensor rest = matrices.narrow(2, i + 1, rank - i - 1);
      rest.sub_(at::sum(column * rest, {1}, /*keepdim=*/true) * column);
    }
  }
}

at::Tensor slice(const at::Tensor& flat, int64_t offset, int64_t numel) { return flat.narrow(0, offset, numel); }

}  // namespace

PowerSGDState::PowerSGDState(PowerSGDOptions options) : options_(options) {
  if ((options_.use_error_feedback() || options_.warm_start()) && options_.start_powerSGD_iter() <= 1) {
    throw std::invalid_argument(
        "PowerSGD: start_powerSGD_iter must be > 1 when use_error_feedback or warm_start is on (it is " +
        std::to_string(options_.start_powerSGD_iter()) +
        "): DDP rebuilds its buckets after the first iteration, and their state must start on the final buckets");
  }
  if (options_.matrix_approximation_rank() < 1) {
    throw std::invalid_argument("PowerSGD: matrix_approximation_rank must be >= 1, got " +
                                std::to_string(options_.matrix_approximation_rank()));
  }
  if (options_.random_seed() < 0 || options_.random_seed() > 0xFFFFFFFFLL) {
    throw std::invalid_argument("PowerSGD: random_seed must be between 0 and 2^32 - 1, got " +
                                std::to_string(options_.random_seed()));
  }
  // PyTorch takes any float here; NaN or a negative value only makes nonsense (nothing compressed,
  // or a norm shrunk before dividing by it), so they are refused.
  detail::require_finite("PowerSGD", "min_compression_rate", options_.min_compression_rate(), 0, HUGE_VAL,
                         " (compress a gradient when it shrinks by more than this factor; PyTorch's default is 2)");
  detail::require_finite("PowerSGD", "orthogonalization_epsilon", options_.orthogonalization_epsilon(), 0, HUGE_VAL,
                         " (added to each norm before dividing by it; PyTorch's default is 0)");
  rng_.seed(static_cast<uint32_t>(options_.random_seed()));
}

PowerSGDState::~PowerSGDState() = default;

// numpy's RandomState(seed).randint(1_000_000_000), which PyTorch's hook calls: the same Mersenne
// Twister, each 32-bit draw masked to 30 bits until it is below the bound.
uint32_t PowerSGDState::next_seed() {
  constexpr uint32_t kBound = 1000000000u, kMask = (1u << 30) - 1;
  uint32_t value = 0;
  do {
    value = static_cast<uint32_t>(rng_()) & kMask;
  } while (value >= kBound);
  return value;
}

FuturePtr PowerSGDState::reduce(GradBucket& bucket) {
  at::Tensor buffer = bucket.buffer();
  const ProcessGroupPtr& group = bucket.process_group();
  const size_t index = bucket.index();
  const int world_size = bucket.world_size();

  // 1. Warm-up: a plain averaging allreduce.
  if (iteration_ < options_.start_powerSGD_iter()) {
    buffer.div_(world_size);
    allreduce_sum(group, buffer, "the gradients", index);
    if (bucket.is_last()) ++iteration_;
    return completed_future(buffer);
  }

  BucketMemory& memory = memory_for(bucket);
  numel_before_ += memory.numel_before;
  numel_after_ += memory.numel_after;
  // Each gradient as a matrix, a view into the buffer (which a compression wrapper may have replaced).
  std::vector<at::Tensor> matrices;
  for (size_t k = 0; k < memory.parameters.size(); ++k) {
    const at::Tensor& parameter = bucket.parameters()[k];
    const MatrixShape shape = matrix_shape(parameter);
    matrices.push_back(slice(buffer, memory.offsets[k], parameter.numel()).view({shape.rows, shape.cols}));
  }

  // 2. Error feedback: what compression left out last time joins this gradient.
  at::Tensor with_error;
  if (options_.use_error_feedback()) {
    buffer.add_(memory.error);
    with_error = buffer.clone();
  }

  // 3. The gradients not worth compressing: averaged by one allreduce of their concatenation.
  std::vector<at::Tensor> plain;
  for (size_t k = 0; k < matrices.size(); ++k) {
    if (!memory.compressed[k]) plain.push_back(matrices[k].reshape(-1));
  }
  if (!plain.empty()) {
    at::Tensor flat = at::cat(plain);
    allreduce_sum(group, flat, "the uncompressed gradients", index);
    flat.div_(world_size);
    int64_t offset = 0;
    for (auto& gradient : plain) {
      gradient.copy_(slice(flat, offset, gradient.numel()));
      offset += gradient.numel();
    }
  }

  // PyTorch draws a seed for a bucket without warm start, and the first time it compresses a
  // bucket (even one with nothing to compress): draw the same ones, so the next ones match.
  bool needs_seed = !options_.warm_start() || memory.new_parameters;
  for (const auto& unit : memory.units) needs_seed |= unit.fresh;
  const uint32_t seed = needs_seed ? next_seed() : 0;
  memory.new_parameters = false;

  if (!memory.units.empty()) {
    // Per unit: the gradients as a batch [k, n, m] (a view for one, a stacked copy for several), P and Q.
    std::vector<at::Tensor> batches, ps, qs;
    for (const auto& unit : memory.units) {
      std::vector<at::Tensor> members;
      for (size_t k : unit.members) members.push_back(matrices[k]);
      const int64_t count = static_cast<int64_t>(members.size());
      batches.push_back(count == 1 ? members[0].unsqueeze(0) : at::stack(members));
      ps.push_back(slice(memory.p, unit.p_offset, count * unit.rows * unit.rank).view({count, unit.rows, unit.rank}));
      qs.push_back(slice(memory.q, unit.q_offset, count * unit.cols * unit.rank).view({count, unit.cols, unit.rank}));
    }

    // 4. Q: last iteration's, or random values drawn from one seed per bucket and iteration (the
    //    same on every rank), on the CPU like PyTorch so that both draw the same numbers.
    if (needs_seed) {
      at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
      const bool exact_dtype = buffer.scalar_type() == at::kFloat || buffer.scalar_type() == at::kDouble;
      for (size_t u = 0; u < memory.units.size(); ++u) {
        if (!memory.units[u].fresh && options_.warm_start()) continue;
        qs[u].copy_(at::randn(qs[u].sizes(), generator, at::TensorOptions().dtype(exact_dtype ? buffer.scalar_type() : at::kFloat)));
        memory.units[u].fresh = false;
      }
    }
    for (const auto& q : qs) orthogonalize(q, options_.orthogonalization_epsilon());

    // 5. P = M Q, summed over the ranks, orthonormalized (which makes dividing by the world size moot).
    for (size_t u = 0; u < qs.size(); ++u) at::bmm_out(ps[u], batches[u], qs[u]);
    allreduce_sum(group, memory.p, "P", index);
    for (const auto& p : ps) orthogonalize(p, options_.orthogonalization_epsilon());

    // 6. Q = M^T P, averaged over the ranks.
    for (size_t u = 0; u < qs.size(); ++u) at::bmm_out(qs[u], batches[u].transpose(1, 2), ps[u]);
    allreduce_sum(group, memory.q, "Q", index);
    memory.q.div_(world_size);

    // 7. M = P Q^T, the averaged approximation, into the buffer (stacked copies are copied back).
    for (size_t u = 0; u < qs.size(); ++u) {
      at::bmm_out(batches[u], ps[u], qs[u].transpose(1, 2));
      const auto& members = memory.units[u].members;
      if (members.size() > 1) {
        for (size_t j = 0; j < members.size(); ++j) matrices[members[j]].copy_(batches[u][static_cast<int64_t>(j)]);
      }
    }
  }

  // 8. Error feedback: this rank's gradient (with the old error) minus what the ranks agreed on.
  if (options_.use_error_feedback()) at::sub_out(memory.error, with_error, buffer);
  if (bucket.is_last()) ++iteration_;
  return completed_future(buffer);
}

// The memory of this bucket's layout. A layout seen for the first time (the first compressed
// iteration, DDP's bucket rebuild, a run resumed from a checkpoint) is built from the per-parameter
// state that the previous layout or the checkpoint left.
PowerSGDState::BucketMemory& PowerSGDState::memory_for(const GradBucket& bucket) {
  auto found = memories_.find(bucket.index());
  if (found != memories_.end() && found->second->parameters == bucket.parameter_indices()) return *found->second;
  if (found != memories_.end()) {
    carried_ = per_parameter();  // the layout changed: every bucket's state goes back to its parameters
    memories_.clear();
  }

  auto memory = std::make_unique<BucketMemory>();
  memory->parameters = bucket.parameter_indices();
  memory->offsets = bucket.offsets();
  for (size_t parameter : memory->parameters) memory->new_parameters |= seen_.insert(parameter).second;
  // Which gradients to compress (PyTorch's test), grouped into units in PyTorch's order.
  std::vector<std::pair<std::vector<int64_t>, std::vector<size_t>>> by_shape;  // shape -> positions
  for (size_t k = 0; k < bucket.parameters().size(); ++k) {
    const MatrixShape shape = matrix_shape(bucket.parameters()[k]);
    const int64_t rank = std::min({shape.rows, shape.cols, options_.matrix_approximation_rank()});
    const int64_t compressed_size = (shape.rows + shape.cols) * rank;
    const bool compress = static_cast<double>(compressed_size) * options_.min_compression_rate() <
                          static_cast<double>(shape.rows * shape.cols);
    memory->numels.push_back(bucket.parameters()[k].numel());
    memory->numel_before += shape.rows * shape.cols;
    memory->numel_after += compress ? compressed_size : shape.rows * shape.cols;
    memory->compressed.push_back(compress);
    if (!compress) continue;
    const std::vector<int64_t> key{shape.rows, shape.cols};
    auto same = std::find_if(by_shape.begin(), by_shape.end(), [&](const auto& entry) { return entry.first == key; });
    if (same == by_shape.end()) {
      by_shape.push_back({key, {k}});
    } else {
      same->second.push_back(k);
    }
  }
  int64_t p_size = 0, q_size = 0;
  for (const auto& [shape, positions] : by_shape) {
    std::vector<std::vector<size_t>> groups;
    if (options_.batch_tensors_with_same_shape()) {
      groups.push_back(positions);
    } else {
      for (size_t k : positions) groups.push_back({k});
    }
    for (auto& members : groups) {
      BucketMemory::Unit unit;
      unit.rows = shape[0];
      unit.cols = shape[1];
      unit.rank = std::min({unit.rows, unit.cols, options_.matrix_approximation_rank()});
      unit.p_offset = p_size;
      unit.q_offset = q_size;
      p_size += static_cast<int64_t>(members.size()) * unit.rows * unit.rank;
      q_size += static_cast<int64_t>(members.size()) * unit.cols * unit.rank;
      unit.members = std::move(members);
      memory->units.push_back(std::move(unit));
    }
  }
  const at::Tensor& buffer = bucket.buffer();
  memory->p = at::empty({p_size}, buffer.options());
  memory->q = at::empty({q_size}, buffer.options());
  if (options_.use_error_feedback()) memory->error = at::zeros({buffer.numel()}, buffer.options());

  // Fill in what the parameters carried.
  const auto refuse = [&](size_t parameter, const char* what, const at::Tensor& saved, int64_t expected) {
    throw std::runtime_error("PowerSGD: the state of parameter " + std::to_string(parameter) + " holds a " + what +
                             " of " + std::to_string(saved.numel()) + " elements, the parameter needs " +
                             std::to_string(expected) + ": it was saved for another model or PowerSGDOptions");
  };
  for (auto& unit : memory->units) {
    bool all_carried = true;
    for (size_t j = 0; j < unit.members.size(); ++j) {
      const size_t parameter = memory->parameters[unit.members[j]];
      auto carried = carried_.find(parameter);
      if (carried == carried_.end() || !carried->second.q.defined() || !options_.warm_start()) {
        all_carried = false;
        continue;
      }
      const int64_t numel = unit.cols * unit.rank;
      if (carried->second.q.numel() != numel) refuse(parameter, "Q", carried->second.q, numel);
      slice(memory->q, unit.q_offset + static_cast<int64_t>(j) * numel, numel).copy_(carried->second.q.reshape(-1));
    }
    unit.fresh = !all_carried;
  }
  for (size_t k = 0; k < memory->parameters.size(); ++k) {
    auto carried = carried_.find(memory->parameters[k]);
    if (carried == carried_.end()) continue;
    const int64_t numel = memory->numels[k];
    if (memory->error.defined() && carried->second.error.defined()) {
      if (carried->second.error.numel() != numel) refuse(carried->first, "error", carried->second.error, numel);
      slice(memory->error, memory->offsets[k], numel).copy_(carried->second.error.reshape(-1));
    }
    carried_.erase(carried);
  }
  return *(memories_[bucket.index()] = std::move(memory));
}

// Every parameter's state, wherever it is kept (copies).
std::map<size_t, PowerSGDState::CarriedState> PowerSGDState::per_parameter() const {
  std::map<size_t, CarriedState> out = carried_;
  for (const auto& [index, memory] : memories_) {
    for (size_t k = 0; k < memory->parameters.size(); ++k) {
      CarriedState& state = out[memory->parameters[k]];
      if (memory->error.defined()) state.error = slice(memory->error, memory->offsets[k], memory->numels[k]).clone();
    }
    for (const auto& unit : memory->units) {
      if (unit.fresh || !options_.warm_start()) continue;
      const int64_t numel = unit.cols * unit.rank;
      for (size_t j = 0; j < unit.members.size(); ++j) {
        out[memory->parameters[unit.members[j]]].q =
            slice(memory->q, unit.q_offset + static_cast<int64_t>(j) * numel, numel).view({unit.cols, unit.rank}).clone();
      }
    }
  }
  return out;
}

PowerSGDState::CompressionStats PowerSGDState::compression_stats() const {
  CompressionStats stats;
  stats.numel_before_compression = numel_before_;
  stats.numel_after_compression = numel_after_;
  if (numel_after_ > 0) stats.compress_rate = static_cast<double>(numel_before_) / static_cast<double>(numel_after_);
  return stats;
}

TensorDict PowerSGDState::state_dict() const {
  std::ostringstream rng;
  rng << rng_;
  const std::string text = rng.str();
  TensorDict state{
      {"iteration", at::scalar_tensor(iteration_, at::kLong)},
      {"numel_before", at::scalar_tensor(numel_before_, at::kLong)},
      {"numel_after", at::scalar_tensor(numel_after_, at::kLong)},
      {"rng", at::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, at::kByte).clone()},
  };
  std::vector<int64_t> seen(seen_.begin(), seen_.end());
  state["seen"] = at::tensor(seen, at::kLong);
  for (const auto& [parameter, carried] : per_parameter()) {
    if (carried.error.defined()) state["error." + std::to_string(parameter)] = carried.error.cpu();
    if (carried.q.defined()) state["q." + std::to_string(parameter)] = carried.q.cpu();
  }
  return state;
}

void PowerSGDState::load_state_dict(const TensorDict& state) {
  const auto entry = [&](const std::string& key) -> const at::Tensor& {
    auto found = state.find(key);
    if (found == state.end()) throw std::invalid_argument("PowerSGD state: no entry \"" + key + "\"");
    return found->second;
  };
  const at::Tensor rng_bytes = entry("rng").contiguous();
  std::istringstream rng(std::string(static_cast<const char*>(rng_bytes.data_ptr()), rng_bytes.numel()));
  std::mt19937 restored;
  if (!(rng >> restored)) throw std::invalid_argument("PowerSGD state: \"rng\" is not a generator state");
  std::map<size_t, CarriedState> carried;
  for (const auto& [key, tensor] : state) {
    const auto dot = key.find('.');
    if (dot == std::string::npos) continue;
    const std::string kind = key.substr(0, dot);
    const size_t parameter = std::stoul(key.substr(dot + 1));
    if (kind == "error") carried[parameter].error = tensor;
    if (kind == "q") carried[parameter].q = tensor;
  }
  const at::Tensor seen = entry("seen").contiguous();
  seen_.clear();
  for (int64_t i = 0; i < seen.numel(); ++i) seen_.insert(static_cast<size_t>(seen[i].item<int64_t>()));
  iteration_ = entry("iteration").item<int64_t>();
  numel_before_ = entry("numel_before").item<int64_t>();
  numel_after_ = entry("numel_after").item<int64_t>();
  rng_ = restored;
  memories_.clear();
  carried_ = std::move(carried);
}

// Every option changes what the ranks send (or, for the seed, the Qs they must share), so all of
// them are what the ranks must agree on.
namespace {
std::string settings_of(const PowerSGDOptions& o) {
  std::ostringstream text;
  text << "matrix_approximation_rank=" << o.matrix_approximation_rank()
       << ", start_powerSGD_iter=" << o.start_powerSGD_iter() << ", min_compression_rate=" << o.min_compression_rate()
       << ", use_error_feedback=" << o.use_error_feedback() << ", warm_start=" << o.warm_start()
       << ", orthogonalization_epsilon=" << o.orthogonalization_epsilon() << ", random_seed=" << o.random_seed()
       << ", batch_tensors_with_same_shape=" << o.batch_tensors_with_same_shape();
  return text.str();
}
}  // namespace

CommHook powersgd(PowerSGDOptions options) {
  auto state = std::make_shared<PowerSGDState>(options);
  return CommHook([state](GradBucket& bucket) { return state->reduce(bucket); }, "powersgd", state,
                  settings_of(options));
}

}  // namespace ddp::hooks
