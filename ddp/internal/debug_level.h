#pragma once
// TORCH_DISTRIBUTED_DEBUG, the variable PyTorch users know:
//   OFF (default)  nothing extra
//   INFO           DDP logs a summary at construction, timing stats periodically, and the names of
//                  parameters that got no gradient (rank 0 logs, on stderr)
//   DETAIL         INFO, plus before each of DDP's collectives every rank checks that all ranks run
//                  the same one with the same size (desync.h): a desync is an error on every rank
//                  naming each rank's collective, within one collective's time, instead of a hang
//                  or a wrong average. Costs one small allgather per collective.
#include <string>

namespace ddp::detail {

enum class DebugLevel { kOff, kInfo, kDetail };

// Read where it is needed: when a DDP model or Join is constructed or checks, and when one logs
// (never per gradient). An unknown value is an std::invalid_argument naming it and the valid ones.
DebugLevel debug_level();

// Writes "[torchddp INFO] <message>" to stderr when the level is INFO or DETAIL.
void info_log(const std::string& message);

}  // namespace ddp::detail
