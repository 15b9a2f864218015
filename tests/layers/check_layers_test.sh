#!/usr/bin/env bash
# The layering check (check_layers.py) passes on the tree, and fails on a copy of it with one
# upward include in the floor, one test reaching into the engine's src/ and one private header
# named bare: a check that cannot fail would prove nothing.
set -euo pipefail
src=$1
python3 "$src/tests/layers/check_layers.py" "$src"
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
for folder in include ddp sampler checkpoint amp nn launch tests examples benchmarks; do
  cp -r "$src/$folder" "$copy/"
done
echo '#include <ddp/distributed_data_parallel.h>' >>"$copy/ddp/floor/src/metrics.cpp"
echo '#include "ddp/engine/src/reducer/reducer.h"' >>"$copy/tests/ddp/test_ddp.cpp"
echo '#include "shm/channel.h"' >>"$copy/ddp/floor/src/metrics.cpp"
if out=$(python3 "$src/tests/layers/check_layers.py" "$copy"); then
  echo "FAIL: the check passed a tree with a floor file including an engine header"; exit 1
fi
echo "$out"
grep -q "ddp/floor/src/metrics.cpp: includes <ddp/distributed_data_parallel.h>, a header of engine, which floor may not use" <<<"$out"
grep -q "tests/ddp/test_ddp.cpp: includes the private header ddp/engine/src/reducer/reducer.h of engine from outside the library" <<<"$out"
grep -q 'ddp/floor/src/metrics.cpp: includes "shm/channel.h": name a private header by its path from the repository root, "ddp/floor/src/shm/channel.h"' <<<"$out"
echo "PASS: the layering holds, and the three planted violations were named"
