#!/usr/bin/env bash
# ddprun's console on a real pseudo-terminal: util-linux script(1) runs ddprun on a pty and logs
# every chunk ddprun wrote with the time script read it (--log-timing), so the test sees *when*
# each progress redraw reached the terminal. The ranks run progress_child: 5 "\r" redraws
# ("step K/5 rank=R"), 300 ms apart, through std::cout and printf, never flushed, then a newline and
# "done rank=R". One CTest entry per mode:
#   progress_test.sh live DDPRUN CHILD     2 ranks: each rank's redraws 1..4 reach the terminal as
#       "\r[rank R] step K/5 rank=R" (prefix kept after the carriage return) one by one while the
#       rank runs: the first >= 0.6 s before its "done" line and >= 0.45 s before its fourth
#   progress_test.sh opt_out DDPRUN CHILD  --keep-output-buffering: the ranks' stdout is
#       block-buffered again, so no intermediate redraw arrives, and the output is still complete
#   progress_test.sh piped DDPRUN CHILD    ddprun's stdout a pipe: whole lines only, no "\r", each
#       rank's final state and "done" line
# Exit 0: pass; 1: fail (with the reason and the output); 77: skipped (CTest SKIP_RETURN_CODE).
set -u -o pipefail
mode=$1 ddprun=$2 child=$3

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ddprun_progress.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "FAIL: $1"
  printf -- '--- output (cat -A) ---\n'
  cat -A "$tmp/body" 2>/dev/null
  exit 1
}
skip() {
  echo "SKIP: $1"
  exit 77
}

# The ranks' buffering is ddprun's choice here, not the caller's.
run_env=(env -u _STDBUF_O -u LD_PRELOAD OMP_NUM_THREADS=1)
job=("$ddprun" --nproc-per-node 2 --standalone --grace-period 1)

# Runs "$@" on a pseudo-terminal, bounded: $tmp/body is what it wrote to the terminal, $tmp/timing
# one "DELAY BYTES" line per chunk (script's classic timing format); sets code.
on_terminal() {
  local command
  command=$(printf '%q ' "$@")
  timeout -k 5 40 script -q -e -E never --log-out "$tmp/out" --log-timing "$tmp/timing" -c "$command" \
    </dev/null >/dev/null 2>"$tmp/script.err"
  code=$?
  # --log-out starts with a "Script started ..." line that the timing file does not count.
  tail -n +2 "$tmp/out" >"$tmp/body"
}

# Seconds from the start until the terminal had received all of the text $1 (empty if it never did).
arrival() {
  local start end
  start=$(grep -a -b -o -F -- "$1" "$tmp/body" | head -n 1 | cut -d: -f1)
  [[ -n $start ]] || return 0
  end=$((start + ${#1}))
  awk -v end="$end" '{ t += $1; got += $2 } got >= end { printf "%.3f\n", t; exit }' "$tmp/timing"
}
at_least() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a >= b) }'; }
expect_final_lines() {
  local r
  for r in 0 1; do
    grep -a -q -F "[rank $r] step 5/5 rank=$r" "$tmp/body" || fail "rank $r: no final state 'step 5/5'"
    grep -a -q -F "[rank $r] done rank=$r" "$tmp/body" || fail "rank $r: no 'done' line"
  done
}

command -v script >/dev/null || skip "script (util-linux) is not installed"
if [[ $mode != piped ]]; then
  script --help 2>&1 | grep -q -- --log-timing || skip "this script(1) has no --log-timing (util-linux < 2.35)"
  on_terminal true
  [[ $code == 0 ]] || skip "script cannot run a command on a pseudo-terminal here: $(cat "$tmp/script.err")"
fi

case $mode in
live)
  on_terminal "${run_env[@]}" "${job[@]}" -- "$child"
  [[ $code == 0 ]] || fail "ddprun exited with $code"
  expect_final_lines
  for r in 0 1; do
    declare -a when=()
    for k in 1 2 3 4; do
      when[$k]=$(arrival $'\r'"[rank $r] step $k/5 rank=$r")
      [[ -n ${when[$k]} ]] || fail "rank $r: redraw 'step $k/5' never reached the terminal as \\r[rank $r] ..."
    done
    done_at=$(arrival "[rank $r] done rank=$r")
    echo "rank $r: redraws 1..4 at ${when[1]} ${when[2]} ${when[3]} ${when[4]} s, done at $done_at s"
    at_least "$done_at" "$(awk -v t="${when[1]}" 'BEGIN { print t + 0.6 }')" ||
      fail "rank $r: the first redraw arrived at ${when[1]} s, too close to the end ($done_at s): held back until exit"
    at_least "${when[4]}" "$(awk -v t="${when[1]}" 'BEGIN { print t + 0.45 }')" ||
      fail "rank $r: redraws 1..4 arrived in one burst (${when[1]} .. ${when[4]} s), not as printed"
  done
  ;;
opt_out)
  on_terminal "${run_env[@]}" "${job[@]}" --keep-output-buffering -- "$child"
  [[ $code == 0 ]] || fail "ddprun --keep-output-buffering exited with $code"
  expect_final_lines
  for r in 0 1; do
    for k in 1 2 3 4; do
      [[ -z $(arrival "[rank $r] step $k/5") ]] || fail "rank $r: redraw $k arrived although stdout was block-buffered"
    done
  done
  ;;
piped)
  timeout -k 5 40 "${run_env[@]}" "${job[@]}" -- "$child" >"$tmp/body" 2>&1
  code=$?
  [[ $code == 0 ]] || fail "ddprun exited with $code"
  expect_final_lines
  grep -a -q $'\r' "$tmp/body" && fail "a carriage return reached piped output"
  grep -a -q -F "step 1/5" "$tmp/body" && fail "an intermediate redraw reached piped output as a line"
  ;;
*)
  echo "usage: progress_test.sh live|opt_out|piped DDPRUN CHILD"
  exit 2
  ;;
esac
echo "PASS: $mode"
