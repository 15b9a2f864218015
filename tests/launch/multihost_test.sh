#!/usr/bin/env bash
# `ddprun -H` for real: two hosts in network namespaces, each with its own sshd (ssh_hosts.sh),
# one CTest entry per scenario:
#   multihost_test.sh train DDPRUN BASIC_DDP     from a third namespace, -H 10.77.0.1:2,10.77.0.2:2
#       trains the basic_ddp example on 4 ranks over ssh: every rank's lines arrive prefixed, the
#       replicas agree, nothing is left on either host
#   multihost_test.sh kill_rank DDPRUN CHILD     from host A (its own node started directly, B over
#       ssh): SIGKILL to the rank on B stops the whole job within the grace period, nothing left
#   multihost_test.sh interrupt DDPRUN CHILD     SIGINT to ddprun -H: exit 130, nothing left
#   multihost_test.sh refused DDPRUN CHILD       a host where no sshd listens: an error naming it with
#       ssh's message, exit 1, within seconds, and the other host's node is torn down
#   multihost_test.sh no_ddprun DDPRUN CHILD     ddprun run from a folder the hosts do not have: an
#       error naming the host and the path
# Exit 0: pass; 1: fail (with the reason and the output); 77: skipped (CTest SKIP_RETURN_CODE).
set -u -o pipefail
mode=$1 ddprun=$2 program=$3

out=""
fail() {
  echo "FAIL: $1"
  printf -- '--- output ---\n%s\n' "$out"
  exit 1
}
skip() {
  echo "SKIP: $1"
  exit 77
}

source "$(dirname "$0")/ssh_hosts.sh"
trap stop_hosts EXIT
start_hosts

# Every process of the job carries the tag (-x sends it to the other hosts' ranks too); the
# test's own commands do not (it is not exported).
tag=multihost_$$
tagged() { grep -lsz "^DDPRUN_TEST_TAG=$tag\$" /proc/[0-9]*/environ | cut -d/ -f3; }
ddprun_h=("$ddprun" --ssh "ssh -F $ssh_config" -x DDPRUN_TEST_TAG --grace-period 2 --timeout 60)

# Nothing of the job left anywhere (bounded: 10 s for ssh sessions to close).
expect_nothing_left() {
  local _ left
  for _ in $(seq 50); do
    left="$(left_on a)$(left_on b)$(tagged)"
    [[ -z $left ]] && return 0
    sleep 0.2
  done
  fail "processes left after the job: host A: $(left_on a | xargs) host B: $(left_on b | xargs) tagged: $(tagged | xargs)"
}

# Starts ddprun -H in the background in namespace $1; sets pid and the output file.
start_job() {
  local ns=$1
  shift
  log=$hosts_dir/job.out
  # ip execs env, which execs ddprun: $! is ddprun itself.
  ip netns exec "$ns" env DDPRUN_TEST_TAG="$tag" GLOO_SOCKET_IFNAME=eth77 "${ddprun_h[@]}" "$@" >"$log" 2>&1 &
  pid=$!
}
# Waits (bounded by $1 seconds) for the job to end; sets code and out.
wait_job() {
  local _
  for _ in $(seq $(($1 * 10))); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$pid" 2>/dev/null && { out=$(cat "$log"); fail "ddprun -H still running after $1 s"; }
  wait "$pid"
  code=$?
  out=$(cat "$log")
}
# Starts ranks that wait to be stopped, one on each host ($2), from namespace $1; returns once
# both said they are ready (bounded: 60 s).
start_hanging_job() {
  start_job "$1" -H "$2" -- "$program" hang
  local _
  for _ in $(seq 600); do
    [[ $(grep -c '^\[rank [01]\] ready rank=' "$log") == 2 ]] && return 0
    sleep 0.1
  done
  out=$(cat "$log")
  fail "the two ranks did not both start within 60 s"
}
# Waits for the job to end (bounded: 30 s, the grace period being 2 s); fails unless it exited
# with code $1 and printed a line matching $2.
expect_exit() {
  wait_job 30
  [[ $code == "$1" ]] || fail "exit code $code (expected $1)"
  grep -q "$2" <<<"$out" || fail "no line matching '$2'"
}

case $mode in
  train)
    start_job "$ns_desk" -H 10.77.0.1:2,10.77.0.2:2 -- "$program"
    wait_job 180
    [[ $code == 0 ]] || fail "exit code $code from ddprun -H"
    for rank in 0 1 2 3; do
      grep -q "^\[rank $rank\] Running basic DDP example on rank $rank of 4\.$" <<<"$out" ||
        fail "rank $rank did not join a world of 4"
      grep -Eq "^\[rank $rank\] rank $rank step 4 loss [0-9.e-]+$" <<<"$out" || fail "rank $rank did not train 5 steps"
    done
    grep -Eq '^\[rank 0\] replicas identical after 5 steps \(weight checksum [-0-9.e]+\)$' <<<"$out" ||
      fail "the replicas on the two hosts did not end identical"
    expect_nothing_left
    ;;

  kill_rank)
    start_hanging_job "$ns_a" 10.77.0.1:1,10.77.0.2:1
    victim=$(sed -n 's/^\[rank 1\] ready rank=1 pid=\([0-9]*\).*/\1/p' "$log")
    [[ -n $victim ]] && ip netns pids "$ns_b" | grep -qx "$victim" || { out=$(cat "$log"); fail "rank 1 is not on host B"; }
    kill -9 "$victim"
    expect_exit 1 "rank 1 (local rank 0 on node 1, pid $victim) was killed by signal 9"
    grep -q "ddprun: host 10.77.0.[12] (node [01]) failed: its launcher exited with code 1" <<<"$out" ||
      fail "no report naming a host"
    expect_nothing_left
    ;;

  interrupt)
    start_hanging_job "$ns_desk" 10.77.0.1:1,10.77.0.2:1
    kill -INT "$pid"
    expect_exit 130 "ddprun: received signal 2; stopped the job on every host"
    expect_nothing_left
    ;;

  refused)
    start_job "$ns_a" -H 10.77.0.1:1,10.77.0.3:1 -- "$program" hang
    start=$SECONDS
    expect_exit 1 "ddprun: host 10.77.0.3 (node 1) failed: ssh exited with code 255"
    grep -q "  | ssh: connect to host 10.77.0.3 port 2222: Connection refused" <<<"$out" || fail "ssh's message is not quoted"
    ((SECONDS - start <= 20)) || fail "took $((SECONDS - start)) s"
    expect_nothing_left
    ;;

  no_ddprun)
    # A copy of ddprun on a tmpfs mounted in the coordinator's namespace only (ip netns exec gives
    # it its own mount namespace): the same path does not exist on the hosts.
    private=$hosts_dir/private
    mkdir "$private"
    log=$hosts_dir/job.out
    ip netns exec "$ns_desk" sh -c 'mount -t tmpfs ddprun-test "$1" && cp "$2" "$1/ddprun" && shift 2 &&
      exec "$@"' sh "$private" "$ddprun" env DDPRUN_TEST_TAG="$tag" "$private/ddprun" "${ddprun_h[@]:1}" \
      -H 10.77.0.1:1,10.77.0.2:1 -- "$program" hang >"$log" 2>&1 &
    pid=$!
    expect_exit 1 "ddprun: host 10.77.0.[12] (node [01]) failed: the remote shell could not run $private/ddprun (exit code 127): ddprun must be at the same path on every host"
    grep -q "  | env: .$private/ddprun.: No such file or directory" <<<"$out" || fail "the shell's message is not quoted"
    expect_nothing_left
    ;;

  *)
    echo "usage: $0 train|kill_rank|interrupt|refused|no_ddprun DDPRUN PROGRAM"
    exit 2
    ;;
esac
echo "PASS: $mode"
