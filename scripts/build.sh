#!/usr/bin/env bash
# Configures (once) and builds torchddp into ./build with Ninja: everything, or only the targets
# named (bash scripts/build.sh ddprun train_fashion_mnist).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export CCACHE_DIR="${CCACHE_DIR:-$PWD/.ccache}"
[ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
targets=()
for target in "$@"; do targets+=(--target "$target"); done
cmake --build build -j "${DDP_BUILD_JOBS:-$(nproc)}" "${targets[@]}"
