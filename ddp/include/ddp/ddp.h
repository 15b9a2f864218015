#pragma once
// Umbrella header: everything torchddp offers.
#include <ddp/bucket_assignment.h>
#include <ddp/ddp_options.h>
#include <ddp/distributed_data_parallel.h>
#include <ddp/process_group.h>
#include <ddp/sampler_state.h>
#if __has_include(<ddp/distributed_sampler.h>)
#include <ddp/distributed_sampler.h>
#endif
#if __has_include(<ddp/fashion_mnist.h>)
#include <ddp/fashion_mnist.h>
#endif
#if __has_include(<ddp/metrics.h>)
#include <ddp/metrics.h>
#endif
#if __has_include(<ddp/checkpoint.h>)
#include <ddp/checkpoint.h>
#endif
