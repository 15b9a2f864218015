// ddp::Join: the join check, the shadow loop and the final sync (the steps are listed in join.h).
#include <ddp/join.h>

#include <sstream>
#include <utility>

#include <ATen/ATen.h>

#include <ddp/wait_collective.h>
#include "ddp/floor/src/backends.h"
#include "ddp/internal/diagnostics/debug_level.h"
#include "ddp/floor/src/desync.h"
#include "ddp/floor/src/start_allreduce.h"

namespace ddp {
namespace {

// What an iteration runs under when active ranks do not wait for its check: the active ranks the
// previous check found, with this iteration's number and sync.
JoinStatus lagged(JoinStatus previous, int64_t iteration, bool sync) {
  previous.iteration = iteration;
  previous.sync = sync;
  return previous;
}

std::string list(const std::vector<int>& ranks) {
  std::ostringstream out;
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  return out.str();
}

}  // namespace

// One join check: [active ranks, syncing ranks, one flag per rank that is still active], summed.
struct Join::Check {
  int64_t iteration = 0;
  at::Tensor flags;  // on the collective's device
  c10::intrusive_ptr<c10d::Work> work;
};

Join::Join(std::vector<std::reference_wrapper<Joinable>> joinables, JoinOptions options)
    : joinables_(std::move(joinables)), options_(std::move(options)) {
  if (joinables_.empty()) throw std::invalid_argument("ddp::Join: give it at least one joinable (the DDP model)");
  group_ = joinables_.front().get().join_process_group();
}

Join::~Join() = default;

bool Join::waits_for_check() const {
  return options_.throw_on_early_termination() || !options_.divide_by_initial_world_size();
}

void Join::run(const std::function<void()>& loop) {
  if (!options_.enable()) {
    loop();
    return;
  }
  struct Attached {
    Join* join;
    Attached(Join* j) : join(j) {
      for (size_t i = 0; i < join->joinables_.size(); ++i) join->joinables_[i].get().join_attach(join, i);
    }
    ~Attached() {
      for (size_t i = 0; i < join->joinables_.size(); ++i) join->joinables_[i].get().join_attach(nullptr, i);
    }
  } attached(this);
  status_ = everyone_active();
  pending_.reset();

  // 1. This rank's own loop; every iteration's join check runs inside it (notify).
  loop();

  // What the others' next iteration runs under when they do not wait for its check: this rank's
  // last check (it was still active then).
  JoinStatus previous = pending_ ? read_check(*std::exchange(pending_, nullptr)) : status_;

  // 2-3. Out of inputs: take part in the others' iterations until no rank is active.
  bool last_joiner = true;  // no rank was active after this one's loop ended
  JoinStatus last;
  while (true) {
    last = read_check(*launch_check(/*active=*/false, /*sync=*/false));
    if (last.active.empty()) break;
    if (options_.throw_on_early_termination()) throw_early_termination(last);
    // As the active ranks run it.
    const JoinStatus iteration = waits_for_check() ? last : lagged(previous, last.iteration, last.sync);
    for (auto& joinable : joinables_) joinable.get().join_shadow(iteration);
    previous = std::move(last);
    last_joiner = false;
  }

  // 4. Everyone is done: the state to keep is that of a rank that trained until the end.
  at::Tensor from = at::tensor({last_joiner ? static_cast<int64_t>(group_->getRank()) : int64_t{-1}}, at::kLong)
                        .to(collective_device(group_));
  wait_collective(detail::start_allreduce_max(group_, from), "ddp::Join: choosing the last joiner");
  const int source = static_cast<int>(from.cpu().item<int64_t>());
  for (auto& joinable : joinables_) joinable.get().join_finish(last, source);
}

const JoinStatus& Join::notify(size_t index, bool sync) {
  if (index != 0) return status_;
  if (waits_for_check()) {
    status_ = read_check(*launch_check(/*active=*/true, sync));
    if (options_.throw_on_early_termination() && static_cast<int>(status_.active.size()) < status_.world_size) {
      throw_early_termination(status_);
    }
    return status_;
  }
  // The previous iteration's check has had a whole iteration to complete: reading it rarely waits.
  JoinStatus previous = pending_ ? read_check(*pending_) : status_;
  pending_ = launch_check(/*active=*/true, sync);
  status_ = lagged(std::move(previous), pending_->iteration, sync);
  return status_;
}

std::unique_ptr<Join::Check> Join::launch_check(bool active, bool sync) {
  const int world = group_->getSize(), rank = group_->getRank();
  if (detail::debug_level_of(group_) == detail::DebugLevel::kDetail) {
    detail::verify_same_collective(group_, {detail::CollectiveOp::kJoin, -1, at::kLong, 2 + world}, "ddp::Join");
  }
  at::Tensor flags = at::zeros({2 + world}, at::kLong);
  if (active) {
    auto* f = flags.data_ptr<int64_t>();
    f[0] = 1;
    f[1] = sync ? 1 : 0;
    f[2 + rank] = 1;
  }
  auto check = std::make_unique<Check>();
  check->iteration = ++iterations_;
  check->flags = flags.to(collective_device(group_));
  std::vector<at::Tensor> tensors{check->flags};
  check->work = group_->allreduce(tensors);
  return check;
}

JoinStatus Join::read_check(Check& check) const {
  wait_collective(check.work, "ddp::Join: the check of which ranks still have inputs");
  const at::Tensor flags = check.flags.cpu();
  const auto* f = flags.data_ptr<int64_t>();
  JoinStatus status;
  status.iteration = check.iteration;
  status.world_size = group_->getSize();
  for (int r = 0; r < status.world_size; ++r) {
    if (f[2 + r] != 0) status.active.push_back(r);
  }
  status.sync = f[1] > 0;
  if (f[1] != 0 && f[1] != f[0]) {
    throw CollectiveError("ddp::Join: in iteration " + std::to_string(status.iteration) + ", " +
                          std::to_string(f[1]) + " of the " + std::to_string(f[0]) +
                          " active ranks synchronize gradients and the others are inside no_sync(); every rank "
                          "must use no_sync() in the same iterations");
  }
  return status;
}

// Before the first check: every rank is taken to have inputs.
JoinStatus Join::everyone_active() const {
  JoinStatus status;
  status.world_size = group_->getSize();
  for (int r = 0; r < status.world_size; ++r) status.active.push_back(r);
  return status;
}

void Join::throw_early_termination(const JoinStatus& status) const {
  std::vector<int> done;
  for (int r = 0, a = 0; r < status.world_size; ++r) {
    if (a < static_cast<int>(status.active.size()) && status.active[a] == r) {
      ++a;
    } else {
      done.push_back(r);
    }
  }
  throw EarlyTerminationError("ddp::Join: rank" + std::string(done.size() > 1 ? "s " : " ") + list(done) +
                              " ran out of inputs first (before iteration " + std::to_string(status.iteration) +
                              ") while rank" + (status.active.size() > 1 ? "s " : " ") + list(status.active) +
                              " still had some; throw_on_early_termination stops every rank");
}

// --- JoinableAllReduce ------------------------------------------------------------------------------

JoinableAllReduce::JoinableAllReduce(const at::Tensor& like, ProcessGroupPtr group)
    : group_(std::move(group)), zeros_(at::zeros_like(like)) {}

at::Tensor JoinableAllReduce::all_reduce(const at::Tensor& tensor) {
  if (tensor.sizes() != zeros_.sizes() || tensor.scalar_type() != zeros_.scalar_type()) {
    std::ostringstream message;
    message << "JoinableAllReduce::all_reduce: got " << tensor.sizes() << " " << tensor.scalar_type()
            << ", but it was made for " << zeros_.sizes() << " " << zeros_.scalar_type()
            << " (a rank without inputs contributes zeros of that shape)";
    throw std::invalid_argument(message.str());
  }
  if (join_ != nullptr) join_->notify(index_, /*sync=*/true);
  at::Tensor sum = tensor.clone();
  ddp::all_reduce(sum, c10d::ReduceOp::SUM, group_);
  return sum;
}

ProcessGroupPtr JoinableAllReduce::join_process_group() const { return group_ ? group_ : default_group(); }

void JoinableAllReduce::join_attach(Join* join, size_t index) {
  join_ = join;
  index_ = index;
}

void JoinableAllReduce::join_shadow(const JoinStatus&) {
  at::Tensor zeros = zeros_.clone();
  ddp::all_reduce(zeros, c10d::ReduceOp::SUM, group_);
}

}  // namespace ddp
