// The hosts of a group from its ranks' host identities (host_layout.h).
#include "ddp/floor/src/shm/host_layout.h"

#include <map>
#include <stdexcept>

namespace ddp::detail::shm {

HostLayout::HostLayout(const std::vector<std::string>& identities) {
  if (identities.empty()) throw std::invalid_argument("HostLayout: a group has at least one rank");
  std::map<std::string, int> host_by_identity;
  for (int rank = 0; rank < static_cast<int>(identities.size()); ++rank) {
    const std::string& identity = identities[rank];
    if (identity.empty()) throw std::invalid_argument("HostLayout: rank " + std::to_string(rank) + " has no host identity");
    // A new identity is the next host: hosts are numbered in the order of their lowest rank.
    const auto [entry, added] = host_by_identity.emplace(identity, hosts());
    if (added) ranks_on_host_.emplace_back();
    const int host = entry->second;
    host_of_.push_back(host);
    local_rank_of_.push_back(static_cast<int>(ranks_on_host_[host].size()));
    ranks_on_host_[host].push_back(rank);
  }
}

std::vector<int> HostLayout::ranks_with_local_rank(int local_rank) const {
  std::vector<int> ranks;
  for (const auto& on_host : ranks_on_host_) ranks.push_back(on_host.at(local_rank));
  return ranks;
}

bool HostLayout::uniform() const {
  for (const auto& on_host : ranks_on_host_) {
    if (on_host.size() != ranks_on_host_.front().size()) return false;
  }
  return true;
}

bool HostLayout::hierarchical() const { return hosts() >= 2 && uniform() && ranks_on_host_.front().size() >= 2; }

}  // namespace ddp::detail::shm
