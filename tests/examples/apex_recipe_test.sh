#!/usr/bin/env bash
# examples/apex_recipe end to end at 2 ranks under ddprun, on a small slice of the training set:
#   1. two epochs straight, bf16 autocast + GradScaler + SyncBatchNorm: both epoch lines, the
#      whole test set validated (10000 samples over the ranks' shards);
#   2. one epoch with --checkpoint-dir, then a second start with --epochs 2 resumes from that
#      checkpoint (model, optimizer, scaler, sampler) and prints the same epoch-2 figures and
#      loss scale as the straight run: the resume is exact.
#   apex_recipe_test.sh DDPRUN APEX_RECIPE
source "$(dirname "$0")/example_test.sh"
ddprun=$1 recipe=$2
run() { timeout 240 "$ddprun" --standalone --nproc-per-node 2 --timeout 60 -- "$recipe" --limit-train 1280 --batch-size 32 "$@" 2>&1; }
# An epoch's figures without its throughput and time, which differ run to run.
figures() { grep -E "epoch $1/2: " <<<"$2" | sed -E 's/^\[rank 0\] //; s/ \| [0-9]+ samples\/s, [0-9.]+ s//'; }

out=$(run --epochs 2) || fail "straight run: exit code $?"
grep -q "world 2, bf16 autocast + GradScaler, SyncBatchNorm" <<<"$out" || fail "no recipe line for a world of 2 in bf16"
straight=$(figures 2 "$out")
[[ $straight =~ ^epoch\ 2/2:\ train\ loss\ .*\(10000\ samples\)\ \|\ scale\ [0-9]+,\ [0-9]+\ skipped$ ]] || fail "no epoch 2 line with 10000 validated samples and the scale"
[[ -n $(figures 1 "$out") ]] || fail "no epoch 1 line"

out=$(run --epochs 1 --checkpoint-dir "$dir") || fail "first half: exit code $?"
[ -f "$dir/checkpoint-00000001.pt" ] || fail "no checkpoint-00000001.pt after epoch 1: $(ls "$dir")"
out=$(run --epochs 2 --checkpoint-dir "$dir") || fail "resumed run: exit code $?"
grep -q "resumed from $dir/checkpoint-00000001.pt at epoch 2" <<<"$out" || fail "no 'resumed from ... at epoch 2'"
grep -q "epoch 1/2" <<<"$out" && fail "epoch 1 trained again after resuming"
resumed=$(figures 2 "$out")
[[ $resumed == "$straight" ]] || fail "the resumed epoch 2 differs from the straight run's:"$'\n'"$straight"$'\n'"vs"$'\n'"$resumed"
echo "straight: $straight"
echo "resumed:  $resumed"
echo "PASS: apex_recipe resumes exactly"
