#pragma once
// Where the ranks of a group run: the hosts, numbered in the order of their lowest rank, and each
// rank's index among its host's ranks ("local rank"). Built from every rank's host identity, the
// string the ranks already agree through the store before shared memory may serve a group
// (channel.cpp: hostname, boot id, the /dev/shm mount), so every rank computes the same layout.
//
// A hierarchical allreduce reduces inside each host over shared memory, allreduces part
// l of the result across the hosts among the ranks of local rank l, then shares the parts inside
// each host again. It applies when hierarchical() holds; a group that spans hosts otherwise runs
// flat on Gloo.
//
// Thread-safety: a value; const methods may be called from any thread.
#include <string>
#include <vector>

namespace ddp::detail::shm {

class HostLayout {
 public:
  // identities[r]: rank r's host identity; ranks with equal identities share a host. Throws
  // std::invalid_argument for an empty list or an empty identity (a rank that cannot tell).
  explicit HostLayout(const std::vector<std::string>& identities);

  int size() const { return static_cast<int>(host_of_.size()); }
  int hosts() const { return static_cast<int>(ranks_on_host_.size()); }
  // The host of `rank` (0 .. hosts() - 1) and its index among that host's ranks, in rank order.
  int host_of(int rank) const { return host_of_.at(rank); }
  int local_rank_of(int rank) const { return local_rank_of_.at(rank); }
  // The ranks on `host`, in rank order.
  const std::vector<int>& ranks_on_host(int host) const { return ranks_on_host_.at(host); }
  // The ranks of local rank `local_rank` on every host, in host order (a cross-host group). Throws
  // std::out_of_range when some host has no rank of that index.
  std::vector<int> ranks_with_local_rank(int local_rank) const;
  // Every host runs the same number of ranks.
  bool uniform() const;
  // Two hosts or more, each with the same number of ranks, two or more: the hierarchical
  // allreduce applies (one host is all shared memory; one rank per host is all Gloo).
  bool hierarchical() const;

 private:
  std::vector<int> host_of_;
  std::vector<int> local_rank_of_;
  std::vector<std::vector<int>> ranks_on_host_;
};

}  // namespace ddp::detail::shm
