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

// Read once per group, when it is made (init_process_group, new_group, and the groups DDP and
// DistributedOptimizer split off at construction), into the group's recipe: the library asks the
// group (backends.h, debug_level_of), never the environment per collective. An unknown value is an
// std::invalid_argument naming it and the valid ones.
DebugLevel debug_level();

// Writes "[torchddp INFO] <message>" to stderr (the caller checked the level).
void info_log(const std::string& message);

}  // namespace ddp::detail
