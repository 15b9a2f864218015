#!/usr/bin/env bash
# What a test on simulated hosts sources first (two_hosts_test.sh, hierarchical_test.sh): `fail
# MESSAGE` (exit 1, printing $out when set), `skip MESSAGE` (exit 77: CTest's skip), sim_hosts.sh
# and host_job.sh, and the teardown of the hosts when the test exits (also after fail or skip).
set -u -o pipefail
out=""
fail() {
  echo "FAIL: $1"
  [[ -n $out ]] && printf -- '--- output ---\n%s\n' "$out"
  exit 1
}
skip() {
  echo "SKIP: $1"
  exit 77
}
source "$(dirname "${BASH_SOURCE[0]}")/sim_hosts.sh"
source "$(dirname "${BASH_SOURCE[0]}")/host_job.sh"
trap sim_hosts_down EXIT
