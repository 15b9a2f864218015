#!/usr/bin/env bash
# Startup cost of ddprun: time from launching `ddprun --nproc-per-node N --standalone` to the
# moment the last rank finished its first all_reduce (launch_child writes that instant), and,
# for comparison, the same ranks started by hand and how long ddprun alone takes to start and
# exit (`ddprun --standalone true`).
# Not a pass/fail test. Usage: bench_startup.sh BUILD_DIR [N=4] [REPEATS=5]
set -euo pipefail
build=${1:?usage: bench_startup.sh BUILD_DIR [N] [REPEATS]}
n=${2:-4}
repeats=${3:-5}
ddprun=$build/launch/ddprun
child=$build/tests/launch/launch_child
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

ms() { echo $(( ($1 - $2) / 1000000 )); }

echo "ranks=$n repeats=$repeats  (ms)"
for i in $(seq "$repeats"); do
  rm -f "$dir"/rank_*.txt
  start=$(date +%s%N)
  "$ddprun" --nproc-per-node "$n" --standalone -- "$child" allreduce "$dir" >/dev/null 2>&1
  end=$(date +%s%N)
  last=$(grep -h '^done_ns=' "$dir"/rank_*.txt | cut -d= -f2 | sort -n | tail -1)
  s0=$(date +%s%N); "$ddprun" --standalone -- true; s1=$(date +%s%N)
  # Baseline: the same ranks started by hand (no launcher), to separate ddprun's own cost from
  # the ranks' (loading libtorch, Gloo rendezvous).
  rm -f "$dir"/rank_*.txt
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  h0=$(date +%s%N)
  for r in $(seq 0 $((n - 1))); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
      "$child" allreduce "$dir" >/dev/null 2>&1 &
  done
  wait
  hand=$(grep -h '^done_ns=' "$dir"/rank_*.txt | cut -d= -f2 | sort -n | tail -1)
  echo "run $i: first collective done after $(ms "$last" "$start") ms (by hand, no launcher: $(ms "$hand" "$h0") ms);" \
       "job exit after $(ms "$end" "$start") ms; ddprun alone $(ms "$s1" "$s0") ms"
done
