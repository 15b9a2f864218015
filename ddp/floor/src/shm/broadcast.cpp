// Broadcast through the shared segments (algorithms.h): the root stages each chunk in its buffer,
// the others copy it out.
#include "ddp/floor/src/shm/algorithms.h"
#include "ddp/floor/src/shm/steps.h"

namespace ddp::detail::shm::algorithm {

void broadcast(Peers& peers, void* data, std::size_t bytes, int root) {
  auto* out = static_cast<unsigned char*>(data);
  const bool is_root = peers.rank() == root;
  peers.for_each_chunk(bytes, peers.options().chunk_bytes, is_root, [&](const Chunk& chunk) {
    // 1. The root copies its chunk into a free buffer of its own; everyone posts (the others to
    //    say they arrived, which the desync check needs).
    if (is_root && chunk.n > 0) copy_bytes(peers.buffer(root, chunk.buffer), out + chunk.first, chunk.n);
    peers.post();
    // 2. Once everyone arrived, the root's chunk is in: the others copy it out; everyone posts
    //    that it is done reading.
    peers.wait_all(peers.posted(), chunk.waiting_for("the root's chunk"));
    if (!is_root && chunk.n > 0) copy_bytes(out + chunk.first, peers.buffer(root, chunk.buffer), chunk.n);
    peers.post();
  });
}

}  // namespace ddp::detail::shm::algorithm
