#!/usr/bin/env bash
# One torchddp job across the simulated hosts of sim_hosts.sh (sourced after it, with hosts up):
#   start_job "N1 N2 .." PORT PROGRAM [ARGS..]
#       starts N1 ranks on host 1, N2 on host 2, ... (ranks numbered host by host), each with
#       torchrun's variables, rendezvous at host 1's address:PORT, HOST_GROUP_INIT a tcp:// address
#       on its own host (PORT + 1) and whatever JOB_ENV holds ("NAME=VALUE ...", and JOB_ENV_<R>
#       for rank R alone); each rank's output
#       goes to $SIM_HOSTS_DIR/logs/rank_R.txt. Sets JOB_PIDS (by rank) and JOB_HOST (by rank).
#   await_job SECONDS
#       waits at most SECONDS for every rank to exit; sets JOB_CODES (by rank: the exit code, or
#       "timeout" for a rank still running, which it kills) and JOB_OUT (every rank's output).
#   rank_log R          prints rank R's output
start_job() {
  local counts=$1 port=$2
  shift 2
  local master host=0 count local_rank rank=0 world=0
  master=$(sim_host_addr 1)
  for count in $counts; do world=$((world + count)); done
  mkdir -p "$SIM_HOSTS_DIR/logs"
  rm -f "$SIM_HOSTS_DIR"/logs/rank_*.txt
  JOB_PIDS=() JOB_HOST=()
  for count in $counts; do
    host=$((host + 1))
    for ((local_rank = 0; local_rank < count; local_rank++)); do
      # shellcheck disable=SC2086  # JOB_ENV is a list of NAME=VALUE words
      on_host_bg "$host" env RANK=$rank WORLD_SIZE=$world LOCAL_RANK=$local_rank LOCAL_WORLD_SIZE=$count \
        GROUP_RANK=$((host - 1)) MASTER_ADDR="$master" MASTER_PORT="$port" \
        HOST_GROUP_INIT="tcp://$(sim_host_addr "$host"):$((port + 1))" ${JOB_ENV:-} $(rank_env "$rank") \
        "$@" >"$SIM_HOSTS_DIR/logs/rank_$rank.txt" 2>&1
      JOB_PIDS+=($!)  # the rank itself: kill reaches it
      JOB_HOST+=("$host")
      rank=$((rank + 1))
    done
  done
}

await_job() {
  local seconds=$1 pid running _
  for _ in $(seq $((seconds * 5))); do  # bounded
    running=0
    for pid in "${JOB_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && running=1; done
    ((running)) || break
    sleep 0.2
  done
  JOB_CODES=()
  for pid in "${JOB_PIDS[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      kill -9 "$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      JOB_CODES+=(timeout)
    else
      wait "$pid" 2>/dev/null  # no "Killed" notice for a rank the test killed
      JOB_CODES+=($?)
    fi
  done
  JOB_OUT=$(cat "$SIM_HOSTS_DIR"/logs/rank_*.txt)
}

rank_log() { cat "$SIM_HOSTS_DIR/logs/rank_$1.txt"; }
# JOB_ENV_<R>: more NAME=VALUE words for rank R alone.
rank_env() {
  local name=JOB_ENV_$1
  echo "${!name:-}"
}
