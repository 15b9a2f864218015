#!/usr/bin/env bash
# The ported programs of examples/ports (issue 43), each at 2 ranks under ddprun:
#   ports_test.sh counts SOURCE_DIR
#       each port's changed lines against its kept original, by the issue's measure
#       (diff -u original port | grep -c '^[-+][^-+]'), within the port's budget;
#   ports_test.sh mnist DDPRUN PORT_MNIST_DDP PORT_MNIST_OPTIMIZER
#       each mnist port trains its first epoch on Fashion-MNIST (MNIST's format, read by LibTorch's
#       own MNIST reader from ./data) and both ranks print the same test line (one model);
#   ports_test.sh dcgan DDPRUN PORT_DCGAN_SMALL
#   ports_test.sh resnet DDPRUN PORT_RESNET_SMALL
#       a straight run, a run stopped (SIGTERM to ddprun) once a checkpoint is on disk, and a second
#       start in its folder that resumes from it: every line the resumed run prints after the
#       resume is, rank by rank, the straight run's line (the same figures to the last digit).
# The *_SMALL programs are the ports with a few constants made small (examples/ports/CMakeLists.txt).
source "$(dirname "$0")/example_test.sh"
mode=$1
shift

# start DIR LOG PROGRAM ARGS...: the program at 2 ranks under ddprun, in DIR, in the background.
start() {
  local wd=$1 log=$2
  shift 2
  (cd "$wd" && exec timeout 300 "$ddprun" --standalone --nproc-per-node 2 --timeout 60 -- "$@") >"$log" 2>&1 &
  pid=$!
}
# until_both REGEX LOG: waits until both ranks printed a line matching REGEX (after ddprun's
# "[rank N] " prefix); 1 if the job ended first.
until_both() {
  while ! { grep -qE "^\[rank 0\] $1" "$2" && grep -qE "^\[rank 1\] $1" "$2"; }; do
    kill -0 "$pid" 2>/dev/null || { grep -qE "^\[rank 0\] $1" "$2" && grep -qE "^\[rank 1\] $1" "$2"; return; }
    sleep 0.1
  done
}
stop() { kill -TERM "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; }
finish() { wait "$pid"; }  # the job's exit code
# same_after_resume STRAIGHT_LOG RESUMED_LOG REGEX: rank by rank, the resumed run's lines matching
# REGEX are a run of the straight run's lines of that kind (at least 3 of them, the first being
# the line after the resume point), in order and identical.
same_after_resume() {
  local r straight resumed first n
  for r in 0 1; do
    straight=$(grep -E "^\[rank $r\] ($3)" "$1")
    resumed=$(grep -E "^\[rank $r\] ($3)" "$2")
    n=$(grep -c "" <<<"$resumed")
    [ -n "$resumed" ] && [ "$n" -ge 3 ] || { out=$(cat "$2"); fail "rank $r printed $n lines after resuming, expected 3 or more"; }
    first=$(head -1 <<<"$resumed")
    grep -qxF -- "$first" <<<"$straight" || { out=$(cat "$1"); fail "rank $r's first line after resuming is not in the straight run: '$first'"; }
    # The straight run's lines from that one on, and the resumed run's, as many as both printed
    # (each run is stopped a moment after the line waited for: either may have printed one more).
    straight=$(awk -v first="$first" '$0 == first { on = 1 } on' <<<"$straight")
    n=$(( n < $(grep -c "" <<<"$straight") ? n : $(grep -c "" <<<"$straight") ))
    [ "$n" -ge 3 ] || { out=$(cat "$1"); fail "rank $r: only $n lines of the straight run after '$first'"; }
    straight=$(head -n "$n" <<<"$straight")
    resumed=$(head -n "$n" <<<"$resumed")
    [[ $resumed == "$straight" ]] ||
      { out=$(diff <(echo "$straight") <(echo "$resumed")); fail "rank $r: the resumed run differs from the straight run (< straight, > resumed)"; }
    echo "rank $r: $n lines after the resume as the straight run's, from '$first' to '$(tail -1 <<<"$resumed")'"
  done
}
# Fashion-MNIST's training (and test) files, unpacked, in MNIST's names: LibTorch's reader wants them so.
mnist_data() {
  mkdir -p "$1"
  local f
  for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    gunzip -c "/usr/share/datasets/fashion-mnist/$f.gz" >"$1/$f" || fail "cannot unpack /usr/share/datasets/fashion-mnist/$f.gz (dataset-fashion-mnist)"
  done
}

case $mode in
counts)
  ports=$1/examples/ports
  # port, original, budget: issue 43's limits (examples/ports/README.md says where the lines go).
  while read -r port original budget; do
    n=$(diff -u "$ports/$original" "$ports/$port" | grep -c '^[-+][^-+]')
    echo "$port: $n changed lines (budget $budget)"
    [ "$n" -le "$budget" ] || fail "$port changes $n lines against $original, more than its budget of $budget"
  done <<'EOF'
mnist/mnist_ddp.cpp mnist/original/mnist.cpp 10
mnist/mnist_optimizer.cpp mnist/original/mnist.cpp 6
dcgan/dcgan.cpp dcgan/original/dcgan.cpp 30
resnet/main.cpp resnet/original/src/main.cpp 14
EOF
  # The ports build the originals' other files as they are (resnet's dataset, model, transforms).
  for f in "$ports"/resnet/original/src/*.cpp "$ports"/resnet/original/include/*.h; do
    grep -q "Copyright 2020-present pytorch-cpp Authors" "$f" || fail "$f lost its copyright line"
  done
  echo "PASS: ports within their line budgets"
  ;;

mnist)
  ddprun=$1
  mnist_data "$dir/data"
  figures=()
  for port in "$2" "$3"; do
    start "$dir" "$dir/log" "$port"
    until_both "Test set: " "$dir/log" || { out=$(cat "$dir/log"); fail "${port##*/}: no test line from both ranks"; }
    stop
    out=$(cat "$dir/log")
    loss=$(grep -oE '^\[rank 0\] Train Epoch: 1 \[ *[0-9]+/60000\] Loss: [0-9.]+' <<<"$out" | tail -1 | grep -oE '[0-9.]+$')
    [ -n "$loss" ] || fail "${port##*/}: no training line of epoch 1 from rank 0"
    awk -v l="$loss" 'BEGIN { exit !(l < 1.8) }' || fail "${port##*/}: loss $loss at the end of epoch 1 (2.30 untrained)"
    test0=$(grep -E '^\[rank 0\] Test set: ' <<<"$out" | head -1 | sed 's/^\[rank 0\] //')
    test1=$(grep -E '^\[rank 1\] Test set: ' <<<"$out" | head -1 | sed 's/^\[rank 1\] //')
    [[ $test0 == "$test1" ]] || fail "${port##*/}: the ranks evaluated different models: '$test0' vs '$test1'"
    accuracy=${test0##*Accuracy: }
    awk -v a="$accuracy" 'BEGIN { exit !(a > 0.6) }' || fail "${port##*/}: test accuracy $accuracy after 1 epoch"
    echo "${port##*/}: epoch 1 ends at loss $loss; both ranks: $test0"
    figures+=("$test0")
  done
  # The same training by either path: DDP's wrapper and the DistributedOptimizer average alike.
  [[ ${figures[0]} == "${figures[1]}" ]] || fail "the DDP port and the DistributedOptimizer port differ: '${figures[0]}' vs '${figures[1]}'"
  echo "PASS: mnist ports train"
  ;;

dcgan)
  ddprun=$1 dcgan=$2
  mkdir -p "$dir/data" "$dir/straight" "$dir/resumed"
  mnist_data "$dir/data"
  ln -s ../data "$dir/straight/data"
  ln -s ../data "$dir/resumed/data"
  # The port's lines: "[ 1/ 1][ 40/938] D_loss: ... | G_loss: ..." and "-> checkpoint N".
  lines='\[ 1/ 1\]\[ *[0-9]+/938\] D_loss|-> checkpoint'
  start "$dir/straight" "$dir/straight.log" "$dcgan" --epochs 1
  until_both '\[ 1/ 1\]\[ 40/938\]' "$dir/straight.log" || { out=$(cat "$dir/straight.log"); fail "straight run: no line of batch 40"; }
  stop
  # Both ranks train: every loss printed is a finite number.
  grep -qiE 'D_loss: .*(nan|inf)' "$dir/straight.log" && { out=$(cat "$dir/straight.log"); fail "straight run: a loss is not finite"; }
  # Stopped once its first checkpoint (batch 10) is on disk.
  start "$dir/resumed" "$dir/first.log" "$dcgan" --epochs 1
  while [ ! -f "$dir/resumed/dcgan-checkpoint.pt" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  stop
  [ -f "$dir/resumed/dcgan-checkpoint.pt" ] || { out=$(cat "$dir/first.log"); fail "first run: no dcgan-checkpoint.pt"; }
  grep -qE '\[ 1/ 1\]\[ 40/938\]' "$dir/first.log" && { out=$(cat "$dir/first.log"); fail "first run was not stopped before batch 40"; }
  start "$dir/resumed" "$dir/resumed.log" "$dcgan" --epochs 1
  until_both '\[ 1/ 1\]\[ 40/938\]' "$dir/resumed.log" || { out=$(cat "$dir/resumed.log"); fail "resumed run: no line of batch 40"; }
  stop
  out=$(cat "$dir/resumed.log")
  grep -qE "resumed from dcgan-checkpoint.pt" <<<"$out" || fail "no 'resumed from dcgan-checkpoint.pt' line"
  grep -qE '\[ 1/ 1\]\[ 10/938\]' <<<"$out" && fail "the resumed run started the epoch over"
  same_after_resume "$dir/straight.log" "$dir/resumed.log" "$lines"
  echo "PASS: dcgan port resumes exactly"
  ;;

resnet)
  ddprun=$1 resnet=$2
  # The port reads ../../../../data/cifar10/ (CIFAR-10's binary files): a synthetic set in that
  # format, 500 training and 100 test records, each class a colour with deterministic noise.
  mkdir -p "$dir/data/cifar10" "$dir/s/1/2/3" "$dir/r/1/2/3"
  python3 - "$dir/data/cifar10" <<'EOF' || fail "could not write the synthetic CIFAR-10 files"
import sys
x = 12345
def write(path, n, salt):
    global x
    out = bytearray()
    for i in range(n):
        label = (i * 7 + salt) % 10
        out.append(label)
        for c in range(3):
            base = (label * 23 + c * 61) % 200
            for _ in range(1024):
                x = (x * 1103515245 + 12345) & 0x7fffffff
                out.append(base + (x >> 16) % 56)
    open(path, "wb").write(out)
for k in range(1, 6):
    write(f"{sys.argv[1]}/data_batch_{k}.bin", 100, k)
write(f"{sys.argv[1]}/test_batch.bin", 100, 0)
EOF
  lines='Epoch \[[0-9]+/4\], Trainset|Training finished|Testing|Testset'
  start "$dir/s/1/2/3" "$dir/straight.log" "$resnet"
  finish || { out=$(cat "$dir/straight.log"); fail "straight run: exit code $?"; }
  out=$(cat "$dir/straight.log")
  first=$(grep -oE '^\[rank 0\] Epoch \[1/4\], Trainset - Loss: [0-9.]+' <<<"$out" | grep -oE '[0-9.]+$')
  last=$(grep -oE '^\[rank 0\] Epoch \[4/4\], Trainset - Loss: [0-9.]+' <<<"$out" | grep -oE '[0-9.]+$')
  [ -n "$first" ] && [ -n "$last" ] || fail "straight run: no epoch 1 and 4 lines from rank 0"
  awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || fail "straight run: loss $first in epoch 1, $last in epoch 4"
  # Stopped once the checkpoint of epoch 1 is on disk.
  start "$dir/r/1/2/3" "$dir/first.log" "$resnet"
  while [ ! -f "$dir/r/1/2/3/resnet-checkpoint.pt" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  stop
  grep -q "Training finished" "$dir/first.log" && { out=$(cat "$dir/first.log"); fail "first run was not stopped before the end"; }
  start "$dir/r/1/2/3" "$dir/resumed.log" "$resnet"
  finish || { out=$(cat "$dir/resumed.log"); fail "resumed run: exit code $?"; }
  out=$(cat "$dir/resumed.log")
  grep -qE "resumed from resnet-checkpoint.pt" <<<"$out" || fail "no 'resumed from resnet-checkpoint.pt' line"
  grep -qE 'Epoch \[1/4\]' <<<"$out" && fail "the resumed run trained epoch 1 again"
  same_after_resume "$dir/straight.log" "$dir/resumed.log" "$lines"
  echo "straight run, rank 0: epoch 1 loss $first, epoch 4 loss $last; $(grep -E '^\[rank 0\] Testset' "$dir/straight.log")"
  echo "PASS: resnet port resumes exactly"
  ;;
*)
  fail "unknown mode '$mode'"
  ;;
esac
