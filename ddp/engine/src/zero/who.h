#pragma once
// The name ZeroRedundancyOptimizer's errors start with, for the files that make up the optimizer
// (its construction and step, the consolidation of its state, the overlap with DDP).
namespace ddp::detail {

inline constexpr char kZeroWho[] = "ZeroRedundancyOptimizer";

}  // namespace ddp::detail
