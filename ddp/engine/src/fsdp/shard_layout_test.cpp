// The shard layout on its own: W ranks' chunks put side by side give every parameter back, and a
// full gradient cut into segments puts in segment r exactly what rank r keeps.
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/shard_layout.h"

namespace {

const std::vector<std::vector<int64_t>> kShapes{{11, 3}, {7}, {}, {2, 2, 2}, {1, 5}, {4}};

TEST(ShardLayout, ChunksSideBySideGiveEveryParameterBack) {
  torch::manual_seed(3);
  std::vector<torch::Tensor> fulls;
  for (const auto& shape : kShapes) fulls.push_back(torch::randn(shape));
  for (int world = 1; world <= 4; ++world) {
    std::vector<torch::Tensor> flats;
    for (int rank = 0; rank < world; ++rank) {
      ddp::detail::ShardLayout layout(kShapes, world, rank);
      torch::Tensor flat = torch::full({layout.flat_numel()}, 99.0);  // padding must be overwritten
      for (size_t i = 0; i < fulls.size(); ++i) layout.copy_local_rows(fulls[i], i, flat);
      for (size_t i = 0; i < fulls.size(); ++i) {
        const auto& slot = layout.slots()[i];
        const int64_t rows = kShapes[i].empty() ? 1 : kShapes[i][0];
        const int64_t chunk = (rows + world - 1) / world;
        EXPECT_EQ(slot.local_rows, std::max<int64_t>(0, std::min(chunk, rows - rank * chunk)));
        EXPECT_EQ(layout.shard_view(flat, i).size(0), slot.local_rows);
      }
      flats.push_back(flat);
    }
    ddp::detail::ShardLayout layout(kShapes, world, 0);
    const torch::Tensor gathered = torch::cat(flats);
    for (size_t i = 0; i < fulls.size(); ++i) {
      EXPECT_TRUE(torch::equal(layout.full_from_gathered(gathered, i), fulls[i])) << "parameter " << i << " W=" << world;
    }
    // Cutting the full values into segments puts rank r's flat shard, zero-padded, in segment r.
    torch::Tensor segments = torch::full({world * layout.flat_numel()}, 99.0);
    for (size_t i = 0; i < fulls.size(); ++i) layout.place_in_segments(fulls[i], i, segments);
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_TRUE(torch::equal(segments.narrow(0, rank * layout.flat_numel(), layout.flat_numel()), flats[rank]))
          << "segment " << rank << " W=" << world;
    }
  }
}

}  // namespace
