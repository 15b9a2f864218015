#!/usr/bin/env bash
# Starts the Python peer of the main job (train_fashion_mnist.py beside this script) on one host.
#
#   run_peer.sh NPROC PYTHON [train_fashion_mnist.py's flags...]
#
# torch 2.x: under that Python's torchrun (the `torchrun` beside it, else `PYTHON -m
# torch.distributed.run`, the same entry point), one node, NPROC ranks, static rendezvous.
# torch 1.x: Debian bookworm's torchrun 1.13 fails by itself on Python 3.11 ('NoneType' object has
# no attribute 'get' in torch/distributed/elastic/multiprocessing) before any rank starts, so the
# ranks are started here the way torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT;
# OMP_NUM_THREADS=1 with more than one rank unless set), and it says so on stderr.
# Exit code: the first failing rank's, else 0.
set -u -o pipefail
nproc=$1 python=$2
shift 2
peer=$(dirname "$0")/train_fashion_mnist.py
version=$("$python" -c 'import warnings; warnings.simplefilter("ignore"); import torch; print(torch.__version__)') ||
  { echo "run_peer.sh: $python cannot import torch" >&2; exit 1; }

if [[ $version != 1.* ]]; then
  torchrun=$(dirname "$python")/torchrun
  [[ -x $torchrun ]] || torchrun="$python -m torch.distributed.run"
  # Debian's torch 2.6 asks TCPStore for libuv it was built without (tools/torch_without_libuv.sh).
  source "$(dirname "$0")/../../tools/torch_without_libuv.sh"
  torch_without_libuv "$python"
  # torchrun's static rendezvous (its agent hosts the store), as the main job's torchrun test:
  # --standalone's c10d rendezvous did not start the ranks under Debian's 2.6 with the shim.
  $torchrun --nnodes 1 --nproc-per-node "$nproc" --master-addr 127.0.0.1 --master-port $((20000 + RANDOM % 20000)) \
    "$peer" "$@"
  exit $?  # not exec: the shim's folder is removed at exit
fi

echo "run_peer.sh: torch $version's torchrun cannot start processes on this Python; starting the $nproc" \
     "rank(s) by hand (env://)" >&2
[[ $nproc -gt 1 ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + RANDOM % 20000)) WORLD_SIZE=$nproc LOCAL_WORLD_SIZE=$nproc
pids=()
# Stopped (a caller's timeout) or failed: end the ranks rather than leave them running.
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
trap 'exit 143' TERM INT
for ((rank = 0; rank < nproc; rank++)); do
  RANK=$rank LOCAL_RANK=$rank "$python" "$peer" "$@" &
  pids+=($!)
done
# Wait for every rank; when one fails, end the others rather than leave them waiting on it.
status=0
for _ in "${pids[@]}"; do
  wait -n
  code=$?
  if [[ $code != 0 && $status == 0 ]]; then
    status=$code
    kill "${pids[@]}" 2>/dev/null
  fi
done
exit $status
