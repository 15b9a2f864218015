#!/usr/bin/env bash
# Runs a command (ddp_bench) with every rank's traffic through a link of a given bandwidth, to see
# what compression hooks do where moving bytes costs more than touching them (two machines on
# Ethernet) rather than on this machine's loopback, where it costs about the same.
#   sudo bash benchmarks/over_link.sh 1gbit ./build/benchmarks/ddp_bench --configs mlp:4 --caps 25 ...
# How: a new network namespace (unshare -n) whose loopback device is shaped by a token bucket
# (tc tbf) to RATE; ddp_bench's ranks talk over 127.0.0.1, so all of Gloo's traffic passes it. The
# bucket is shared by both directions, like a half-duplex link: an allreduce between two ranks
# moves each byte once each way, so a full-duplex link of RATE is about twice as fast. Needs root
# (or CAP_NET_ADMIN) and iproute2's tc.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: over_link.sh RATE COMMAND [ARGS...]   (RATE as tc writes it: 1gbit, 10gbit)"; exit 2; }
rate="$1"
shift
command -v tc >/dev/null || { echo "over_link.sh: tc (iproute2) is needed: apt-get install iproute2"; exit 1; }
exec unshare -n -- bash -c '
  set -euo pipefail
  ip link set lo up
  # burst: enough for one 64 KiB loopback packet and some; latency: how long a packet may queue.
  tc qdisc add dev lo root tbf rate "$0" burst 1mb latency 100ms
  echo "over_link.sh: loopback of a new network namespace shaped to $0 ($(tc qdisc show dev lo))"
  exec "$@"' "$rate" "$@"
