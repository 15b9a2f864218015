#!/usr/bin/env bash
# The main job: set-up, build (the launcher and the program only, not the test suite), then
# Fashion-MNIST trained by 2 ranks (DistributedDataParallel + DistributedSampler, Gloo on this
# machine's CPUs), launched by ddprun.
# Extra arguments go to the training program, e.g.: bash scripts/main.sh --epochs 5
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh ddprun train_fashion_mnist
exec ./build/launch/ddprun --standalone --nproc-per-node "${NPROC:-2}" -- \
  ./build/examples/train_fashion_mnist/train_fashion_mnist "$@"
