#pragma once
// A training step allocates and frees the same large blocks every time: autograd's gradients and
// the kernels' workspaces (a convolution's columns), and under fully_shard every block's full
// parameters and gradients, freed as soon as they are done with - that is how it bounds memory.
// On a GPU PyTorch's caching allocator keeps such blocks for the next request. On CPU the
// allocator is glibc's malloc, which hands a freed block above its mmap threshold (128 KiB at
// first, sliding up to the largest block freed) back to the kernel, and trims its heap whenever
// more than twice that lies free at its top: the next step faults those pages in afresh, each one
// zeroed by the kernel. Measured at two ranks on resnet_b32 (a 25 ms step alone): DDP's step took
// 29.5-31.3 ms, and fully_shard's 3,700 faults per rank per step cost it about 4 ms.
//
// keep_freed_memory_for_reuse() asks glibc, once per process, to serve blocks below 32 MiB from
// its heap (M_MMAP_THRESHOLD; 32 MiB is as far as glibc's own sliding threshold goes) and to keep
// up to 64 MiB free at its top (M_TRIM_THRESHOLD): a step's blocks are then the last step's, already
// mapped (DDP's resnet_b32 step: 25.4-26.1 ms). The process keeps its peak heap mapped, up to 64
// MiB more than it uses; its peak itself does not grow. It leaves glibc alone where the user has
// chosen: TORCHDDP_MALLOC_TUNING=0, GLIBC_TUNABLES naming a glibc.malloc setting, or
// MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set; and off glibc (another C library) it does
// nothing. With jemalloc or tcmalloc preloaded, glibc's settings are not used (nor needed: they
// keep freed blocks).
//
// Thread-safety: any thread; the first call decides.
namespace ddp::detail {

// Whether glibc was asked (false: the user chose, or not glibc, or glibc refused).
bool keep_freed_memory_for_reuse();

}  // namespace ddp::detail
