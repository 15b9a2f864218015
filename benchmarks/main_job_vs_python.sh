#!/usr/bin/env bash
# The main job (examples/train_fashion_mnist under ddprun) against its Python peer (PyTorch's own
# DistributedDataParallel doing the same training: benchmarks/python_peer/train_fashion_mnist.py
# under torchrun), interleaved in one run, at 2 ranks and at 1 rank; prints samples/s of each and
# the ratio ours/python.
#
#   bash benchmarks/main_job_vs_python.sh MAIN_JOB [PYTHON] [EPOCHS] [-- FLAGS...]
#
#   MAIN_JOB  the main job's binary, e.g. build/examples/train_fashion_mnist/train_fashion_mnist
#             (LibTorch 1.13) or build-wheel/examples/train_fashion_mnist/train_fashion_mnist (the
#             torch wheel's LibTorch); ddprun is taken from the same build (<build>/launch/ddprun)
#             unless DDPRUN names one
#   PYTHON    the Python whose torch runs the peer (default: the wheel's venv,
#             ${DDP_WHEEL_VENV:-.venv-torch}/bin/python, when present, else the first of python3
#             and /usr/bin/python3 that has torch)
#   EPOCHS    epochs per run (default 1)
#   FLAGS     given to both programs, e.g. -- --limit-train 640 for a trial
# Environment: ROUNDS (default 2) runs of each per world, WORLDS (default "2 1"), RUN_TIMEOUT
# (seconds per run, default 1800), OMP_NUM_THREADS (default 1 for both; each program also runs
# one torch thread per rank, its --threads default).
#
# Each round runs, one after the other: ours (gloo+shm, the default on one host), at 2 ranks ours
# again with TORCHDDP_SHM=0 (Gloo over loopback alone, Python DDP's transport), then the peer. The
# figure of a run is its epochs' mean samples/s (over all ranks, as both programs print it).
set -u -o pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
usage() { sed -n '2,/^set -u/{/^#/p}' "$0" >&2; exit 2; }

[[ $# -ge 1 && $1 != -* ]] || usage
main_job=$1
shift
# The wheel's venv, else the first Python on PATH or Debian's that has torch.
for python in "${DDP_WHEEL_VENV:-$repo/.venv-torch}/bin/python" python3 /usr/bin/python3; do
  "$python" -c 'import torch' >/dev/null 2>&1 && break
done
epochs=1
if [[ $# -ge 1 && $1 != -- ]]; then python=$1; shift; fi
if [[ $# -ge 1 && $1 != -- ]]; then epochs=$1; shift; fi
[[ $# -ge 1 && $1 == -- ]] && shift
flags=("$@")

[[ -x $main_job ]] || { echo "main_job_vs_python.sh: $main_job is not an executable (build the target train_fashion_mnist)" >&2; exit 2; }
build=$(cd "$(dirname "$main_job")/../.." && pwd)
ddprun=${DDPRUN:-$build/launch/ddprun}
[[ -x $ddprun ]] || { echo "main_job_vs_python.sh: no ddprun at $ddprun (build the target ddprun, or set DDPRUN)" >&2; exit 2; }
torch_version=$("$python" -c 'import warnings; warnings.simplefilter("ignore"); import torch; print(torch.__version__)' 2>/dev/null) ||
  { echo "main_job_vs_python.sh: $python cannot import torch (give the Python of a torch install)" >&2; exit 2; }
libtorch_version=$(cat "$build/libtorch_version.txt" 2>/dev/null || echo "unknown (no $build/libtorch_version.txt)")
rounds=${ROUNDS:-2} worlds=${WORLDS:-2 1} run_timeout=${RUN_TIMEOUT:-1800}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "main job: $main_job (LibTorch $libtorch_version), ddprun: $ddprun"
echo "peer: $repo/benchmarks/python_peer/train_fashion_mnist.py, $python (torch $torch_version)"
echo "epochs $epochs, rounds $rounds, worlds $worlds, OMP_NUM_THREADS=$OMP_NUM_THREADS, flags: ${flags[*]:-(none)}"

# Runs one job (variant $1 at world $2); appends "variant world samples/s test-accuracy" to $results.
results=$(mktemp)
trap 'rm -f "$results"' EXIT
run() {
  local variant=$1 world=$2 out
  local args=(--epochs "$epochs" "${flags[@]}")
  case $variant in
    ours) out=$(timeout "$run_timeout" "$ddprun" --standalone --nproc-per-node "$world" -- "$main_job" "${args[@]}" 2>&1) ;;
    ours_gloo) out=$(TORCHDDP_SHM=0 timeout "$run_timeout" "$ddprun" --standalone --nproc-per-node "$world" -- "$main_job" "${args[@]}" 2>&1) ;;
    python) out=$(timeout "$run_timeout" bash "$repo/benchmarks/python_peer/run_peer.sh" "$world" "$python" "${args[@]}" 2>&1) ;;
  esac
  local code=$?
  # Both print rank 0's "epoch E/N: ... | test loss L acc A% (10000 samples) | S samples/s, T s" (ddprun
  # prefixes "[rank 0] ").
  local lines
  lines=$(grep -Eo 'epoch [0-9]+/[0-9]+: train loss .* samples/s' <<<"$out")
  if [[ $code != 0 || -z $lines ]]; then
    printf 'main_job_vs_python.sh: %s at world %s failed (exit code %s):\n%s\n' "$variant" "$world" "$code" "$out" >&2
    exit 1
  fi
  local figure
  figure=$(awk '{ for (i = 1; i < NF; i++) if ($(i + 1) == "samples/s") { s += $i; n++ }
                  for (i = 1; i < NF; i++) if ($i == "acc") a = $(i + 1) }
                END { printf "%.0f %s", s / n, a }' <<<"$lines")
  echo "$variant $world $figure" >>"$results"
  printf '  world %s %-9s %s samples/s, last test acc %s\n' "$world" "$variant" ${figure}
}

for world in $worlds; do
  variants=(ours python)
  [[ $world -gt 1 ]] && variants=(ours ours_gloo python)
  for ((round = 1; round <= rounds; round++)); do
    echo "world $world, round $round/$rounds"
    for variant in "${variants[@]}"; do run "$variant" "$world"; done
  done
done

echo
echo "main job (LibTorch $libtorch_version) vs Python DDP (torch $torch_version), $epochs epoch(s), samples/s per run:"
echo
echo "| world | ours (gloo+shm) | ours (Gloo alone) | Python DDP | ours / Python (mean) | ours Gloo alone / Python (mean) |"
echo "| --- | --- | --- | --- | --- | --- |"
awk '
  { runs[$2, $1] = runs[$2, $1] (runs[$2, $1] == "" ? "" : ", ") $3; sum[$2, $1] += $3; n[$2, $1]++; seen[$2] = 1 }
  function mean(w, v) { return n[w, v] ? sum[w, v] / n[w, v] : 0 }
  function ratio(w, v) { return n[w, v] && mean(w, "python") ? sprintf("%.2f", mean(w, v) / mean(w, "python")) : "-" }
  function cell(w, v) { return n[w, v] ? runs[w, v] : "-" }
  END {
    for (w in seen) printf "| %s | %s | %s | %s | %s | %s |\n", w, cell(w, "ours"), cell(w, "ours_gloo"),
                           cell(w, "python"), ratio(w, "ours"), ratio(w, "ours_gloo")
  }' "$results" | sort -t'|' -k2,2nr
