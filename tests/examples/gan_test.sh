#!/usr/bin/env bash
# examples/gan at 2 ranks under ddprun (issue 27):
#   1. four epochs straight;
#   2. a fresh --checkpoint-dir says it starts from scratch; two epochs, then a second start with
#      --epochs 4 resumes from checkpoint 2 (both models, both optimizers, every rank's RNG) and
#      prints epochs 3 and 4 and the generated points exactly as the straight run: the same
#      operations on the same values, so the mean losses and the points' mean radius are bitwise
#      equal (printed with all 17 digits of a double);
#   3. ddprun --max-restarts 1 with rank 1 killed (SIGKILL) after checkpoint 1: the job restarts,
#      resumes from checkpoint 1 and ends with the straight run's figures.
#   gan_test.sh DDPRUN GAN
source "$(dirname "$0")/example_test.sh"
ddprun=$1 gan=$2
run() { timeout 240 "$ddprun" --standalone --nproc-per-node 2 --timeout 60 "$@" 2>&1; }
# The figures of epochs 3 and 4 and of the generated points, without ddprun's prefix.
figures() { grep -E "epoch [34]/4: |generated points" <<<"$1" | sed -E 's/^\[rank 0\] //'; }

out=$(run -- "$gan" --epochs 4) || fail "straight run: exit code $?"
straight=$(figures "$out")
[[ $(grep -c "" <<<"$straight") == 3 ]] || fail "expected epochs 3 and 4 and the generated points in the straight run"

out=$(run -- "$gan" --epochs 2 --checkpoint-dir "$dir/a") || fail "first half: exit code $?"
grep -qx "\[rank 0\] no checkpoint in $dir/a yet: starting from scratch" <<<"$out" || fail "no fresh-start notice"
out=$(run -- "$gan" --epochs 4 --checkpoint-dir "$dir/a") || fail "resumed run: exit code $?"
grep -qx "\[rank 0\] resumed from $dir/a/checkpoint-00000002.pt at epoch 3" <<<"$out" || fail "no 'resumed from ... at epoch 3'"
grep -q "epoch [12]/4" <<<"$out" && fail "epochs 1-2 trained again after resuming"
resumed=$(figures "$out")
[[ $resumed == "$straight" ]] || fail "the resumed run differs from the straight run:"$'\n'"$straight"$'\n'"vs"$'\n'"$resumed"

# Rank 1's first attempt stops after epoch 1 (its checkpoint written) and is killed; rank 0 is left
# waiting in epoch 2 until ddprun restarts both.
script='if [ "$DDPRUN_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then "$0" --epochs 1 "$@"; kill -KILL $$; fi; exec "$0" --epochs 4 "$@"'
out=$(run --max-restarts 1 -- bash -c "$script" "$gan" --checkpoint-dir "$dir/b") || fail "--max-restarts run: exit code $?"
grep -Eq "killed by signal|SIGKILL|signal 9" <<<"$out" || fail "rank 1 was not seen killed"
grep -qx "\[rank 0\] resumed from $dir/b/checkpoint-00000001.pt at epoch 2" <<<"$out" || fail "the restart did not resume from checkpoint 1"
restarted=$(figures "$out")
[[ $restarted == "$straight" ]] || fail "the restarted run differs from the straight run:"$'\n'"$straight"$'\n'"vs"$'\n'"$restarted"
echo "straight and resumed:"$'\n'"$straight"
echo "PASS: gan resumes exactly, also after a rank is killed under --max-restarts"
