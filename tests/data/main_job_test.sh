#!/usr/bin/env bash
# The main job (examples/train_fashion_mnist) end to end, one scenario per CTest entry:
#   main_job_test.sh ddprun2 DDPRUN TRAIN   2 ranks under ddprun: the epoch line with the exact
#                                           test-set count and a throughput
#   main_job_test.sh ddprun3 DDPRUN TRAIN   3 ranks: 10000 % 3 != 0, so evaluation pads; the count
#                                           must still be exactly 10000
#   main_job_test.sh progress TRAIN         a progress bar on a terminal (util-linux `script`),
#                                           plain lines when piped
#   main_job_test.sh resume TRAIN           --checkpoint-dir: a second run resumes after epoch 1
# Exit 0: pass; 1: fail (with the reason and the output); 77: skipped (CTest SKIP_RETURN_CODE).
set -u -o pipefail
mode=$1
shift

fail() {
  echo "FAIL: $1"
  printf -- '--- output ---\n%s\n' "${out:-}"
  exit 1
}

# A small slice of the training set keeps each run short; evaluation always uses all 10000.
small=(--limit-train 640 --batch-size 32)
epoch_line='epoch 1/1: train loss [0-9.]+ acc [0-9.]+% \| test loss [0-9.]+ acc [0-9.]+% \(10000 samples\) \| [0-9]+ samples/s'

case $mode in
  ddprun2 | ddprun3)
    ddprun=$1 train=$2
    nproc=${mode#ddprun}
    out=$("$ddprun" --standalone --nproc-per-node "$nproc" -- "$train" --epochs 1 "${small[@]}" 2>&1) ||
      fail "exit code $? from ddprun"
    grep -q "world $nproc (gloo)" <<<"$out" || fail "the job did not run as a world of $nproc"
    # ddprun prefixes rank 0's lines with "[rank 0] ".
    grep -Eq "^\[rank 0\] $epoch_line" <<<"$out" || fail "no epoch line with (10000 samples) and samples/s"
    ;;

  progress)
    train=$1
    if ! command -v script >/dev/null 2>&1; then
      echo "SKIP: util-linux 'script' is not installed, so no terminal can be given to the program"
      exit 77
    fi
    # The bar is redrawn with "\r" and ends at 100% (its last update is never throttled).
    bar='epoch 1/1 \[#{30}\] 100% loss [0-9.]+'
    cmd=$(printf '%q ' "$train" --epochs 1 "${small[@]}")
    out=$(script -qec "$cmd" /dev/null 2>&1) || fail "exit code $? under script"
    grep -Eq "$epoch_line" <<<"$out" || fail "no epoch line on the terminal"
    grep -Eq $'\r'"$bar" <<<"$out" || fail "no progress bar redrawn with a carriage return on a terminal"
    grep -q $'\r\033\\[K' <<<"$out" || fail "the bar is not cleared before the epoch line"
    out=$("$train" --epochs 1 "${small[@]}" 2>&1 | cat) || fail "exit code $? when piped"
    grep -Eq "^$epoch_line" <<<"$out" || fail "no plain epoch line when piped"
    [[ $out == *$'\r'* ]] && fail "carriage returns in piped output"
    grep -Eq "$bar" <<<"$out" && fail "a progress bar in piped output"
    ;;

  resume)
    train=$1
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    out=$("$train" --epochs 1 "${small[@]}" --checkpoint-dir "$dir" 2>&1) || fail "first run: exit code $?"
    grep -q "resumed" <<<"$out" && fail "the first run resumed from an empty directory"
    [ -f "$dir/checkpoint-00000001.pt" ] || fail "no checkpoint-00000001.pt after epoch 1: $(ls "$dir")"
    out=$("$train" --epochs 2 "${small[@]}" --checkpoint-dir "$dir" 2>&1) || fail "second run: exit code $?"
    grep -qx "resumed from $dir/checkpoint-00000001.pt at epoch 2" <<<"$out" || fail "no 'resumed from ... at epoch 2'"
    grep -q "^epoch 1/2" <<<"$out" && fail "epoch 1 trained again after resuming"
    grep -Eq "^epoch 2/2: train loss [0-9.]+ .*\(10000 samples\)" <<<"$out" || fail "epoch 2 not trained"
    [ "$(grep -c '^epoch [0-9]*/2:' <<<"$out")" = 1 ] || fail "expected exactly one epoch line"
    [ -f "$dir/checkpoint-00000002.pt" ] || fail "no checkpoint-00000002.pt after epoch 2: $(ls "$dir")"
    ;;

  *)
    echo "usage: $0 ddprun2|ddprun3 DDPRUN TRAIN | progress TRAIN | resume TRAIN"
    exit 2
    ;;
esac
echo "PASS: $mode"
