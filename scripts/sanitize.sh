#!/usr/bin/env bash
# The library under a sanitizer: ThreadSanitizer ("thread") or AddressSanitizer with UBSan
# ("address"), built with the system compiler into build-sanitize-<kind>/, then the tests of the
# threaded parts: DDP (reducer, its hook thread and the backend's completion callbacks), comm
# hooks and PowerSGD, Join, the iteration recorder, SyncBatchNorm, checkpoints (not the kill -9
# loop of CrashSafety: processes, not threads, and 4 minutes under TSan).
#   bash scripts/sanitize.sh thread|address [extra ctest arguments]
# A report fails the test it came from (the sanitizers exit non-zero). LibTorch itself is not
# instrumented: tests/sanitize/tsan.supp suppresses what is reported inside it (each line says why).
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:?usage: scripts/sanitize.sh thread|address [ctest arguments]}
shift
case $kind in
  thread) flags="-fsanitize=thread" ;;
  address) flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" ;;
  *) echo "sanitize.sh: unknown sanitizer '$kind' (expected thread or address)" >&2; exit 2 ;;
esac
bash scripts/setup.sh
export CCACHE_DIR="${CCACHE_DIR:-$PWD/.ccache}"
build=build-sanitize-$kind
[ -f $build/build.ninja ] || cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" \
  -DDDP_BUILD_EXAMPLES=OFF -DDDP_BUILD_BENCHMARKS=OFF -DDDP_BUILD_LAUNCHER=OFF >/dev/null
cmake --build $build -j "${DDP_BUILD_JOBS:-$(nproc)}" --target ddp_tests ddp_nn_tests checkpoint_tests
export TSAN_OPTIONS="suppressions=$PWD/tests/sanitize/tsan.supp halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
export ASAN_OPTIONS="detect_leaks=0 ${ASAN_OPTIONS:-}"  # LibTorch's singletons live until exit
export UBSAN_OPTIONS="print_stacktrace=1 halt_on_error=1 ${UBSAN_OPTIONS:-}"
export OMP_NUM_THREADS=1  # LibTorch's OpenMP runtime is not instrumented
echo "== $kind sanitizer: DDP, DistributedOptimizer, fully_shard, hooks, Join, SyncBatchNorm and checkpoint tests against LibTorch $(cat $build/libtorch_version.txt)"
cd $build && ctest --output-on-failure -j "${DDP_TEST_JOBS:-2}" --timeout 900 \
  -R '^(DDP|DDPErrors|DDPContract|GradientEquivalence|CommHooks|CommHooksErrors|PowerSGD|Join|IterationRecorder|Desync|SyncBatchNorm|ConvertSyncBatchNorm|SaveLoad|Resume|CheckpointState|SaveCompleteOnReturn|OptimizerPlacement|DistributedOptimizer|FullyShard|ShardLayout)[./]' "$@"
