#!/usr/bin/env bash
# The whole test suite again, built against the LibTorch inside PyPI's `torch` wheel (the version
# pinned in scripts/libtorch_wheel.requirements): a CUDA build of LibTorch with c10d's real
# ProcessGroupNCCL, NCCL from the nvidia-nccl-cu13 wheel. CI runs it beside scripts/test.sh
# (Debian's 1.13) and scripts/libtorch2_chroot.sh (Debian's 2.6). No GPU is needed: the CUDA and
# NCCL code is compiled and linked, and the GPU tests skip naming why.
#
#   bash scripts/libtorch_wheel.sh              # set up (once), build, run the suite
#   bash scripts/libtorch_wheel.sh -R Nccl      # extra arguments go to ctest
#
# Environment:
#   DDP_WHEEL_VENV   the virtual environment (default .venv-torch in the checkout, git-ignored)
#   DDP_WHEEL_BUILD  the build directory (default build-wheel)
#   PYTHON           the interpreter that makes the venv (default python3; the wheel pinned must
#                    exist for its version: 2.15 has CPython 3.10-3.14 wheels)
#   DDP_BUILD_JOBS, DDP_TEST_JOBS   as for scripts/test.sh
#   TARGETS          build only these targets (pair with -R for ctest)
#   PREPARE_ONLY=1   stop once the venv is in place (no build, no tests)
#   ALL_TESTS=1      also run the tests labelled `once` (the same on every LibTorch; the host's
#                    scripts/test.sh runs them), as scripts/libtorch2_chroot.sh
#
# Steps: venv with torch --no-deps and only the packages holding the shared libraries LibTorch's
# CUDA build links to (skipped when the venv already has them) -> configure build-wheel once, with
# CMAKE_PREFIX_PATH from torch.utils.cmake_prefix_path -> build -> ctest (the tests find the venv's
# python3 and torchrun by themselves: tests/CMakeLists.txt, DDP_PYTHON).
#
# Gloo's headers: the wheel does not ship them (ProcessGroupGloo.hpp includes <gloo/...>), and no
# registry this project reaches has the exact Gloo commit this torch was built from. The build
# uses Debian's libgloo-dev (scripts/setup.sh installs it). Our code only passes a
# gloo::transport::Device between c10d's own functions, so only declarations are read from those
# headers; a Gloo API difference that mattered would fail the build or the link here, and the
# Gloo tests of the suite run against the wheel's own Gloo (compiled into libtorch_cpu.so).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
venv=${DDP_WHEEL_VENV:-$repo/.venv-torch}
build=${DDP_WHEEL_BUILD:-$repo/build-wheel}
requirements=$repo/scripts/libtorch_wheel.requirements
log() { echo "[libtorch-wheel] $*"; }
phase_start=$SECONDS
phase() { log "$1 took $((SECONDS - phase_start)) s"; phase_start=$SECONDS; }

bash scripts/setup.sh  # the compiler, Ninja, ccache, Gloo's headers, the test suite's programs
bash scripts/setup.sh python3-venv  # `python3 -m venv` (Debian keeps ensurepip in its own package)

# --- 1. the virtual environment -------------------------------------------------------------------
# The full dependency set of torch 2.15 is about 3.0 GB of downloads; the build and the suite need
# about 2.5 GB of it. Left out: triton (286 MB, torch.compile's kernel compiler), cuda-bindings
# (Python's CUDA API), and the cuda-toolkit parts libtorch_cuda.so does not load at start
# (cusolver, 228 MB, loaded by libtorch_cuda_linalg.so on first use; nvtx). What stays: every
# library in the DT_NEEDED closure of libtorch.so (cudart, cublas, cufft, cufile, cupti, cusparse
# and its nvjitlink, nvrtc, cuDNN, cuSPARSELt, NVSHMEM, NCCL), at the versions torch's metadata
# pins, and the small pure-Python packages `import torch` (torchrun) needs.
stamp=$venv/.torchddp-installed
if [[ ! -f $stamp ]] || ! cmp -s "$requirements" "$stamp"; then
  log "setting up $venv from $requirements"
  [[ -x $venv/bin/python ]] || "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$requirements"
  # torch's own Requires-Dist, for this platform, less what the build and the suite never load.
  mapfile -t needed < <("$venv/bin/python" - <<'EOF'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
left_out = {"triton", "cuda-bindings"}
left_out_extras = {"cusolver", "nvtx"}
for line in requires("torch"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name in left_out:
        continue
    extras = sorted(set(req.extras) - left_out_extras)
    print(req.name + (f"[{','.join(extras)}]" if extras else "") + str(req.specifier))
EOF
  )
  log "torch's dependencies installed: ${needed[*]}"
  "$venv/bin/pip" install -q --disable-pip-version-check "${needed[@]}"
  log "(pip's note that torch requires triton and cuda-bindings is expected: they are left out)"
  cp "$requirements" "$stamp"
  phase "venv set-up"
fi
torch_version=$("$venv/bin/python" -W ignore -c 'import torch; print(torch.__version__)')
# torch.utils.cmake_prefix_path finds TorchConfig.cmake; the torch package's own folder goes first
# too, because TorchConfig looks up libc10.so with find_library, which would take another LibTorch
# in the system's library folders (Debian's libtorch-dev) over the wheel's.
prefix=$("$venv/bin/python" -W ignore -c 'import os, torch.utils; p = torch.utils.cmake_prefix_path
print(p + ";" + os.path.dirname(os.path.dirname(p)))')
[[ ${PREPARE_ONLY:-0} == 1 ]] && { log "torch $torch_version ready in $venv"; exit 0; }

# --- 2. configure, build --------------------------------------------------------------------------
export CCACHE_DIR="${CCACHE_DIR:-$repo/.ccache}"
if [[ ! -f $build/build.ninja ]]; then
  log "configuring $build against torch $torch_version ($prefix)"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
fi
targets=()
for target in ${TARGETS:-}; do targets+=(--target "$target"); done
cmake --build "$build" -j "${DDP_BUILD_JOBS:-$(nproc)}" "${targets[@]}"
phase "build"

# What of the NCCL backend was compiled and linked, from the build itself: the objects whose
# recorded headers include c10d's ProcessGroupNCCL.hpp or nccl.h (ninja's deps log), the ProcessGroupNCCL
# symbols the test binary takes from LibTorch, and the libnccl its loader resolves.
nccl_objects=$(ninja -C "$build" -t deps | awk '/^[^ ].*\.o: #deps/ {object = $1; sub(/:$/, "", object)}
                                               /\/(ProcessGroupNCCL\.hpp|nccl\.h)$/ {print object}' | sort -u)
# A unity batch's object is named with the files it holds (CMake's Unity/unity_N_cxx.cxx includes them).
with_members() {
  local object unity
  for object in "$@"; do
    unity=$build/${object%.o}
    if [[ $object == */Unity/* && -f $unity ]]; then
      echo "$object ($(sed -n 's|^#include "\(.*\)"$|\1|p' "$unity" | xargs -r -n 1 basename | paste -sd ' ' -))"
    else
      echo "$object"
    fi
  done
}
log "objects compiled against c10d's ProcessGroupNCCL.hpp or nccl.h:" $(with_members $nccl_objects)
tests_binary=$build/tests/ddp/ddp_tests
if [[ -x $tests_binary ]]; then
  log "ddp_tests: $(nm -DC --undefined-only "$tests_binary" | grep -c 'c10d::ProcessGroupNCCL') ProcessGroupNCCL" \
      "symbols from $(ldd "$tests_binary" | awk '/libtorch_cuda/ {print $3}'); NCCL: $(ldd "$tests_binary" | awk '/libnccl/ {print $3}')"
fi

# --- 3. the suite ---------------------------------------------------------------------------------
log "test suite against LibTorch $(cat "$build/libtorch_version.txt") (torch $torch_version wheel)"
cd "$build"
status=0
once=(-LE once)
[[ ${ALL_TESTS:-0} == 1 ]] && once=()
ctest --output-on-failure -j "${DDP_TEST_JOBS:-2}" "${once[@]}" "$@" || status=$?
phase "test suite"
exit $status
