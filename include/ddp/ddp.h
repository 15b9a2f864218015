#pragma once
// Umbrella header: everything torchddp offers. It lives above the library's parts, so none of
// them includes another from above. The layers (the build enforces them, tests/layers checks):
//   ddp/floor   process groups, rendezvous, collectives, launch environment, metrics, Stateful
//   ddp/engine  DistributedDataParallel: reducer, comm hooks, PowerSGD, Join, timeline, ZeRO (on the floor)
//   sampler/, checkpoint/, amp/, nn/   each on the floor only
#include <ddp/version.h>

// ddp/floor: process groups and the free collectives
#include <ddp/device_mesh.h>
#include <ddp/launch_environment.h>
#include <ddp/metrics.h>
#include <ddp/per_rank.h>
#include <ddp/process_group.h>
#include <ddp/stateful.h>
#include <ddp/wait_collective.h>

// ddp/engine: DistributedDataParallel and what plugs into it (ZeroRedundancyOptimizer too)
#include <ddp/comm_hooks.h>
#include <ddp/ddp_options.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/distributed_optimizer.h>
#include <ddp/join.h>
#include <ddp/logging.h>
#include <ddp/powersgd.h>
#include <ddp/zero_redundancy_optimizer.h>
#include <ddp/ddp_zero_hook.h>
#include <ddp/fully_shard.h>

// sampler/: DistributedSampler, its resumable state, and the loader that counts what the program received
#include <ddp/data_loader.h>
#include <ddp/distributed_sampler.h>
#include <ddp/sampler_state.h>

// checkpoint/: rank-0 save, load with map_location
#include <ddp/checkpoint.h>

// amp/: mixed precision (dynamic loss scaling, autocast scopes)
#include <ddp/autocast.h>
#include <ddp/grad_scaler.h>

// nn/: modules for distributed training
#include <ddp/sync_batchnorm.h>
