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
  # The nccl.h of the NCCL this LibTorch loads, ahead of any other (a CUDA toolkit's may be
  # another release): c10d's NCCLUtils.hpp declares members by NCCL_VERSION_CODE, so a header of
  # another release compiles a different layout. PyPI's torch wheel: nvidia-nccl-cu13 puts it in
  # site-packages/nvidia/nccl beside torch/; else $NCCL_ROOT, else the CUDA toolkit's.
  find_path(DDP_NCCL_INCLUDE_DIR nccl.h
            HINTS "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include" ENV NCCL_ROOT ENV NCCL_HOME
                  ${CUDAToolkit_INCLUDE_DIRS} ENV CUDA_HOME ENV CUDA_PATH
            PATH_SUFFIXES include)
  if(NOT DDP_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "torchddp: this LibTorch has ProcessGroupNCCL but nccl.h was not found: "
                        "set NCCL_ROOT to the NCCL installation its libtorch_cuda loads")
  endif()
endif()
# PyPI's torch wheel: the libraries libtorch_cuda.so loads (NCCL, cuBLAS, ...) are in
# site-packages/nvidia/*/lib, which its own RPATH names, so the loader finds them there. The linker
# looks in CMake's -rpath folders first (the CUDA toolkit's, whose libnccl.so.2 may be an older
# release without symbols this LibTorch uses: 2.28.9 here, against the wheel's 2.30.7);
# -rpath-link makes it resolve them where the loader will.
file(GLOB DDP_TORCH_WHEEL_LIB_DIRS LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
# Official LibTorch builds with Gloo define USE_C10D_GLOO for ProcessGroupGloo.hpp's guard in 2.x.
list(APPEND DDP_TORCH_DEFINITIONS USE_C10D_GLOO)
if(DDP_HAVE_NCCL)
  message(STATUS "torchddp: LibTorch ${Torch_VERSION}, NCCL backend: ON (nccl.h from ${DDP_NCCL_INCLUDE_DIR})")
else()
  message(STATUS "torchddp: LibTorch ${Torch_VERSION}, NCCL backend: OFF")
endif()
