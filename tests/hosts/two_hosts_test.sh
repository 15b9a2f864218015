#!/usr/bin/env bash
# Two simulated hosts (sim_hosts.sh, links shaped to 10 Gbit/s) and one torchddp job of 2 hosts x
# 2 ranks across them:
#   1. the hosts are separate where torchddp looks: each rank's hostname is its host's; a POSIX
#      shared-memory object (a file in /dev/shm, what shm_open makes) and a System V segment made
#      on host 1 are absent on host 2 and on the machine
#   2. the ranks form one world over the link: all_reduce over the world is right, DDP's gradients
#      equal one process's on the whole batch, and each host's shaped link carried traffic
#   3. what the library chooses: the world (2 ranks on each of two hosts) reports "gloo+shm
#      hierarchical (2 hosts x 2)" - its allreduce goes through shared memory inside each host and
#      Gloo across them, and equals a Gloo-alone group's (all_reduce, DDP) within fp32 rounding; its
#      DDP buckets (so the gradients after backward) lie in memory each host's ranks share -
#      while a group of one host's ranks reports "gloo+shm"
# Usage: two_hosts_test.sh HOST_RANK. Exit 0: pass; 1: fail (the reason and the output);
# 77: skipped (no root or no namespaces here).
source "$(dirname "$0")/host_test.sh"
program=$1
sim_hosts_up 2 10gbit

# 1. Separate hosts.
for i in 1 2; do
  name=$(on_host "$i" hostname)
  [[ $name == "simhost$i" ]] || fail "host $i is named '$name', not simhost$i"
done
[[ $(hostname) != simhost* ]] || fail "the machine's own hostname changed to $(hostname)"
probe=/dev/shm/torchddp-sim-hosts-probe-$$ key=
# The probes go with host 1's namespaces; this removes them too where a broken rig shared them.
remove_probes() {
  on_host 1 rm -f "$probe" 2>/dev/null
  [[ -n $key ]] && on_host 1 ipcrm -M "$key" 2>/dev/null
  sim_hosts_down
}
trap remove_probes EXIT
on_host 1 sh -c "echo made on host 1 >$probe" || fail "could not make $probe on host 1"
on_host 1 test -e "$probe" || fail "$probe is not on host 1, where it was made"
on_host 2 test ! -e "$probe" || fail "$probe, made on host 1, is visible on host 2: /dev/shm is shared"
[[ ! -e $probe ]] || fail "$probe, made on host 1, is visible in the machine's /dev/shm"
# A System V segment, found by its key (ipcs -i exits 0 even for an id it does not find).
sysv=$(on_host 1 ipcmk -M 4096 | grep -o '[0-9]*$') || fail "ipcmk -M failed on host 1"
key=$(on_host 1 ipcs -m | awk -v id="$sysv" '$2 == id { print $1 }')
[[ -n $key ]] || fail "System V segment $sysv is not on host 1, where it was made"
! on_host 2 ipcs -m | grep -q "^$key " || fail "System V segment $key of host 1 is visible on host 2"
! ipcs -m | grep -q "^$key " || fail "System V segment $key of host 1 is visible on the machine"
echo "separate: hostnames simhost1/simhost2; $probe and System V segment $key of host 1 are not on host 2 nor the machine"

# 2. One job, 2 hosts x 2 ranks, rendezvous on host 1 over the link.
start_job "2 2" $((29000 + $$ % 1000)) "$program"
await_job 120  # the ranks' own collectives time out after 60 s
out=$JOB_OUT
[[ ${JOB_CODES[*]} == "0 0 0 0" ]] || fail "the ranks' exit codes are ${JOB_CODES[*]} (0 0 0 0 expected)"

for rank in 0 1 2 3; do
  host=$((rank / 2 + 1))
  log=$(rank_log "$rank")
  grep -q "^rank=$rank host=simhost$host " <<<"$log" || fail "rank $rank does not report host simhost$host"
  grep -q "^rank=$rank world_sum=10 world_max=3$" <<<"$log" ||
    fail "rank $rank's world all_reduce is not 1+2+3+4 = 10 (SUM, float32) and 3 (MAX, int64)"
  grep -q "^rank=$rank world_avg=2.5$" <<<"$log" || fail "rank $rank's world AVG (float64) is not (1+2+3+4)/4 = 2.5"
  grep -q "^rank=$rank .*host_sum=3$" <<<"$log" || fail "rank $rank's host-group all_reduce is not 1+2 = 3"
  grep -q "^rank=$rank ddp_grads=match$" <<<"$log" || fail "rank $rank's DDP gradients differ from one process's"
  grep -q "^rank=$rank ddp_buckets=shared$" <<<"$log" ||
    fail "rank $rank's DDP gradients do not lie in shared memory (its buckets are not shared within its host)"
  grep -q "^rank=$rank flat_transport=gloo flat_match=yes$" <<<"$log" ||
    fail "rank $rank's world all_reduce differs from a Gloo-alone group's beyond fp32 rounding, or between ranks"
  grep -q "^rank=$rank ddp_grads_flat=match$" <<<"$log" ||
    fail "rank $rank's DDP gradients differ from DDP's on a Gloo-alone group beyond fp32 rounding"
  # 3. What the library chose for each group.
  grep -q "^rank=$rank .*world_transport=gloo+shm hierarchical (2 hosts x 2)$" <<<"$log" ||
    fail "rank $rank's world group does not report transport 'gloo+shm hierarchical (2 hosts x 2)'"
  grep -q "^rank=$rank host_transport=gloo+shm " <<<"$log" ||
    fail "rank $rank's host group does not report transport gloo+shm"
done
echo "one world of 4 ranks on simhost1 and simhost2: world all_reduce 10 (MAX 3, AVG 2.5), DDP gradients match one" \
  "process's and DDP's on Gloo alone; 2M+13 floats all-reduced equal Gloo alone's within fp32 rounding," \
  "with the same bits on every rank"
# The world's traffic crossed the shaped links (not some loopback): each host's tbf sent bytes.
for host in 1 2; do
  qdisc=$(on_host "$host" tc -s qdisc show dev eth0)
  sent=$(grep -o 'Sent [0-9]*' <<<"$qdisc" | head -1 | cut -d' ' -f2)
  [[ $qdisc == *"tbf"*"rate 10Gbit"* && ${sent:-0} -gt 0 ]] ||
    fail "host $host's link is not shaped or carried nothing: $qdisc"
  echo "host $host's link (tbf 10Gbit) sent $sent bytes"
done
echo "transports: the world group (2 hosts x 2) gloo+shm hierarchical; each host's group of 2 ranks gloo+shm"
