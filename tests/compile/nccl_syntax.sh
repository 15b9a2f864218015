#!/usr/bin/env bash
# Compiles torchddp's NCCL code paths (-DDDP_HAVE_NCCL) with -fsyntax-only against this LibTorch's
# headers and the CUDA toolkit's nccl.h, on a machine without a GPU or a CUDA LibTorch: what a GPU
# user's build would compile is at least checked here. Exit 77 (CTest: skipped) without nccl.h.
#   nccl_syntax.sh CXX SOURCE_DIR BUILD_DIR TORCH_INCLUDES(colon-separated) [CUDA_HOME]
set -u -o pipefail
cxx=$1 src=$2 build=$3 torch_includes=$4 cuda=${5:-${CUDA_HOME:-/usr/local/cuda}}
if [[ ! -f $cuda/include/nccl.h || ! -f $cuda/include/cuda_runtime_api.h ]]; then
  echo "SKIP: no CUDA toolkit with nccl.h at $cuda (set CUDA_HOME); the NCCL code paths are not compiled here"
  exit 77
fi
# The repository root: the library names its private headers by their path from it.
includes=(-I"$src/tests/compile/shim" -I"$src/include" -I"$src/ddp/floor/include" -I"$src" -I"$build/generated")
IFS=: read -ra dirs <<<"$torch_includes"
for dir in "${dirs[@]}"; do
  [[ -n $dir ]] && dir=$(realpath -m "$dir")  # /usr/lib/../include is /usr/include
  # The compiler's own system directories stay where they are (-isystem would break #include_next).
  [[ -n $dir && $dir != /usr/include && $dir != /usr/local/include ]] && includes+=(-isystem "$dir")
done
includes+=(-isystem "$cuda/include")
status=0
for file in ddp/floor/src/backends.cpp ddp/floor/src/process_group.cpp ddp/floor/src/collectives.cpp; do
  if "$cxx" -std=gnu++17 -fsyntax-only -D_GLIBCXX_USE_CXX11_ABI=1 -DUSE_DISTRIBUTED -DUSE_C10D_GLOO \
      -DUSE_C10D_NCCL -DDDP_HAVE_NCCL=1 "${includes[@]}" "$src/$file"; then
    echo "ok: $file compiles with the NCCL backend enabled"
  else
    echo "FAIL: $file does not compile with the NCCL backend enabled"
    status=1
  fi
done
exit $status
