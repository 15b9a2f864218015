// torch.distributed's other collectives (reduce_scatter_tensor, all_gather_into_tensor,
// all_to_all_single, reduce, gather, scatter, send/recv, monitored_barrier) at W = 2, 3, 4, over
// shared memory and over Gloo alone, each against the result computed here from every rank's
// known input.
#include <chrono>
#include <csignal>
#include <fstream>
#include <set>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ddp/ddp.h>

#include "multiprocess.h"

namespace {

using namespace ddp::test;

// Rank q's input of n elements: distinct per rank and position, small enough for exact products.
torch::Tensor input_of(int q, int64_t n, torch::ScalarType dtype, bool small = false) {
  auto values = small ? torch::arange(n) % 3 + 1 + q % 2 : torch::arange(n) + 1 + 10 * q;
  return values.to(dtype);
}

torch::Tensor reduce_locally(const std::vector<torch::Tensor>& inputs, c10d::ReduceOp::RedOpType op) {
  auto out = inputs[0].clone();
  for (size_t q = 1; q < inputs.size(); ++q) {
    switch (op) {
      case c10d::ReduceOp::SUM: out += inputs[q]; break;
      case c10d::ReduceOp::PRODUCT: out *= inputs[q]; break;
      case c10d::ReduceOp::MAX: out = torch::maximum(out, inputs[q]); break;
      case c10d::ReduceOp::MIN: out = torch::minimum(out, inputs[q]); break;
      default: fail("no local reference for this op");
    }
  }
  return out;
}

bool same(const torch::Tensor& got, const torch::Tensor& want) {
  return got.is_floating_point() ? torch::allclose(got, want, 1e-6, 1e-6) : torch::equal(got, want);
}

void check_collectives(const ddp::ProcessGroupPtr& group) {
  const int rank = ddp::get_rank(group), world = ddp::get_world_size(group);
  const std::string where = " (rank " + std::to_string(rank) + " of " + std::to_string(world) + ", " +
                            ddp::transport(group) + ")";
  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kLong}) {
    for (auto op : {c10d::ReduceOp::SUM, c10d::ReduceOp::PRODUCT, c10d::ReduceOp::MAX, c10d::ReduceOp::MIN}) {
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1027}}) {
        const bool small = op == c10d::ReduceOp::PRODUCT;
        std::vector<torch::Tensor> inputs;
        for (int q = 0; q < world; ++q) inputs.push_back(input_of(q, world * n, dtype, small));
        auto output = torch::empty({n}, dtype);
        ddp::reduce_scatter_tensor(output, inputs[rank], op, group);
        const auto want = reduce_locally(inputs, op).narrow(0, rank * n, n);
        require(same(output, want), "reduce_scatter_tensor, " + std::string(c10::toString(dtype)) + " n=" +
                                        std::to_string(n) + " op " + std::to_string(static_cast<int>(op)) + where);
        auto reduced = inputs[rank].clone();
        ddp::reduce(reduced, world - 1, op, group);
        if (rank == world - 1) require(same(reduced, reduce_locally(inputs, op)), "reduce to the last rank" + where);
      }
    }
    for (int64_t n : {int64_t{1}, int64_t{1027}}) {
      auto gathered = torch::empty({world * n}, dtype);
      ddp::all_gather_into_tensor(gathered, input_of(rank, n, dtype), group);
      std::vector<torch::Tensor> pieces;
      for (int q = 0; q < world; ++q) pieces.push_back(input_of(q, n, dtype));
      require(torch::equal(gathered, torch::cat(pieces)), "all_gather_into_tensor n=" + std::to_string(n) + where);
      const auto at_one = ddp::gather(input_of(rank, n, dtype), 1 % world, group);
      require(rank == 1 % world ? at_one.size() == static_cast<size_t>(world) : at_one.empty(), "gather's list size" + where);
      for (size_t q = 0; q < at_one.size(); ++q) require(torch::equal(at_one[q], pieces[q]), "gather" + where);
      auto mine = torch::empty({n}, dtype);
      ddp::scatter(mine, rank == 0 ? pieces : std::vector<torch::Tensor>{}, 0, group);
      require(torch::equal(mine, pieces[rank]), "scatter" + where);
    }
  }
  // all_to_all_single, equal blocks of 3 rows x 2: rank q's block i lands as rank i's block q.
  auto block = [](int from, int to, int64_t rows) { return torch::full({rows, 2}, 100 * from + to, torch::kLong); };
  {
    std::vector<torch::Tensor> send, expect;
    for (int i = 0; i < world; ++i) {
      send.push_back(block(rank, i, 3));
      expect.push_back(block(i, rank, 3));
    }
    auto output = torch::empty({3 * world, 2}, torch::kLong);
    ddp::all_to_all_single(output, torch::cat(send), {}, {}, group);
    require(torch::equal(output, torch::cat(expect)), "all_to_all_single, equal blocks" + where);
  }
  // Uneven: rank q sends q + i + 1 rows to rank i.
  {
    std::vector<torch::Tensor> send, expect;
    std::vector<int64_t> in_splits, out_splits;
    for (int i = 0; i < world; ++i) {
      send.push_back(block(rank, i, rank + i + 1));
      in_splits.push_back(rank + i + 1);
      expect.push_back(block(i, rank, i + rank + 1));
      out_splits.push_back(i + rank + 1);
    }
    const auto expected = torch::cat(expect);
    auto output = torch::empty_like(expected);
    ddp::all_to_all_single(output, torch::cat(send), out_splits, in_splits, group);
    require(torch::equal(output, expected), "all_to_all_single, uneven blocks" + where);
  }
  // Point to point: a ring, then every rank to rank 0 received from any source.
  const int next = (rank + 1) % world, previous = (rank + world - 1) % world;
  auto from_previous = torch::empty({5}, torch::kFloat);
  auto sent = ddp::isend(input_of(rank, 5, torch::kFloat), next, group, 7);
  require(ddp::recv(from_previous, previous, group, 7) == previous, "recv's source" + where);
  ddp::wait_collective(sent, "the ring's send");
  require(torch::equal(from_previous, input_of(previous, 5, torch::kFloat)), "ring send/recv" + where);
  if (rank == 0) {
    std::set<int> senders;
    for (int k = 1; k < world; ++k) {
      auto got = torch::empty({2}, torch::kLong);
      const int from = ddp::recv(got, -1, group, 9);
      require(torch::equal(got, torch::full({2}, from, torch::kLong)), "any-source recv's data");
      senders.insert(from);
    }
    require(static_cast<int>(senders.size()) == world - 1 && !senders.count(0), "any-source recv's senders" + where);
  } else {
    ddp::send(torch::full({2}, rank, torch::kLong), 0, group, 9);
  }
}

DDP_WORKER(more_collectives) {
  worker_init();
  check_collectives(ddp::default_group());
  if (ddp::get_world_size() == 4) {  // the same over a subgroup, whose ranks are its own
    auto odds = ddp::new_group(ddp::NewGroupOptions().ranks({1, 3}));
    if (odds) check_collectives(odds);
  }
}
TEST(MoreCollectives, EachMatchesTheResultComputedFromEveryRanksInput) {
  for (int world : {2, 3, 4}) EXPECT_WORKERS_OK(run_workers("more_collectives", world));
  RunOptions gloo;
  gloo.env["TORCHDDP_SHM"] = "0";
  EXPECT_WORKERS_OK(run_workers("more_collectives", 3, gloo));  // over Gloo alone
}

// The same collectives at c10d level, on the group handle (_reduce_scatter_base, _allgather_base),
// as code written against c10d calls them: float, double and int64, per-rank sizes around the
// shared-memory steps (512 KiB per chunk, split among the W - 1 peers), in place and not, waited
// on through the Work or its future. References: sums computed here from every rank's input.
void check_c10d_halves(const ddp::ProcessGroupPtr& group) {
  const int rank = group->getRank(), world = group->getSize();
  const std::string where = " (rank " + std::to_string(rank) + " of " + std::to_string(world) + ", " +
                            ddp::transport(group) + ")";
  int call = 0;
  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kLong}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{32767}, int64_t{32768}, int64_t{32769}, int64_t{65535},
                      int64_t{65536}, int64_t{65537}, int64_t{131072}, int64_t{131073}}) {
      const std::string what = std::string(c10::toString(dtype)) + " n=" + std::to_string(n) + where;
      std::vector<torch::Tensor> inputs;
      for (int q = 0; q < world; ++q) inputs.push_back(input_of(q, world * n, dtype));
      const auto sum = reduce_locally(inputs, c10d::ReduceOp::SUM);
      const bool in_place = ++call % 3 == 0, through_future = call % 2 == 0;
      auto input = inputs[rank].clone();
      auto output = in_place ? input.narrow(0, rank * n, n) : torch::empty({n}, dtype);
      c10d::ReduceScatterOptions options;
      options.reduceOp = c10d::ReduceOp::SUM;
      auto work = group->_reduce_scatter_base(output, input, options);
      if (through_future) {
        work->getFuture()->wait();
        require(!work->getFuture()->hasError(), "_reduce_scatter_base's future failed, " + what);
      } else {
        ddp::wait_collective(work, "_reduce_scatter_base");
      }
      require(same(output, sum.narrow(0, rank * n, n)), "_reduce_scatter_base" + std::string(in_place ? " in place, " : ", ") + what);
      if (!in_place) require(torch::equal(input, inputs[rank]), "_reduce_scatter_base changed its input, " + what);

      auto piece = input_of(rank, n, dtype);
      auto gathered = torch::empty({world * n}, dtype);
      if (in_place) gathered.narrow(0, rank * n, n).copy_(piece);
      auto mine = in_place ? gathered.narrow(0, rank * n, n) : piece;
      auto gather_work = group->_allgather_base(gathered, mine);
      ddp::wait_collective(gather_work, "_allgather_base");
      std::vector<torch::Tensor> pieces;
      for (int q = 0; q < world; ++q) pieces.push_back(input_of(q, n, dtype));
      require(torch::equal(gathered, torch::cat(pieces)), "_allgather_base" + std::string(in_place ? " in place, " : ", ") + what);
    }
  }
}

DDP_WORKER(c10d_halves) {
  worker_init();
  check_c10d_halves(ddp::default_group());
}
TEST(MoreCollectives, C10dReduceScatterAndAllgatherBaseOnTheGroupHandle) {
  for (int world : {2, 3}) EXPECT_WORKERS_OK(run_workers("c10d_halves", world));
  RunOptions gloo;
  gloo.env["TORCHDDP_SHM"] = "0";
  for (int world : {2, 3}) EXPECT_WORKERS_OK(run_workers("c10d_halves", world, gloo));  // over Gloo alone
}

// Without TORCH_DISTRIBUTED_DEBUG, shared memory's own check names a rank in reduce-scatter while
// the other is in all-gather (its descriptors, at no extra round trip): never paired.
DDP_WORKER(halves_desync_shm) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank();
  auto small = torch::zeros({2}), large = torch::zeros({4});
  try {
    if (rank == 0) {
      ddp::reduce_scatter_tensor(small, large);
    } else {
      ddp::all_gather_into_tensor(large, small);
    }
    fail("mismatched collectives were paired");
  } catch (const ddp::CollectiveError& error) {
    require_mentions(error.what(), "not running the same collective", "the shared-memory check");
    require_mentions(error.what(), "rank 0 runs reduce_scatter", "rank 0's collective");
    require_mentions(error.what(), "rank 1 runs allgather", "rank 1's collective");
  }
}
TEST(MoreCollectives, MismatchedCollectivesAreNamedOverSharedMemory) {
  EXPECT_WORKERS_OK(run_workers("halves_desync_shm", 2));
}

DDP_WORKER(more_collectives_bad_input) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank();
  auto out = torch::empty({3});
  require_throws([&] { ddp::reduce_scatter_tensor(out, torch::ones({5})); },
                  "input must hold the group's size (2) times output's elements", "reduce_scatter sizes");
  require_throws([&] { ddp::all_gather_into_tensor(out, torch::ones({2})); },
                  "output must hold the group's size (2) times input's elements", "all_gather_into_tensor sizes");
  auto six = torch::zeros({6});  // the right size, the wrong dtype: named with the dtypes
  require_throws([&] { ddp::all_gather_into_tensor(six, torch::ones({3}, torch::kDouble)); },
                 "it holds 6 Float for 3 Double", "all_gather_into_tensor dtypes");
  require_throws([&] { ddp::reduce(out, 2); }, "dst 2 is not a rank of the group, whose ranks are 0 to 1", "reduce's dst");
  auto four = torch::empty({4});
  require_throws([&] { ddp::all_to_all_single(four, torch::ones({3})); },
                  "input's first dimension (3) does not split into 2 equal blocks", "all_to_all_single's split");
  require_throws([&] { ddp::all_to_all_single(out, torch::ones({3}), {1, 2}, {1, 1}); },
                  "input_split_sizes sum to 2, but input has 3 rows", "all_to_all_single's sizes");
  require_throws([&] { ddp::send(out, rank); }, "is this rank itself", "a send to oneself");
  if (rank == 0) {
    require_throws([&] { ddp::scatter(out, {torch::ones({3})}, 0); }, "scatter_list holds 1 tensors on the source rank",
                    "a short scatter_list");
  }
  require_throws([&] { ddp::reduce_scatter_tensor(out, torch::ones({2, 3}).t()); },
                  "must be a defined, contiguous tensor", "a non-contiguous input");
  int one = 1;
  ddp::all_reduce(one);
  require(one == 2, "the group after the refusals");
}
TEST(MoreCollectives, BadInputIsNamed) { EXPECT_WORKERS_OK(run_workers("more_collectives_bad_input", 2)); }

// Under TORCH_DISTRIBUTED_DEBUG=DETAIL a rank in reduce_scatter_tensor while the other is in
// all_gather_into_tensor is named on both, never paired.
DDP_WORKER(more_collectives_desync) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank();
  auto small = torch::zeros({2}), large = torch::zeros({4});
  try {
    if (rank == 0) {
      ddp::reduce_scatter_tensor(small, large);
    } else {
      ddp::all_gather_into_tensor(large, small);
    }
    fail("mismatched collectives were paired");
  } catch (const ddp::CollectiveError& error) {
    require_mentions(error.what(), "reduce_scatter_tensor", "rank 0's collective");
    require_mentions(error.what(), "all_gather_into_tensor", "rank 1's collective");
  }
}
TEST(MoreCollectives, MismatchedCollectivesAreNamedUnderDetail) {
  RunOptions detail;
  detail.env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL";
  EXPECT_WORKERS_OK(run_workers("more_collectives_desync", 2, detail));
}

// monitored_barrier: rank 2 arrives 3 s late; with a 1 s timeout rank 0's error names rank 2.
DDP_WORKER(monitored) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank();
  ddp::monitored_barrier({}, std::chrono::seconds(5));  // everyone on time: passes
  if (rank == 2) {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    return;
  }
  try {
    ddp::monitored_barrier({}, std::chrono::seconds(1));
    fail("monitored_barrier passed without rank 2");
  } catch (const ddp::CollectiveError& error) {
    if (rank == 0) require_mentions(error.what(), "2", "the missing rank");
    require_mentions(error.what(), "ddp::monitored_barrier: not every rank arrived within 1000 ms", "the error");
  }
}
TEST(MoreCollectives, MonitoredBarrierNamesTheRankThatDidNotArrive) {
  EXPECT_WORKERS_OK(run_workers("monitored", 3));
}

// --- Point to point and all-to-all through shared memory (the group's mailbox; all_to_all.cpp) ---

// Message `tag` from `from` to `to`: n floats, exact, distinct per sender, receiver and tag.
torch::Tensor message_of(int from, int to, int tag, int64_t n) {
  return torch::arange(n, torch::kFloat) * 0.5f + static_cast<float>(1000 * from + 100 * to + tag);
}

// Every rank isends a message of several mailbox slots (a slot is at most 256 KiB) to every other
// rank before anyone receives, then irecvs one from each: both ways at once, nothing waits for
// anything but the data.
void sends_first_both_ways(int rank, int world, const std::string& where) {
  constexpr int64_t kLarge = 400000;  // 1.6 MB
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<torch::Tensor> got(world);
  for (int q = 0; q < world; ++q) {
    if (q != rank) works.push_back(ddp::isend(message_of(rank, q, 3, kLarge), q, {}, 3));
  }
  for (int q = 0; q < world; ++q) {
    if (q == rank) continue;
    got[q] = torch::empty({kLarge});
    works.push_back(ddp::irecv(got[q], q, {}, 3));
  }
  for (auto& work : works) ddp::wait_collective(work, "isend/irecv both ways" + where);
  for (int q = 0; q < world; ++q) {
    if (q != rank) require(torch::equal(got[q], message_of(q, rank, 3, kLarge)), "the message from rank " + std::to_string(q) + where);
  }
}

// Each rank sends the next one three messages on each of six tags, interleaved (sizes per tag and
// index); the next receives the tags in reverse order: each tag's messages in the order sent.
void tags_interleaved(int rank, int world, const std::string& where) {
  const int next = (rank + 1) % world, previous = (rank + world - 1) % world;
  const auto size_of = [](int tag, int k) { return int64_t{1} + tag * 30000 + k * 7; };
  std::vector<c10::intrusive_ptr<c10d::Work>> sent;
  for (int k = 0; k < 3; ++k) {
    for (int tag = 0; tag < 6; ++tag) sent.push_back(ddp::isend(message_of(rank, next, 10 * tag + k, size_of(tag, k)), next, {}, tag));
  }
  for (int tag = 5; tag >= 0; --tag) {
    for (int k = 0; k < 3; ++k) {
      auto got = torch::empty({size_of(tag, k)});
      require(ddp::recv(got, previous, {}, tag) == previous, "recv's source" + where);
      require(torch::equal(got, message_of(previous, rank, 10 * tag + k, size_of(tag, k))),
              "tag " + std::to_string(tag) + " message " + std::to_string(k) + where);
    }
  }
  for (auto& work : sent) ddp::wait_collective(work, "a tagged send" + where);
}

DDP_WORKER(point_to_point_shm) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  const std::string where = " (rank " + std::to_string(rank) + " of " + std::to_string(world) + ")";
  require(ddp::transport() == "gloo+shm", "expected shared memory, got " + ddp::transport());
  sends_first_both_ways(rank, world, where);
  tags_interleaved(rank, world, where);
  // Rank 0 receives from any source, without knowing who comes next, two messages from each rank.
  if (rank == 0) {
    std::vector<int> next(world, 0);
    for (int m = 0; m < 2 * (world - 1); ++m) {
      auto got = torch::empty({70000});
      const int from = ddp::recv(got, -1, {}, 5);
      require(from > 0 && from < world, "any-source recv's sender" + where);
      require(torch::equal(got, message_of(from, 0, next[from]++, 70000)), "a message from any source, in order" + where);
    }
  } else {
    for (int k = 0; k < 2; ++k) ddp::send(message_of(rank, 0, k, 70000), 0, {}, 5);
  }
  // A receive waiting on one thread holds up no collective: rank 0 waits for rank 1's message,
  // which rank 1 sends only after an all_reduce every rank runs meanwhile.
  auto late = torch::empty({3});
  auto waiting = rank == 0 ? ddp::irecv(late, 1, {}, 11) : c10::intrusive_ptr<c10d::Work>();
  int one = 1;
  ddp::all_reduce(one);
  require(one == world, "the all_reduce while a receive waits" + where);
  if (rank == 1) ddp::send(message_of(1, 0, 11, 3), 0, {}, 11);
  if (rank == 0) {
    ddp::wait_collective(waiting, "the late receive");
    require(torch::equal(late, message_of(1, 0, 11, 3)), "the late message" + where);
  }
}
TEST(MoreCollectives, PointToPointThroughSharedMemory) {
  for (int world : {2, 3, 4}) EXPECT_WORKERS_OK(run_workers("point_to_point_shm", world));
}

// Rank 1 is killed in the middle of a 64 MB send to rank 0 (whose receive comes only once rank 1
// said it is sending: the ring fills and the send stops there); rank 0's recv names rank 1; at
// three ranks, rank 0 and rank 2 exchange on.
DDP_WORKER(point_to_point_killed) {
  worker_init(std::chrono::seconds(30));
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  constexpr int64_t kHuge = 16 << 20;  // floats: 64 MB
  const std::string sending = shared_dir() + "/rank1_sending";
  if (rank == 1) {
    auto work = ddp::isend(torch::ones({kHuge}), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the ring is full by now
    std::ofstream(sending) << "1";
    std::raise(SIGKILL);
  }
  if (rank == 2) {
    auto got = torch::empty({5});
    ddp::recv(got, 0, {}, 1);
    require(torch::equal(got, message_of(0, 2, 1, 5)), "rank 0's message after the kill");
    return;
  }
  while (!std::ifstream(sending).good()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the kill lands
  auto got = torch::empty({kHuge});
  try {
    ddp::recv(got, 1);
    fail("a recv from a killed rank passed");
  } catch (const ddp::CollectiveError& error) {
    require_mentions(error.what(), "rank 1 (pid", "the killed rank");
    require_mentions(error.what(), "exited", "what happened to it");
    require_mentions(error.what(), "rank 0's receive from rank 1 (tag 0, 67108864 bytes)", "what rank 0 was doing");
  }
  if (world == 3) ddp::send(message_of(0, 2, 1, 5), 2, {}, 1);
}
TEST(MoreCollectives, APeerKilledMidSendIsNamedByRank) {
  for (int world : {2, 3}) {
    const auto results = run_workers("point_to_point_killed", world);
    for (const auto& result : results) {
      if (result.rank == 1) {
        EXPECT_EQ(result.signal, SIGKILL) << result.output;
      } else {
        EXPECT_TRUE(result.signal == 0 && !result.timed_out && result.exit_code == 0) << "rank " << result.rank << ": " << result.output;
      }
    }
  }
}

// all_to_all_single of large uneven blocks (rank q sends (q + i + 1) x 9000 rows of 8 floats to
// rank i: 0.3 to 2.3 MB a block, many staging rounds; this rank's block for itself copied beside
// the exchange), equal large blocks, and the same through the group handle's alltoall_base.
DDP_WORKER(all_to_all_large) {
  worker_init();
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  const std::string where = " (rank " + std::to_string(rank) + " of " + std::to_string(world) + ")";
  require(ddp::transport() == "gloo+shm", "expected shared memory, got " + ddp::transport());
  auto block = [](int from, int to, int64_t rows) {
    return torch::arange(rows * 8, torch::kFloat).view({rows, 8}) + static_cast<float>(100000 * from + 1000 * to);
  };
  for (const bool even : {false, true}) {
    std::vector<torch::Tensor> send, expect;
    std::vector<int64_t> in_splits, out_splits;
    for (int i = 0; i < world; ++i) {
      const int64_t out_rows = even ? 30000 : (rank + i + 1) * 9000, in_rows = even ? 30000 : (i + rank + 1) * 9000;
      send.push_back(block(rank, i, out_rows));
      in_splits.push_back(out_rows);
      expect.push_back(block(i, rank, in_rows));
      out_splits.push_back(in_rows);
    }
    const auto expected = torch::cat(expect);
    auto output = torch::full_like(expected, -1);
    if (even) {
      ddp::all_to_all_single(output, torch::cat(send), {}, {});
    } else {
      ddp::all_to_all_single(output, torch::cat(send), out_splits, in_splits);
    }
    require(torch::equal(output, expected), std::string("all_to_all_single of large ") + (even ? "equal" : "uneven") + " blocks" + where);
    auto through_c10d = torch::full_like(expected, -1);
    auto input = torch::cat(send);
    c10d::AllToAllOptions options;
    ddp::wait_collective(ddp::default_group()->alltoall_base(through_c10d, input, out_splits, in_splits, options), "alltoall_base");
    require(torch::equal(through_c10d, expected), "alltoall_base of large blocks" + where);
  }
}
TEST(MoreCollectives, AllToAllOfLargeBlocksThroughSharedMemory) {
  for (int world : {2, 3, 4}) EXPECT_WORKERS_OK(run_workers("all_to_all_large", world));
}

// all_to_all_single on one rank while the other runs all_gather_into_tensor: shared memory's own
// check names both, never pairs them.
DDP_WORKER(all_to_all_desync_shm) {
  worker_init(std::chrono::seconds(20));
  const int rank = ddp::get_rank();
  auto four = torch::zeros({4}), two = torch::zeros({2});
  try {
    if (rank == 0) {
      ddp::all_to_all_single(four, torch::ones({4}));
    } else {
      ddp::all_gather_into_tensor(four, two);
    }
    fail("mismatched collectives were paired");
  } catch (const ddp::CollectiveError& error) {
    require_mentions(error.what(), "rank 0 runs all_to_all", "rank 0's collective");
    require_mentions(error.what(), "rank 1 runs allgather", "rank 1's collective");
  }
}
TEST(MoreCollectives, AllToAllInAnotherCollectiveIsNamedOverSharedMemory) {
  EXPECT_WORKERS_OK(run_workers("all_to_all_desync_shm", 2));
}

}  // namespace
