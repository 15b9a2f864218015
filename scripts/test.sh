#!/usr/bin/env bash
# The whole test suite: set-up, build, then every test through CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
cd build && ctest --output-on-failure -j "${DDP_TEST_JOBS:-2}" "$@"
