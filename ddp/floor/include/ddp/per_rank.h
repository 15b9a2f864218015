#pragma once
// What a training program does differently on each rank: print from one rank only, and seed each
// rank's random generators apart.
//
//   auto pg = ddp::init_process_group();
//   ddp::manual_seed(42);                         // rank r: torch::manual_seed(42 + r)
//   if (ddp::is_main_process()) std::printf("epoch %d: ...\n", epoch);
//
// Thread-safety: as the default group (process_group.h): call them from the program's thread.
#include <cstdint>

namespace ddp {

// True on rank 0 of the default group, and when no default group exists (a program that never
// called init_process_group, or after destroy_process_group, is its own main process). The rank
// that prints, logs and writes files meant once per job.
bool is_main_process();

// Seeds the CPU (and every CUDA device's) default generator with seed + rank, the rank in the
// default group (0 without one), as torch::manual_seed does with one number. Why not one seed on
// every rank: each rank would then draw the same random numbers, so dropout would drop the same
// units and random augmentation would transform every rank's shard alike, which is less noise
// than the single process on the global batch had. Model initialisation is unaffected:
// DistributedDataParallel starts every rank from rank 0's parameters and buffers, and
// DistributedSampler shuffles with its own seed, the same on every rank. Returns the seed used.
uint64_t manual_seed(uint64_t seed);

}  // namespace ddp
