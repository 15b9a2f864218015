#!/usr/bin/env bash
# The main job's Python peer (benchmarks/python_peer/train_fashion_mnist.py, PyTorch's own DDP) on
# a small slice, at 2 ranks, under the torchrun of the torch this build's LibTorch comes from
# ($DDP_PYTHON, set by tests/CMakeLists.txt for the torch wheel's venv; else the first of python3
# and /usr/bin/python3 that has torch):
#   python_peer_test.sh trains              its lines parse as the main job's do, and the training
#                                           loss goes down from epoch 1 to epoch 2
#   python_peer_test.sh same_figures DDPRUN TRAIN
#                                           it prints the main job's figures (losses and accuracies;
#                                           not samples/s): the same initialization, data, order,
#                                           optimizer and evaluation, so a throughput comparison
#                                           compares the same work
# torch 1.x's torchrun cannot start processes on Python 3.11 (Debian bookworm): there the ranks are
# started by hand, and benchmarks/python_peer/run_peer.sh says so in the output.
# Exit 0: pass; 1: fail (with the reason and the output); 77: skipped (no torch for Python).
set -u -o pipefail
mode=$1
shift
peer=$(cd "$(dirname "$0")/../../benchmarks/python_peer" && pwd)/run_peer.sh

fail() {
  echo "FAIL: $1"
  printf -- '--- output ---\n%s\n' "${out:-}"
  exit 1
}

# The first interpreter that has torch, as tests/checkpoint/test_python_interop.cpp looks for it.
version=
for python in ${DDP_PYTHON:+"$DDP_PYTHON"} python3 /usr/bin/python3; do
  version=$("$python" -c 'import warnings; warnings.simplefilter("ignore"); import torch; print(torch.__version__)' 2>/dev/null) &&
    break
done
[[ -n $version ]] || { echo "SKIP: no Python with torch (\$DDP_PYTHON, python3, /usr/bin/python3; Debian: python3-torch)"; exit 77; }
echo "peer: $python (torch $version)"
# Debian's torch 2.6 has no libuv, and under its torchrun the ranks' env:// rendezvous still asks
# TCPStore for it, past tools/torch_without_libuv.sh's shim (2026-11-26: not solved yet).
if [[ $version == 2.* ]] && ! "$python" -c 'import torch.distributed as d; d.TCPStore("127.0.0.1", 0, 1, True)' >/dev/null 2>&1; then
  echo "SKIP: torch $version was built without libuv and its torchrun's ranks request it (Debian's 2.6); the peer runs at 1.13 and 2.15"
  exit 77
fi

small=(--epochs 2 --limit-train 640 --batch-size 32 --timeout 120)
out=$(timeout 240 bash "$peer" 2 "$python" "${small[@]}" 2>&1) || fail "exit code $? from run_peer.sh"
grep -q "world 2 (gloo)" <<<"$out" || fail "the peer did not run as a world of 2"
# The main job's epoch line (tests/data/main_job_test.sh), which benchmarks/main_job_vs_python.sh reads.
epoch_line='epoch [12]/2: train loss [0-9.]+ acc [0-9.]+% \| test loss [0-9.]+ acc [0-9.]+% \(10000 samples\) \| [0-9]+ samples/s, [0-9.]+ s'
[[ $(grep -Ec "^$epoch_line$" <<<"$out") == 2 ]] || fail "not two epoch lines of the main job's form"

case $mode in
  trains)
    losses=($(grep -Eo '^epoch [12]/2: train loss [0-9.]+' <<<"$out" | awk '{ print $5 }'))
    awk -v a="${losses[0]}" -v b="${losses[1]}" 'BEGIN { exit !(b < a) }' ||
      fail "the training loss did not go down: ${losses[0]} then ${losses[1]}"
    echo "PASS: trains (train loss ${losses[0]} -> ${losses[1]})"$'\n'"$out"
    ;;

  same_figures)
    ddprun=$1 train=$2
    figures() { grep -Eo 'epoch [12]/2: train loss [0-9.]+ acc [0-9.]+% \| test loss [0-9.]+ acc [0-9.]+%' <<<"$1"; }
    expected=$(figures "$out")
    out=$(timeout 240 "$ddprun" --standalone --nproc-per-node 2 -- "$train" "${small[@]}" 2>&1) ||
      fail "exit code $? from the main job under ddprun"
    [[ $(figures "$out") == "$expected" ]] ||
      fail "the peer's figures differ from the main job's:"$'\n'"$expected"$'\n'"vs"$'\n'"$(figures "$out")"
    echo "PASS: same_figures"$'\n'"$expected"
    ;;

  *) fail "unknown mode $mode" ;;
esac
