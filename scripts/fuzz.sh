#!/usr/bin/env bash
# Fuzzes ddp::load_checkpoint with libFuzzer for a bounded time (tests/fuzz says what it checks),
# then the launchers' store protocol for STORE_SECONDS (default 20).
#   bash scripts/fuzz.sh [SECONDS]     default 60; builds into build-fuzz with clang
# Starts from tests/fuzz/corpus (read only); what it learns goes to build-fuzz/corpus. A crash
# leaves build-fuzz/crash-* and fails: add the file to tests/fuzz/corpus once fixed, so the test
# fuzz.CorpusLoadsOrIsRefused keeps it fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
bash scripts/setup.sh
command -v clang++ >/dev/null || { echo "fuzz: clang++ is needed (apt-get install clang libclang-rt-dev)"; exit 1; }
export CCACHE_DIR="${CCACHE_DIR:-$PWD/.ccache}"
[ -f build-fuzz/build.ninja ] || cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++ -DDDP_FUZZ=ON -DDDP_BUILD_TESTS=OFF -DDDP_BUILD_EXAMPLES=OFF \
  -DDDP_BUILD_LAUNCHER=OFF -DDDP_BUILD_BENCHMARKS=OFF -DDDP_INSTALL=OFF >/dev/null
cmake --build build-fuzz -j "${DDP_BUILD_JOBS:-$(nproc)}" --target load_checkpoint_fuzzer store_fuzzer
mkdir -p build-fuzz/corpus
echo "== fuzzing load_checkpoint for ${seconds} s"
cd build-fuzz/tests/fuzz
# -rss_limit_mb: LibTorch's allocator keeps memory; the default 2 GB limit is not a leak signal here.
# -dict: pickle opcodes for the mutations inside pickles (tests/fuzz/pickle_mutator.cpp);
# -max_len: room for them to grow a checkpoint (the seeds are ~22 KB) by a nest of thousands of levels.
./load_checkpoint_fuzzer -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix=../../ \
  -dict=../../../tests/fuzz/pickle.dict -max_len=65536 ../../corpus ../../../tests/fuzz/corpus
echo "== fuzzing the launchers' store protocol for ${STORE_SECONDS:-20} s"
mkdir -p ../../store-corpus
./store_fuzzer -max_total_time="${STORE_SECONDS:-20}" -timeout=10 -print_final_stats=1 -artifact_prefix=../../store- \
  -max_len=16384 ../../store-corpus ../../../tests/fuzz/store_corpus
