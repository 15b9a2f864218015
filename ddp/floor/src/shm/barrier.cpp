// Barrier through the shared segments (algorithms.h): one post and one wait.
#include "algorithms.h"
#include "steps.h"

namespace ddp::detail::shm::algorithm {

void barrier(Peers& peers) {
  // Post that I arrived; wait until everyone has.
  peers.post();
  peers.wait_all(peers.posted(), {"the peers to arrive"});
}

}  // namespace ddp::detail::shm::algorithm
