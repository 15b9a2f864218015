#!/usr/bin/env bash
# Builds tests/consumer/project against torchddp both ways a user would:
#   install:   cmake --install, then find_package(ddp)
#   vendored:  add_subdirectory(<torchddp source>)
# and runs the resulting program. Usage: consumer_test.sh <install|vendored> <source dir> <build dir>
set -euo pipefail
mode=$1 src=$2 build=$3
work="$build/consumer_$mode"
rm -rf "$work" && mkdir -p "$work"
launcher=(); command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
if [ "$mode" = install ]; then
  cmake --install "$build" --prefix "$work/prefix" >/dev/null
  cmake -S "$src/tests/consumer/project" -B "$work/build" -G Ninja "${launcher[@]}" \
        -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
else
  cmake -S "$src/tests/consumer/project" -B "$work/build" -G Ninja "${launcher[@]}" \
        -DDDP_SOURCE_DIR="$src" >/dev/null
fi
cmake --build "$work/build" -j 2 >/dev/null
"$work/build/consumer" "$work/store"
