#!/usr/bin/env bash
# The README's quick start (examples/quickstart), for each port (ddp.cpp: DDP's model wrapper;
# optimizer.cpp: a DistributedOptimizer, no wrapper):
#   1. the README shows exactly `diff single_process.cpp <port>` (its block between the port's
#      markers: quickstart-diff, quickstart-optimizer-diff), and the port changes or adds as many
#      lines as the README says;
#   2. untrained (0 epochs), the port under 2 and 3 ranks evaluates the very model the single
#      process does (rank 0's weights, seeded alike) on the whole test set, each sample once: the
#      same correct count and, up to summation order, the same loss. PyTorch's padding would count
#      2 samples twice at 3 ranks (10000 = 3 x 3334 - 2) and move the loss;
#   3. one epoch at 2 ranks trains (accuracy above 70 %), printed by rank 0 only.
#   quickstart_test.sh SOURCE_DIR DDPRUN QUICKSTART_SINGLE QUICKSTART_DDP QUICKSTART_OPTIMIZER
set -u -o pipefail
src=$1 ddprun=$2 single=$3
out=""
fail() {
  echo "FAIL: $1"
  printf -- '--- output ---\n%s\n' "$out"
  exit 1
}
figures() { grep -oE 'test loss [0-9.]+, accuracy [0-9]+/[0-9]+' <<<"$1"; }
out=$(timeout 120 "$single" 0 2>&1) || fail "single process: exit code $?"
reference=$(figures "$out")
[[ $reference =~ accuracy\ [0-9]+/10000$ ]] || fail "single process printed no accuracy over 10000 samples"

check_port() {  # check_port <source file> <README marker> <binary>
local file=$1 marker=$2 port=$3
echo "== $file"
# 1. The README's diff is the real one, and its count is the real count.
actual=$(cd "$src/examples/quickstart" && diff single_process.cpp "$file")
shown=$(sed -n "/<!-- $marker -->/,/<!-- \/$marker -->/p" "$src/README.md" | sed '1,2d;$d' | sed '$d')
[[ $shown == "$actual" ]] || { out=$(diff <(echo "$shown") <(echo "$actual")); fail "README's $marker block is not diff single_process.cpp $file"; }
changed=$(grep -c '^>' <<<"$actual")
grep -q "the port adds or changes $changed lines" "$src/README.md" || fail "README does not say 'the port adds or changes $changed lines'"
[ "$changed" -le 12 ] || fail "$file changes $changed lines, more than 12"
# The count by the other common measure (removed and added lines of diff -u), which the README gives too.
unified=$(cd "$src/examples/quickstart" && diff -u single_process.cpp "$file" | grep -c '^[-+][^-+]')
grep -q "$unified lines by \`diff -u single_process.cpp ddp.cpp" "$src/README.md" ||
  fail "README does not say '$unified lines by \`diff -u single_process.cpp ddp.cpp ...\`'"
echo "diff: $changed lines added or changed ($unified by diff -u)"

# 2. Exact sharded evaluation of the untrained model.
for world in 2 3; do
  out=$(timeout 180 "$ddprun" --standalone --nproc-per-node $world --timeout 60 -- "$port" 0 2>&1) || fail "port at $world ranks: exit code $?"
  got=$(figures "$out")
  [[ ${got#*accuracy } == "${reference#*accuracy }" ]] || fail "port at $world ranks: '$got', single process: '$reference'"
  awk -v a="$(cut -d' ' -f3 <<<"${got%,*}")" -v b="$(cut -d' ' -f3 <<<"${reference%,*}")" \
    'BEGIN { d = a - b; exit !(d < 1.5e-4 && d > -1.5e-4) }' || fail "port at $world ranks: '$got', single process: '$reference'"
  echo "untrained, $world ranks: $got (single process: $reference)"
done

# 3. It trains, and only rank 0 prints.
out=$(timeout 240 "$ddprun" --standalone --nproc-per-node 2 --timeout 60 -- "$port" 1 2>&1) || fail "1 epoch at 2 ranks: exit code $?"
[ "$(grep -c 'after 1 epochs: ' <<<"$out")" = 1 ] || fail "expected one result line, from rank 0"
grep -q '^\[rank 0\] after 1 epochs: ' <<<"$out" || fail "the result line is not rank 0's"
correct=$(grep -oE 'accuracy [0-9]+/10000' <<<"$out" | grep -oE '[0-9]+/' | tr -d /)
[ "${correct:-0}" -gt 7000 ] || fail "accuracy $correct/10000 after 1 epoch"
echo "1 epoch, 2 ranks: $(figures "$out")"
}

check_port ddp.cpp quickstart-diff "$4"
check_port optimizer.cpp quickstart-optimizer-diff "$5"
echo "PASS: quickstart"
