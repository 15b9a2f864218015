#!/usr/bin/env bash
# The hierarchical allreduce's other cases, on two simulated hosts (sim_hosts.sh, 10 Gbit/s links);
# two_hosts_test.sh checks its results at 2 hosts x 2 ranks:
#   1. TORCHDDP_HIERARCHICAL=0 on one rank, or InitOptions().hierarchical(false) on all: the world
#      of 2 hosts x 2 ranks is Gloo alone ("gloo"), silently, and DDP's gradients still equal one
#      process's
#   2. a rank killed in the middle of 33.6 MB allreduces (rank 3, host 2), or of DDP training with its
#      buckets in shared memory (rank 1, host 1), ends every other rank within 20 s with an error
#      naming it; one stopped (SIGSTOP, rank 3) ends them after the timeout (4 s here) with an error
#      that blames it first - not rank 1, its partner across the hosts, which only waited for it -
#      and rank 0's stall check says it is stopped; resumed (SIGCONT), it blames itself first too
#   3. uneven hosts, 2 + 1 ranks: the world is Gloo alone ("gloo") with one notice line in the
#      whole job, and all_reduce and DDP's gradients are right
#   4. host 2's /dev/shm (remounted at 16 MiB) holds the groups but neither a grown scratch array
#      nor DDP's buckets: every host keeps its first scratch array and its buckets private (host 1
#      could grow and share its own), saying why once per process for the buckets, and the world's
#      all_reduce (8 MiB in 1 MiB windows too) and DDP's gradients are still right
# Usage: hierarchical_test.sh HOST_RANK. Exit 0: pass; 1: fail (the reason and the output);
# 77: skipped (no root or no namespaces here).
source "$(dirname "$0")/host_test.sh"
program=$1
sim_hosts_up 2 10gbit
port=$((31000 + $$ % 1000 * 2))
notice="the hierarchical allreduce needs the same number, two or more, on every host"

# 1. Switched off: TORCHDDP_HIERARCHICAL=0 on one rank (rank 3) is off for the group; and
#    InitOptions().hierarchical(false) on every rank (host_rank's HOST_RANK_NO_HIERARCHICAL=1).
for how in "JOB_ENV_3=TORCHDDP_HIERARCHICAL=0" "JOB_ENV=HOST_RANK_NO_HIERARCHICAL=1"; do
  port=$((port + 4))
  export "${how?}"
  start_job "2 2" "$port" "$program"
  unset "${how%%=*}"
  await_job 120
  out=$JOB_OUT
  [[ ${JOB_CODES[*]} == "0 0 0 0" ]] || fail "$how: exit codes ${JOB_CODES[*]} (0 0 0 0 expected)"
  for rank in 0 1 2 3; do
    log=$(rank_log "$rank")
    grep -q "^rank=$rank .*world_transport=gloo$" <<<"$log" || fail "$how: rank $rank's world does not report transport gloo"
    grep -q "^rank=$rank ddp_grads=match$" <<<"$log" || fail "$how: rank $rank's DDP gradients differ"
    grep -q "^rank=$rank ddp_buckets=private$" <<<"$log" || fail "$how: rank $rank's DDP gradients lie in shared memory"
  done
  ! grep -q "$notice" <<<"$out" || fail "$how printed the uneven-hosts notice"
  echo "$how: 2 hosts x 2 ranks on gloo, no notice, DDP gradients match one process's"
done

# 2. A killed rank, on host 2 (all_reduce) and on host 1 (DDP training); a stopped one on host 2.
for how in kill:3 kill:1 stop:3; do
  signal=${how%:*} victim=${how#*:} done_to=killed
  [[ $signal == stop ]] && done_to=stopped
  port=$((port + 4))
  what=$([[ $victim == 3 ]] && echo "" || echo ddp)
  [[ $signal == stop ]] && export JOB_ENV=HOST_RANK_TIMEOUT_S=4
  start_job "2 2" "$port" "$program" forever ${what:+"$what"}
  unset JOB_ENV
  for _ in $(seq 300); do  # bounded: 60 s for every rank to be in its loop
    [[ $(cat "$SIM_HOSTS_DIR"/logs/rank_*.txt | grep -c " ready ") == 4 ]] && break
    sleep 0.2
  done
  out=$(cat "$SIM_HOSTS_DIR"/logs/rank_*.txt)
  [[ $(grep -c " ready transport=gloo+shm hierarchical (2 hosts x 2)$" <<<"$out") == 4 ]] ||
    { await_job 1; fail "not every rank of 2 hosts x 2 started all-reducing hierarchically"; }
  sleep 0.$((RANDOM % 9 + 1))
  # A stopped rank is told apart from a gone one by its heartbeat's pid: let it send one first (on
  # a loaded machine its first could come after the 0.1-0.9 s above: "never sent a heartbeat").
  [[ $signal == stop ]] && sleep 2
  if [[ $signal == kill ]]; then
    { kill -9 "${JOB_PIDS[$victim]}" && wait "${JOB_PIDS[$victim]}"; } 2>/dev/null  # no "Killed" notice
  else
    kill -STOP "${JOB_PIDS[$victim]}"
  fi
  killed_at=$SECONDS
  if [[ $signal == stop ]]; then  # bounded: the others end within 24 s; then the victim is resumed
    for _ in $(seq 120); do
      [[ $(cat "$SIM_HOSTS_DIR"/logs/rank_*.txt | grep -c "^rank=[0-9]* error=") == 3 ]] && break
      sleep 0.2
    done
    kill -CONT "${JOB_PIDS[$victim]}"  # it ends by itself: its own error blames itself first
  fi
  await_job 20
  out=$JOB_OUT
  elapsed=$((SECONDS - killed_at))
  for rank in 0 1 2 3; do
    [[ $rank == "$victim" && $signal == kill ]] && continue
    [[ ${JOB_CODES[$rank]} == 0 ]] ||
      fail "rank $rank did not end within 20 s of rank $victim (host ${JOB_HOST[$victim]}) being $done_to: ${JOB_CODES[$rank]}"
    error=$(grep "^rank=$rank error=" <<<"$(rank_log "$rank")")
    grep -q "rank $victim[^0-9]" <<<"$error" || fail "rank $rank's error does not name $done_to rank $victim"
    if [[ $signal == stop ]]; then
      grep -q "Cause: rank $victim (pid [0-9]*, stopped) did not arrive" <<<"$error" ||
        fail "rank $rank's error does not blame stopped rank $victim first"
    fi
    echo "  rank $rank: $(cut -c1-300 <<<"$error")"
  done
  if [[ $signal == stop ]]; then
    grep -q "Stall check: rank $victim stopped (no heartbeat for 2.5 s: its process, pid [0-9]*, is stopped" <<<"$(rank_log 0)" ||
      fail "rank 0's stall check does not say rank $victim is stopped: $(grep -o 'Stall check: .*' <<<"$(rank_log 0)")"
  fi
  echo "rank $victim (host ${JOB_HOST[$victim]}) $done_to in ${what:-all_reduce} loop: the other 3 ranks ended within ${elapsed} s naming it"
done

# 3. Uneven hosts: 2 + 1 ranks.
port=$((port + 4))
start_job "2 1" "$port" "$program"
await_job 120
out=$JOB_OUT
[[ ${JOB_CODES[*]} == "0 0 0" ]] || fail "2 + 1 ranks: exit codes ${JOB_CODES[*]} (0 0 0 expected)"
for rank in 0 1 2; do
  log=$(rank_log "$rank")
  grep -q "^rank=$rank .*world_transport=gloo$" <<<"$log" || fail "2 + 1 ranks: rank $rank's world does not report gloo"
  grep -q "^rank=$rank world_sum=6 world_max=2$" <<<"$log" || fail "2 + 1 ranks: rank $rank's world all_reduce is wrong"
  grep -q "^rank=$rank ddp_grads=match$" <<<"$log" || fail "2 + 1 ranks: rank $rank's DDP gradients differ"
done
[[ $(grep -c "$notice" <<<"$out") == 1 ]] || fail "2 + 1 ranks: the notice is not printed exactly once in the job"
grep -q "run on 2 hosts (2+1 ranks)" <<<"$(rank_log 0)" || fail "2 + 1 ranks: rank 0 does not print the notice"
echo "2 + 1 ranks: gloo, one notice ($(grep "$notice" <<<"$out")), all_reduce and DDP gradients right"

# 4. /dev/shm too small on one host for what would grow there. Per rank, the job keeps: the world's
#    3 MiB (the Communicator's buffers, 1 MiB, and the first scratch array, 2 MiB), the host group's
#    2 MiB (its buffers and its mailbox for point to point), and DDP's own group's 3 MiB: 16 MiB on
#    the host. Of 20 MiB, that leaves no room for the world's scratch array to grow to 8 MiB per
#    rank (the 8 MiB all_reduce: it stays at two windows of 1 MiB on both hosts, which must agree
#    or the job aborts), nor for DDP's buckets (4.8 MiB per rank of host_rank's model).
on_host 2 mount -o remount,size=20m /dev/shm || fail "could not shrink host 2's /dev/shm"
port=$((port + 4))
start_job "2 2" "$port" "$program"
await_job 120
out=$JOB_OUT
on_host 2 mount -o remount,size=256m /dev/shm
[[ ${JOB_CODES[*]} == "0 0 0 0" ]] || fail "/dev/shm of 20 MiB on host 2: exit codes ${JOB_CODES[*]} (0 0 0 0 expected)"
for rank in 0 1 2 3; do
  log=$(rank_log "$rank")
  grep -q "^rank=$rank .*world_transport=gloo+shm hierarchical (2 hosts x 2)$" <<<"$log" ||
    fail "/dev/shm of 20 MiB on host 2: rank $rank's world is not hierarchical"
  grep -q "^rank=$rank world_sum=10 world_max=3$" <<<"$log" || fail "/dev/shm of 20 MiB on host 2: rank $rank's all_reduce is wrong"
  grep -q "^rank=$rank flat_transport=gloo flat_match=yes$" <<<"$log" ||
    fail "/dev/shm of 20 MiB on host 2: rank $rank's 8 MiB all_reduce (in windows of 1 MiB) differs from Gloo alone's"
  grep -q "^rank=$rank ddp_grads=match$" <<<"$log" || fail "/dev/shm of 20 MiB on host 2: rank $rank's DDP gradients differ"
  grep -q "^rank=$rank ddp_buckets=private$" <<<"$log" ||
    fail "/dev/shm of 20 MiB on host 2: rank $rank's DDP gradients lie in shared memory (the hosts did not agree)"
  [[ $(grep -c "DDP's gradient buckets stay in private memory" <<<"$log") == 1 ]] ||
    fail "/dev/shm of 20 MiB on host 2: rank $rank does not say once why its buckets stay private"
done
grep -q "private memory (a rank on another host could not share memory)" <<<"$(rank_log 0)" ||
  fail "/dev/shm of 20 MiB on host 2: rank 0 (host 1) does not say that another host could not share"
echo "/dev/shm of 20 MiB on host 2: buckets private on both hosts ($(grep "private memory" <<<"$(rank_log 2)" | cut -c1-200)...), all_reduce and DDP gradients right"
