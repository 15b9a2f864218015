// Barrier through the shared segments (algorithms.h): one post and one wait.
#include "ddp/floor/src/shm/algorithms.h"
#include "ddp/floor/src/shm/steps.h"

namespace ddp::detail::shm::algorithm {

void barrier(Peers& peers) {
  // Post that I arrived; wait until everyone has.
  peers.post();
  peers.wait_all(peers.posted(), {"the peers to arrive"});
}

}  // namespace ddp::detail::shm::algorithm
