# Two "hosts" for multihost_test.sh (sourced): network namespaces, each with a real OpenSSH sshd
# (Debian openssh-server) started from a temporary folder with its own host key, authorized key,
# port and config; nothing of the system's ssh setup is used or changed.
#
#   desk   10.77.0.254 on bridge br0: where the test runs `ddprun -H` (neither host is "this host")
#   hostA  10.77.0.1 on eth77, sshd on port 2222
#   hostB  10.77.0.2 on eth77, sshd on port 2222; also 10.77.0.3, where no sshd listens (refuses)
#
# Both hosts name their interface eth77, so one GLOO_SOCKET_IFNAME=eth77 serves every rank.
# start_hosts exports ssh_config (for `ddprun --ssh "ssh -F $ssh_config"`) and ns_desk/ns_a/ns_b;
# stop_hosts kills everything left in the namespaces and removes them and the folder. Every wait is
# bounded. Both expect `fail` (message, exit 1) and `skip` (message, exit 77) functions.

in_ns() { local ns=$1; shift; ip netns exec "$ns" "$@"; }

start_hosts() {
  [[ $(id -u) == 0 ]] || skip "network namespaces and a root sshd need root (CI runs as root)"
  command -v ssh >/dev/null && command -v ssh-keygen >/dev/null ||
    skip "OpenSSH's client is not installed (Debian: openssh-client; scripts/setup.sh installs it)"
  [[ -x /usr/sbin/sshd ]] || skip "OpenSSH's server is not installed (Debian: openssh-server; scripts/setup.sh installs it)"
  hosts_dir=$(mktemp -d)
  local id=$$
  ns_desk=ddpdesk_$id ns_a=ddphostA_$id ns_b=ddphostB_$id
  ip netns add "$ns_desk" 2>"$hosts_dir/netns.err" ||
    skip "cannot create network namespaces here: $(cat "$hosts_dir/netns.err")"
  local step
  for step in "ip netns add $ns_a" "ip netns add $ns_b" \
    "ip -n $ns_desk link add br0 type bridge" "ip -n $ns_desk addr add 10.77.0.254/24 dev br0" \
    "ip -n $ns_desk link set br0 up" "ip -n $ns_desk link set lo up" \
    "ip link add va$id type veth peer name vda$id" "ip link add vb$id type veth peer name vdb$id" \
    "ip link set va$id netns $ns_a" "ip link set vb$id netns $ns_b" \
    "ip link set vda$id netns $ns_desk" "ip link set vdb$id netns $ns_desk" \
    "ip -n $ns_a link set va$id name eth77" "ip -n $ns_b link set vb$id name eth77" \
    "ip -n $ns_a addr add 10.77.0.1/24 dev eth77" "ip -n $ns_b addr add 10.77.0.2/24 dev eth77" \
    "ip -n $ns_b addr add 10.77.0.3/24 dev eth77" \
    "ip -n $ns_a link set eth77 up" "ip -n $ns_b link set eth77 up" \
    "ip -n $ns_a link set lo up" "ip -n $ns_b link set lo up" \
    "ip -n $ns_desk link set vda$id master br0 up" "ip -n $ns_desk link set vdb$id master br0 up"; do
    $step 2>"$hosts_dir/step.err" || fail "'$step' failed: $(cat "$hosts_dir/step.err")"
  done

  # One client key, authorized on both hosts; one host key each.
  ssh-keygen -q -t ed25519 -N '' -f "$hosts_dir/id" || fail "ssh-keygen failed"
  cp "$hosts_dir/id.pub" "$hosts_dir/authorized_keys"
  printf '%s\n' 'Host *' '  Port 2222' '  User root' "  IdentityFile $hosts_dir/id" \
    "  UserKnownHostsFile $hosts_dir/known_hosts" '  LogLevel ERROR' >"$hosts_dir/ssh_config"
  ssh_config=$hosts_dir/ssh_config
  local name ns address
  for name in a b; do
    ns=ns_$name ns=${!ns}
    address=10.77.0.$([[ $name == a ]] && echo 1 || echo 2)
    ssh-keygen -q -t ed25519 -N '' -f "$hosts_dir/host_key_$name" || fail "ssh-keygen failed"
    printf '%s\n' 'Port 2222' "ListenAddress $address" "HostKey $hosts_dir/host_key_$name" \
      "AuthorizedKeysFile $hosts_dir/authorized_keys" 'PermitRootLogin prohibit-password' \
      'PasswordAuthentication no' 'KbdInteractiveAuthentication no' 'UsePAM no' 'StrictModes no' 'UseDNS no' \
      "PidFile $hosts_dir/sshd_$name.pid" >"$hosts_dir/sshd_config_$name"
    # sshd insists on its privilege-separation folder /run/sshd: give it one on a tmpfs private to
    # this namespace's mount namespace (ip netns exec makes one), not on the system's /run.
    in_ns "$ns" sh -c "mount -t tmpfs -o mode=755 ddprun-test /run && mkdir -m 755 /run/sshd &&
      exec /usr/sbin/sshd -D -e -f $hosts_dir/sshd_config_$name" >"$hosts_dir/sshd_$name.log" 2>&1 &
  done
  local _
  for _ in $(seq 50); do  # bounded: 10 s for both to listen
    grep -q 'Server listening' "$hosts_dir/sshd_a.log" && grep -q 'Server listening' "$hosts_dir/sshd_b.log" && return 0
    sleep 0.2
  done
  fail "sshd did not start: $(cat "$hosts_dir"/sshd_*.log)"
}

# Pids of the processes on host $1 (a or b) other than its sshd listener: empty when nothing is left.
left_on() {
  local ns=ns_$1 listener
  listener=$(cat "$hosts_dir/sshd_$1.pid" 2>/dev/null)
  ip netns pids "${!ns}" 2>/dev/null | grep -vx "${listener:-none}"
}

stop_hosts() {
  [[ -n ${hosts_dir:-} && -d $hosts_dir ]] || return 0
  local ns
  for ns in "$ns_a" "$ns_b" "$ns_desk"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  rm -rf "$hosts_dir"
}
