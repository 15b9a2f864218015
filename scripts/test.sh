#!/usr/bin/env bash
# The whole test suite: set-up, build, then every test through CTest.
# Extra arguments go to ctest (bash scripts/test.sh -R sampler).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
echo "== test suite against LibTorch $(cat build/libtorch_version.txt)"
cd build && ctest --output-on-failure -j "${DDP_TEST_JOBS:-2}" "$@"
