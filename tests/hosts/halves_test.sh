#!/usr/bin/env bash
# The reduce-scatter and all-gather into one tensor across simulated hosts (sim_hosts.sh, links
# shaped to 10 Gbit/s), 2 hosts x 2 ranks (host_rank halves):
#   1. every result is right, with the ranks numbered host by host and interleaved, and at 3 hosts
#      x 2 ranks: reduce_scatter_tensor of float32, float64, bfloat16, float16, int32,
#      int64 and uint8 with SUM, MAX, MIN, PRODUCT and (floating) AVG, and all_gather_into_tensor of
#      each, at 1, 13, just over one slice crossing the hosts and over three slices (sizes no slice
#      divides), in place too - against the results computed on each rank from every rank's input
#   2. they took the hierarchical path, not Gloo's: during a reduce-scatter of 8 MiB per rank, each
#      host's link sent at most 0.6 of the input (the hierarchical one sends half: each rank sends
#      its host's sums of the other host's pieces, a quarter of the input), less than a Gloo-alone
#      group's; the same for an all-gather into 8 MiB (at 3 hosts, at most 0.72: it sends 2/3, about
#      what Gloo's ring sends there, so not more than 1.03x Gloo's)
#   3. host 1's ranks in a reduce-scatter while host 2's are in an all-gather: named on every rank;
#      in an allreduce while host 2's reduce-scatter: every rank points to DETAIL, which names both
#   4. a rank killed (on host 2, then on host 1) among reduce-scatters and all-gathers: the others
#      end within 20 s naming it
# Usage: halves_test.sh HOST_RANK. Exit 0: pass; 1: fail (the reason and the output);
# 77: skipped (no root or no namespaces here).
source "$(dirname "$0")/host_test.sh"
program=$1
sim_hosts_up 3 10gbit

port=$((35000 + $$ % 1000 * 2))
# 1 and 2, with the ranks numbered host by host, then interleaved (JOB_ENV_<R> renumbers them:
# host 1 runs ranks 0 and 2, host 2 ranks 1 and 3), then on 3 hosts x 2 (each host sends 2/3 of
# the input there). Log i is the i-th process started.
for layout in "host by host" interleaved "3 hosts"; do
  hosts="2 2" percent=60 processes="0 1 2 3"
  [[ $layout == "3 hosts" ]] && hosts="2 2 2" percent=72 processes="0 1 2 3 4 5"
  [[ $layout == interleaved ]] && export JOB_ENV_1=RANK=2 JOB_ENV_2=RANK=1
  start_job "$hosts" "$port" "$program" halves
  unset JOB_ENV_1 JOB_ENV_2
  port=$((port + 4))
  await_job 300
  out=$JOB_OUT
  [[ ${JOB_CODES[*]} == "${processes//[1-9]/0}" ]] || fail "$layout: the ranks' exit codes are ${JOB_CODES[*]} (all 0 expected)"
  for i in $processes; do
    log=$(rank_log "$i")
    rank=$(grep -o "^rank=[0-9]* host=simhost${JOB_HOST[$i]} " <<<"$log" | grep -o "[0-9]" | head -1) ||
      fail "$layout: process $i does not say its rank and host simhost${JOB_HOST[$i]}"
    grep -q "^rank=$rank .*world_transport=gloo+shm hierarchical ($(wc -w <<<"$hosts") hosts x 2)$" <<<"$log" ||
      fail "$layout: rank $rank's world is not hierarchical"
    grep -q "^rank=$rank halves_checked=[1-9][0-9]* halves_wrong=0$" <<<"$log" || fail "$layout: rank $rank has wrong results"
    line=$(grep "^rank=$rank halves_link " <<<"$log") || fail "$layout: rank $rank did not measure its link"
    declare -A sent=()
    for field in ${line#* halves_link }; do sent[${field%=*}]=${field#*=}; done
    for what in rs ag; do
      world=${sent[${what}_world]} flat=${sent[${what}_flat]} input=${sent[input]}
      ((world > 0 && world * 100 <= input * percent)) ||
        fail "$layout: rank $rank: the world's $what sent $world bytes for $input of input (at most $percent% expected)"
      # Fewer than Gloo alone's - except an all-gather at 3 hosts, where Gloo's ring sends about as
      # few (2/3 of the output per host): there at most 3% more (one run sent 1.4% more).
      if [[ $what == ag && $layout == "3 hosts" ]]; then
        ((world * 100 <= flat * 103)) || fail "$layout: rank $rank: the world's ag sent $world bytes, over 1.03x Gloo alone's $flat"
      else
        ((world < flat)) || fail "$layout: rank $rank: the world's $what sent $world bytes, no fewer than Gloo alone's $flat"
      fi
    done
    echo "rank $rank (host ${JOB_HOST[$i]}): $(grep -o 'halves_checked=.*' <<<"$log"); link bytes per host: $line"
  done
  echo "$layout ($hosts ranks): reduce_scatter_tensor and all_gather_into_tensor right for every dtype," \
    "op and size; hierarchical on the link"
done

# 3. Host 1's ranks reduce-scatter while host 2's all-gather as many bytes: every rank's error names
#    both collectives across the hosts, within the timeout's 60 s (never paired, never a hang).
start_job "2 2" "$port" "$program" forever desync
await_job 60
out=$JOB_OUT
[[ ${JOB_CODES[*]} == "0 0 0 0" ]] || fail "desync: exit codes ${JOB_CODES[*]} (0 0 0 0: every rank reports its error)"
for rank in 0 1 2 3; do
  error=$(grep "^rank=$rank error=" <<<"$(rank_log "$rank")") || fail "desync: rank $rank reports no error"
  grep -q "are not running the same collective across hosts: rank [01] runs reduce_scatter_tensor (2100000 x float32 per rank, SUM), rank [23] runs all_gather_into_tensor (8400000 bytes per rank)" <<<"$error" ||
    fail "desync: rank $rank's error does not name both collectives: $error"
  echo "  rank $rank: $(cut -c1-300 <<<"$error")"
done
echo "desync across hosts (reduce-scatter against all-gather): named on every rank"

# 3b. Host 1's ranks in a hierarchical allreduce while host 2's reduce-scatter (only the latter
#     compares what it runs across the hosts): at the timeout every rank's error says the partner
#     may run another collective and how to have it named; with TORCH_DISTRIBUTED_DEBUG=DETAIL,
#     every rank names both at once.
for debug in off DETAIL; do
  port=$((port + 4))
  # A 10 s timeout: without DETAIL the partners' Gloo steps meet nothing and end at the timeout.
  export JOB_ENV="HOST_RANK_TIMEOUT_S=10"
  [[ $debug == DETAIL ]] && JOB_ENV+=" TORCH_DISTRIBUTED_DEBUG=DETAIL"
  start_job "2 2" "$port" "$program" forever desync_allreduce
  unset JOB_ENV
  await_job 60
  out=$JOB_OUT
  [[ ${JOB_CODES[*]} == "0 0 0 0" ]] || fail "desync ($debug): exit codes ${JOB_CODES[*]} (0 0 0 0: every rank reports its error)"
  for rank in 0 1 2 3; do
    error=$(grep "^rank=$rank error=" <<<"$(rank_log "$rank")") || fail "desync ($debug): rank $rank reports no error"
    if [[ $debug == off ]]; then
      grep -q "may be running another collective: TORCH_DISTRIBUTED_DEBUG=DETAIL names it" <<<"$error" ||
        fail "desync (allreduce against reduce-scatter): rank $rank's error does not say the partner may run another collective: $error"
    else
      grep -q "the ranks are not running the same collective.*rank [01] runs all_reduce.*rank [23] runs reduce_scatter_tensor" <<<"$error" ||
        fail "desync (allreduce against reduce-scatter, DETAIL): rank $rank's error does not name both collectives: $error"
    fi
    echo "  rank $rank: $(cut -c1-300 <<<"$error")"
  done
done
echo "desync across hosts (allreduce against reduce-scatter): every rank points to DETAIL, which names both"

# 4. A rank killed (host 2) in the middle of reduce-scatters and all-gathers of 33.6 MB: every other
#    rank ends within 20 s with an error naming it.
for victim in 3 0; do
  port=$((port + 4))
  start_job "2 2" "$port" "$program" forever halves
  for _ in $(seq 300); do  # bounded: 60 s for every rank to be in its loop
    [[ $(cat "$SIM_HOSTS_DIR"/logs/rank_*.txt | grep -c " ready ") == 4 ]] && break
    sleep 0.2
  done
  sleep 0.$((RANDOM % 9 + 1))
  { kill -9 "${JOB_PIDS[$victim]}" && wait "${JOB_PIDS[$victim]}"; } 2>/dev/null
  killed_at=$SECONDS
  await_job 20
  out=$JOB_OUT
  for rank in 0 1 2 3; do
    [[ $rank == "$victim" ]] && continue
    [[ ${JOB_CODES[$rank]} == 0 ]] || fail "rank $rank did not end within 20 s of rank $victim being killed: ${JOB_CODES[$rank]}"
    error=$(grep "^rank=$rank error=" <<<"$(rank_log "$rank")")
    grep -q "rank $victim[^0-9]" <<<"$error" || fail "rank $rank's error does not name killed rank $victim: $error"
    echo "  rank $rank: $(cut -c1-300 <<<"$error")"
  done
  echo "rank $victim (host ${JOB_HOST[$victim]}) killed among reduce-scatters and all-gathers: the other 3 ended within $((SECONDS - killed_at)) s naming it"
done
