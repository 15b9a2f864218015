#pragma once
// Umbrella header: everything torchddp offers. It lives above the library's folders so that none
// of them includes another from above: ddp/ (process groups, DDP) is the floor, data/,
// checkpoint/, amp/ and nn/ build on it.
#include <ddp/version.h>

// ddp/: process groups, collectives, DistributedDataParallel
#include <ddp/bucket_assignment.h>
#include <ddp/comm_hooks.h>
#include <ddp/ddp_options.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/join.h>
#include <ddp/logging.h>
#include <ddp/metrics.h>
#include <ddp/process_group.h>
#include <ddp/stateful.h>

// data/: the sampler and the dataset reader
#include <ddp/distributed_sampler.h>
#include <ddp/fashion_mnist.h>
#include <ddp/sampler_state.h>

// checkpoint/: rank-0 save, load with map_location
#include <ddp/checkpoint.h>

// amp/: mixed precision (dynamic loss scaling, autocast scopes)
#include <ddp/autocast.h>
#include <ddp/grad_scaler.h>
// nn/: modules for distributed training
#include <ddp/sync_batchnorm.h>
