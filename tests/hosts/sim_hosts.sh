#!/usr/bin/env bash
# N simulated hosts on this machine, for tests and benchmarks that need ranks on several hosts
# (issue 29). Each host is as separate as a second machine is for what torchddp can observe:
#   network  its own network namespace, one interface eth0 at 10.78.0.<i>/24 (host i = 1..N), a veth
#            to a bridge in a "switch" namespace of its own (nothing of the machine's network is
#            touched); optional tc shaping of both directions of every host's link to RATE
#   UTS      its own hostname, simhost<i>, which resolves to its address on every host (an
#            /etc/hosts of the simulated hosts, bind-mounted in each: a cluster's DNS), so programs
#            that bind to their hostname's address (Gloo's default device) find eth0
#   IPC      its own System V and POSIX IPC (ipcs shows only its own segments)
#   mount    its own mount namespace with a private tmpfs on /dev/shm: a segment made on one host
#            is not in /dev/shm of another, nor of the machine. The rest of the file system is the
#            machine's (builds, /tmp), as on hosts that share a network file system.
# Each host is held by an anchor process (the first process of its namespaces); on_host enters
# them with nsenter. Everything started on a host is in its network namespace, so teardown finds
# and kills it there (ip netns pids).
#
# Sourced (tests): defines
#   sim_hosts_up N [RATE]   RATE as tc writes it (1gbit, 10gbit) or "" for an unshaped link; sets
#                           SIM_HOSTS_DIR (state), SIM_HOSTS (N); calls `skip MESSAGE` (exit 77 in
#                           the caller) where root or namespaces are missing, `fail MESSAGE` when a
#                           step that should work does not. Both must be defined by the caller.
#   sim_host_addr I         prints host I's address (10.78.0.I)
#   on_host I CMD [ARGS..]  runs CMD inside host I (foreground)
#   on_host_bg I CMD [ARGS..]  starts CMD inside host I in the background; $! is CMD's process
#                           (`on_host I CMD &` would make $! a subshell: killing it leaves CMD)
#   sim_hosts_down          kills every process left on the hosts, removes the namespaces and the
#                           state folder; safe to call twice (use it in an EXIT trap)
# Run (by hand, benchmarks):
#   bash tests/hosts/sim_hosts.sh N RATE|none COMMAND [ARGS..]
#       brings N hosts up, runs COMMAND on the machine with SIM_HOSTS_DIR and SIM_HOSTS exported,
#       tears the hosts down when it ends; COMMAND enters a host with
#   bash tests/hosts/sim_hosts.sh on I CMD [ARGS..]      (reads SIM_HOSTS_DIR)
# Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN), iproute2 (ip, tc) and util-linux (unshare,
# nsenter). Every wait here is bounded; an anchor outlives nothing by more than SIM_HOSTS_LIFETIME
# seconds (default 3600) even when teardown never runs.

sim_host_addr() { echo "10.78.0.$1"; }

_anchor_of() { cat "$SIM_HOSTS_DIR/anchor_$1" 2>/dev/null || { echo "sim_hosts: no host $1" >&2; return 2; }; }

on_host() {
  local i=$1 anchor
  shift
  anchor=$(_anchor_of "$i") || return 2
  # --wd: nsenter would otherwise keep a working directory from the machine's mount namespace.
  nsenter -t "$anchor" --net --uts --ipc --mount --wd="$PWD" -- "$@"
}

on_host_bg() {
  local i=$1 anchor
  shift
  anchor=$(_anchor_of "$i") || return 2
  # nsenter execs CMD (no --fork): $! is CMD itself, so `kill $!` reaches it, not a subshell.
  nsenter -t "$anchor" --net --uts --ipc --mount --wd="$PWD" -- "$@" &
}

# One step of the set-up that must work once namespaces do: its error text, or fail.
_sim_step() {
  "$@" 2>"$SIM_HOSTS_DIR/step.err" || fail "sim_hosts: '$*' failed: $(cat "$SIM_HOSTS_DIR/step.err")"
}

sim_hosts_up() {
  local n=$1 rate=${2:-}
  [[ $(id -u) == 0 ]] || skip "simulated hosts need root (network, UTS, IPC and mount namespaces; CI runs as root)"
  command -v nsenter >/dev/null && command -v unshare >/dev/null ||
    skip "util-linux's unshare and nsenter are not installed"
  command -v ip >/dev/null || skip "iproute2's ip is not installed"
  SIM_HOSTS_DIR=$(mktemp -d /tmp/sim_hosts.XXXXXX)
  SIM_HOSTS=$n
  local id=$$
  echo "$id" >"$SIM_HOSTS_DIR/id"
  local switch=simswitch_$id
  echo "$switch" >"$SIM_HOSTS_DIR/namespaces"
  # The first namespace tells whether this machine (or container) allows them at all.
  ip netns add "$switch" 2>"$SIM_HOSTS_DIR/netns.err" ||
    skip "cannot create network namespaces here: $(cat "$SIM_HOSTS_DIR/netns.err")"
  # ...and whether they can be entered (inside a chroot `ip -n` cannot, though `ip netns add` may).
  ip -n "$switch" link add br0 type bridge 2>"$SIM_HOSTS_DIR/netns.err" ||
    skip "cannot enter network namespaces here: $(cat "$SIM_HOSTS_DIR/netns.err")"
  _sim_step ip -n "$switch" link set br0 up
  _sim_step ip -n "$switch" link set lo up

  local i ns anchor_log _
  {
    printf '%s\n' "127.0.0.1 localhost" "::1 localhost ip6-localhost ip6-loopback"
    for ((i = 1; i <= n; i++)); do echo "$(sim_host_addr "$i") simhost$i"; done
  } >"$SIM_HOSTS_DIR/hosts"
  for ((i = 1; i <= n; i++)); do
    ns=simhost${i}_$id
    echo "$ns" >>"$SIM_HOSTS_DIR/namespaces"
    _sim_step ip netns add "$ns"
    # The host's end is named eth0 inside the host; the switch's end sw<i>_<id> (at most 15 chars).
    _sim_step ip link add "sh${i}_$id" type veth peer name "sw${i}_$id"
    _sim_step ip link set "sh${i}_$id" netns "$ns"
    _sim_step ip link set "sw${i}_$id" netns "$switch"
    _sim_step ip -n "$ns" link set "sh${i}_$id" name eth0
    _sim_step ip -n "$ns" addr add "$(sim_host_addr "$i")/24" dev eth0
    _sim_step ip -n "$ns" link set eth0 up
    _sim_step ip -n "$ns" link set lo up
    _sim_step ip -n "$switch" link set "sw${i}_$id" master br0 up
    if [[ -n $rate ]]; then
      # Both directions of the link: the host's sending side and the switch's side toward the host
      # (a full-duplex NIC of RATE). burst: a few 64 KiB segments; latency: how long a packet queues.
      _sim_step tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst 1mb latency 100ms
      _sim_step tc -n "$switch" qdisc add dev "sw${i}_$id" root tbf rate "$rate" burst 1mb latency 100ms
    fi
    # The anchor: UTS, IPC and mount namespaces of its own inside the host's network namespace, a
    # hostname, the hosts' /etc/hosts and a private tmpfs on /dev/shm (mount propagation private:
    # the machine's files and /dev/shm are untouched). It writes its pid (sh execs sleep: the same
    # pid), then holds the namespaces.
    anchor_log=$SIM_HOSTS_DIR/anchor_$i.log
    ip netns exec "$ns" unshare --uts --ipc --mount --propagation private -- sh -c "
      hostname simhost$i && mount --bind '$SIM_HOSTS_DIR/hosts' /etc/hosts &&
      mount -t tmpfs -o mode=1777,size=256m simhost${i}_shm /dev/shm &&
      echo \$\$ >'$SIM_HOSTS_DIR/anchor_$i.tmp' && mv '$SIM_HOSTS_DIR/anchor_$i.tmp' '$SIM_HOSTS_DIR/anchor_$i' &&
      exec sleep ${SIM_HOSTS_LIFETIME:-3600}" >"$anchor_log" 2>&1 &
    for _ in $(seq 50); do  # bounded: 10 s
      [[ -s $SIM_HOSTS_DIR/anchor_$i ]] && break
      kill -0 $! 2>/dev/null || break
      sleep 0.2
    done
    if [[ ! -s $SIM_HOSTS_DIR/anchor_$i ]]; then
      # unshare refused (a container without CAP_SYS_ADMIN, user namespaces only): a skip, not a bug.
      if grep -qi "unshare failed\|Operation not permitted\|Permission denied" "$anchor_log"; then
        skip "cannot make UTS/IPC/mount namespaces here: $(cat "$anchor_log")"
      fi
      fail "sim_hosts: host $i's anchor did not start: $(cat "$anchor_log")"
    fi
    disown $!  # teardown kills it: no job-control notice then
  done
}

sim_hosts_down() {
  [[ -n ${SIM_HOSTS_DIR:-} && -d $SIM_HOSTS_DIR ]] || return 0
  local ns _
  while read -r ns; do
    # Everything on a host (its anchor included) is in its network namespace.
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    for _ in $(seq 25); do  # bounded: 5 s for the killed to be reaped
      [[ -z $(ip netns pids "$ns" 2>/dev/null) ]] && break
      sleep 0.2
    done
    ip netns del "$ns" 2>/dev/null  # takes its veth ends (and so the switch's) with it
  done <"$SIM_HOSTS_DIR/namespaces"
  rm -rf "$SIM_HOSTS_DIR"
  SIM_HOSTS_DIR=
}

# Run as a program: `sim_hosts.sh on I CMD...` or `sim_hosts.sh N RATE|none COMMAND...`.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  set -u -o pipefail
  fail() { echo "sim_hosts.sh: $1" >&2; exit 1; }
  skip() { echo "sim_hosts.sh: cannot run here: $1" >&2; exit 77; }
  usage="usage: sim_hosts.sh N RATE|none COMMAND [ARGS..]   or   sim_hosts.sh on I CMD [ARGS..]"
  [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
  if [[ $1 == on ]]; then
    [[ -n ${SIM_HOSTS_DIR:-} ]] || fail "'on' needs SIM_HOSTS_DIR (set for the COMMAND that sim_hosts.sh N RATE runs)"
    shift
    on_host "$@"
    exit
  fi
  [[ $1 =~ ^[1-9][0-9]*$ && $# -ge 3 ]] || { echo "$usage" >&2; exit 2; }
  n=$1 rate=$2
  shift 2
  [[ $rate == none ]] && rate=
  trap sim_hosts_down EXIT
  trap 'exit 130' INT TERM
  sim_hosts_up "$n" "$rate"
  export SIM_HOSTS_DIR SIM_HOSTS
  "$@"
  exit
fi
