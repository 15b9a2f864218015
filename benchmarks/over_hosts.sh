#!/usr/bin/env bash
# Flat Gloo against the hierarchical allreduce (issue 29) for a job of 2 hosts x 2 ranks, over
# links of each RATE: two simulated hosts (tests/hosts/sim_hosts.sh: their own network, hostname,
# IPC and /dev/shm; both directions of each host's link shaped by tc tbf to RATE), four ranks of
# hosts_bench, which trains mlp_b4 with 25 MiB buckets under DDP on both kinds of group in
# interleaved rounds and prints the median step of each and hierarchical/flat.
#   sudo bash benchmarks/over_hosts.sh build/benchmarks/hosts_bench [--rates "1gbit 10gbit"] [-- HOSTS_BENCH_ARGS..]
# Tiny (seconds; proves the set-up, no figures):
#   sudo bash benchmarks/over_hosts.sh build/benchmarks/hosts_bench -- --mlp-width 64 --mlp-layers 2 \
#        --warmup 1 --steps 1 --rounds 1
# Needs root, iproute2 and util-linux (sim_hosts.sh). Every rank is bounded by --timeout (default
# 600 s per job here); the hosts and everything on them are removed when a rate is done.
set -u -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
usage="usage: over_hosts.sh HOSTS_BENCH [--rates \"1gbit 10gbit\"] [--timeout SECONDS] [-- HOSTS_BENCH_ARGS..]"
[[ $# -ge 1 && -x $1 ]] || { echo "$usage" >&2; exit 2; }
program=$(realpath "$1")
shift
rates="1gbit 10gbit" timeout=600
while [[ $# -gt 0 ]]; do
  case $1 in
    --rates) rates=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done

fail() { echo "over_hosts.sh: $1" >&2; exit 1; }
skip() { echo "over_hosts.sh: cannot run here: $1" >&2; exit 77; }
source "$here/../tests/hosts/sim_hosts.sh"
source "$here/../tests/hosts/host_job.sh"
trap sim_hosts_down EXIT
trap 'exit 130' INT TERM

port=$((33000 + $$ % 1000 * 2))
for rate in $rates; do
  sim_hosts_up 2 "$rate"
  echo "== 2 hosts x 2 ranks, links shaped to $rate (tc tbf, both directions) =="
  start_job "2 2" "$port" "$program" --timeout "$timeout" "$@"
  await_job $((timeout + 60))
  [[ ${JOB_CODES[*]} == "0 0 0 0" ]] || { printf '%s\n' "$JOB_OUT"; fail "at $rate the ranks' exit codes are ${JOB_CODES[*]}"; }
  rank_log 0
  sim_hosts_down
  port=$((port + 4))
done
