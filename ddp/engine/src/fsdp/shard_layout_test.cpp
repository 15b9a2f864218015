// The shard layout on its own: W ranks' padded chunks of a parameter side by side give the parameter
// back, zero-padded.
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/engine/src/fsdp/shard_layout.h"

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
    // Each parameter's W padded chunks side by side (what its all-gather delivers) begin with the
    // parameter itself; the padding is zero.
    ddp::detail::ShardLayout layout(kShapes, world, 0);
    for (size_t i = 0; i < fulls.size(); ++i) {
      const auto& slot = layout.slots()[i];
      std::vector<torch::Tensor> chunks;
      for (const auto& flat : flats) chunks.push_back(flat.narrow(0, slot.offset, slot.padded_numel()));
      const torch::Tensor side_by_side = torch::cat(chunks);
      EXPECT_TRUE(torch::equal(side_by_side.narrow(0, 0, fulls[i].numel()).view(fulls[i].sizes()), fulls[i]))
          << "parameter " << i << " W=" << world;
      EXPECT_EQ(side_by_side.narrow(0, fulls[i].numel(), side_by_side.numel() - fulls[i].numel()).abs().sum().item<double>(), 0);
    }
  }
}

// Parameters under the threshold come first in the flat shard, and packed_chunks finds each one's
// W chunks among every rank's packed prefix.
TEST(ShardLayout, SmallParametersArePackedFirst) {
  torch::manual_seed(4);
  const int world = 3;
  std::vector<torch::Tensor> fulls;
  for (const auto& shape : kShapes) fulls.push_back(torch::randn(shape));
  std::vector<torch::Tensor> prefixes;
  for (int rank = 0; rank < world; ++rank) {
    ddp::detail::ShardLayout layout(kShapes, world, rank, /*packed_below=*/20);
    torch::Tensor flat = torch::zeros({layout.flat_numel()});
    for (size_t i = 0; i < fulls.size(); ++i) layout.copy_local_rows(fulls[i], i, flat);
    for (const auto& slot : layout.slots()) {
      EXPECT_EQ(slot.packed, slot.rows * slot.row_numel < 20);
      EXPECT_EQ(slot.packed, slot.offset < layout.packed_numel());
    }
    prefixes.push_back(flat.narrow(0, 0, layout.packed_numel()));
  }
  ddp::detail::ShardLayout layout(kShapes, world, 0, 20);
  const torch::Tensor packed_all = torch::cat(prefixes);
  for (size_t i = 0; i < fulls.size(); ++i) {
    if (!layout.slots()[i].packed) continue;
    const torch::Tensor side_by_side = layout.packed_chunks(packed_all, i).reshape(-1);
    EXPECT_TRUE(torch::equal(side_by_side.narrow(0, 0, fulls[i].numel()).view(fulls[i].sizes()), fulls[i])) << i;
  }
}

}  // namespace
