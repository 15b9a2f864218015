# What this LibTorch offers that our code must know at compile time.
# ProcessGroupNCCL.hpp is guarded by USE_C10D_NCCL, which LibTorch does not export to consumers.
set(DDP_TORCH_DEFINITIONS "")
set(DDP_HAVE_NCCL OFF)
if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
  foreach(dir ${TORCH_INCLUDE_DIRS})
    if(EXISTS "${dir}/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
      set(DDP_HAVE_NCCL ON)
    endif()
  endforeach()
endif()
if(DDP_HAVE_NCCL)
  list(APPEND DDP_TORCH_DEFINITIONS USE_C10D_NCCL DDP_HAVE_NCCL=1)
endif()
# Official LibTorch builds with Gloo define USE_C10D_GLOO for ProcessGroupGloo.hpp's guard in 2.x.
list(APPEND DDP_TORCH_DEFINITIONS USE_C10D_GLOO)
message(STATUS "torchddp: LibTorch ${Torch_VERSION}, NCCL backend: ${DDP_HAVE_NCCL}")
