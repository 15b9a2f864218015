#!/usr/bin/env bash
# Builds tests/consumer/project against torchddp both ways a user would:
#   install:   cmake --install, then find_package(ddp)
#   vendored:  add_subdirectory(<torchddp source>), with no option set
# and runs the resulting program.
# Usage: consumer_test.sh <install|vendored> <source dir> <build dir> [the build's CMAKE_PREFIX_PATH, ':'-separated]
# (the LibTorch the build used: a wheel's or a zip's, not whichever the system has).
set -euo pipefail
mode=$1 src=$2 build=$3 torch_prefix=${4:-}
torch_prefix=${torch_prefix//:/;}
prefix_option=(); [ -z "$torch_prefix" ] || prefix_option=(-DCMAKE_PREFIX_PATH="$torch_prefix")
work="$build/consumer_$mode"
rm -rf "$work" && mkdir -p "$work"
launcher=(); command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
if [ "$mode" = install ]; then
  cmake --install "$build" --prefix "$work/prefix" >/dev/null
  # The library, its headers, its CMake package and ddprun; no example program.
  extra=$(ls "$work/prefix/bin" | grep -vx ddprun || true)
  [ -z "$extra" ] || { echo "consumer: cmake --install put more than ddprun into bin/: $extra"; exit 1; }
  [ -f "$work/prefix/include/ddp/version.h" ] || { echo "consumer: include/ddp/version.h not installed"; exit 1; }
  cmake -S "$src/tests/consumer/project" -B "$work/build" -G Ninja "${launcher[@]}" \
        -DCMAKE_PREFIX_PATH="$work/prefix${torch_prefix:+;$torch_prefix}" >/dev/null
else
  # Vendored with defaults: only the library is built, and nothing lands in the user's cache.
  cmake -S "$src/tests/consumer/project" -B "$work/build" -G Ninja "${launcher[@]}" \
        -DDDP_SOURCE_DIR="$src" "${prefix_option[@]}" >/dev/null
  build_type=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$work/build/CMakeCache.txt")
  [ -z "$build_type" ] || { echo "consumer: torchddp set CMAKE_BUILD_TYPE=$build_type in the user's cache"; exit 1; }
  targets=$(cmake --build "$work/build" --target help | grep -oE '^[a-z_]+(_tests|_ddp|_bench|run|_child|_mnist)\b' || true)
  [ -z "$targets" ] || { echo "consumer: vendored torchddp defines targets beyond the library: $targets"; exit 1; }
fi
cmake --build "$work/build" -j 2 >/dev/null
"$work/build/consumer" "$work/store"
