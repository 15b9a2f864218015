#!/usr/bin/env bash
# A model that outgrows a rank (examples/fsdp, 100.7 M parameters, Adam), at 4 ranks under ddprun,
# each rank's address space capped (prlimit --as) at what a tiny run of the same program maps plus
# 1300 MiB:
#   - DistributedDataParallel + Adam (16 bytes per parameter on every rank, plus its buckets) runs
#     out of memory, and the program says so ("out of memory"), exit code not 0;
#   - ddp::fully_shard + Adam (16/4 bytes per parameter, plus the blocks being gathered) trains.
# The cap is relative to the tiny run so that the libraries' own mappings do not count.
#   fsdp_outgrow_test.sh DDPRUN FSDP_BIG_MODEL
source "$(dirname "$0")/example_test.sh"
ddprun=$1 program=$2
command -v prlimit >/dev/null || { echo "SKIP: no prlimit"; exit 77; }
run() { timeout 300 "$ddprun" --standalone --nproc-per-node 4 --timeout 120 -- "$@" 2>&1; }

out=$(run "$program" --width 64 --steps 1 --vm-peak) || fail "the tiny run: exit code $?"
baseline=$(grep -oE 'peak virtual memory [0-9]+ MiB' <<<"$out" | grep -oE '[0-9]+' | sort -n | tail -1)
[ -n "$baseline" ] || fail "the tiny run printed no peak virtual memory"
cap_mib=$((baseline + 1300))
cap=$((cap_mib * 1024 * 1024))
echo "tiny run maps $baseline MiB at most; cap $cap_mib MiB per rank"

out=$(run prlimit --as=$cap "$program" --ddp --steps 2); code=$?
[ $code != 0 ] || fail "DDP + Adam trained under the cap of $cap_mib MiB: the model does not outgrow a rank"
grep -q "out of memory" <<<"$out" || fail "DDP + Adam failed under the cap without saying it ran out of memory"
grep -q "ddp step 2" <<<"$out" && fail "DDP + Adam got to step 2 under the cap"
echo "DDP + Adam under the cap: $(grep -m1 -oE 'out of memory: .{0,80}' <<<"$out")"

out=$(run prlimit --as=$cap "$program" --steps 2 --vm-peak) || fail "fully sharded under the cap: exit code $?"
grep -q "fsdp step 2: mean loss" <<<"$out" || fail "fully sharded: no second step"
echo "fully sharded under the cap: $(grep -oE 'rank 0 holds .*' <<<"$out")"
echo "PASS: fsdp outgrow"
