#pragma once
// One job per checkpoint directory: two jobs saving into one directory would overwrite and prune
// each other's checkpoint-<step>.pt while both run.
#include <string>

namespace ddp {

// Takes `directory`'s lock for this process, which holds it until it exits: the file
// "<directory>/.torchddp-checkpoint.lock", locked with flock and naming this job's run id
// (TORCHDDP_RUN_ID, torchrun's, Slurm's; launch_environment()), pid and host. Returns at once when
// this process holds it already, or when another process of the same run (the same non-empty run
// id) does. Throws std::runtime_error naming the holder (run id, pid, host) when another job's
// live process holds it; a lock whose process ended is free, and taken over (its file rewritten).
// On a file system without locks, and on Windows, nothing is locked.
void lock_checkpoint_directory(const std::string& directory);

}  // namespace ddp
