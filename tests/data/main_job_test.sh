#!/usr/bin/env bash
# The main job (examples/train_fashion_mnist) end to end, one scenario per CTest entry:
#   main_job_test.sh ddprun2 DDPRUN TRAIN   2 ranks under ddprun: the epoch line with the exact
#                                           test-set count and a throughput
#   main_job_test.sh ddprun3 DDPRUN TRAIN   3 ranks: 10000 % 3 != 0, so the shards differ in size;
#                                           the count must still be exactly 10000
#   main_job_test.sh mpirun DDPRUN TRAIN    2 ranks under Open MPI's mpirun (MASTER_ADDR/PORT exported):
#                                           the same loss and accuracy lines as under ddprun
#   main_job_test.sh torchrun DDPRUN TRAIN  the same under torchrun 2.x (its agent hosts the store)
#   main_job_test.sh srun DDPRUN TRAIN      the same under `srun -n 2` of a real one-node Slurm cluster
#                                           (slurm_cluster.sh, torn down on exit), then the README's
#                                           sbatch script
#   main_job_test.sh progress TRAIN         a progress bar on a terminal (util-linux `script`),
#                                           plain lines when piped
#   main_job_test.sh progress_ddprun DDPRUN TRAIN
#                                           the same under ddprun: rank 0's bar on ddprun's terminal
#   main_job_test.sh resume TRAIN           --checkpoint-dir: a first run in an empty directory says it
#                                           starts from scratch, a second run resumes after epoch 1
#   main_job_test.sh killed_on_shm DDPRUN TRAIN
#                                           a rank SIGKILLed on gloo+shm: ddprun exits non-zero naming
#                                           it, and /dev/shm holds nothing of the job
#   main_job_test.sh frozen DDPRUN TRAIN    a rank frozen by SIGSTOP ends the job within --timeout
#   main_job_test.sh frozen_store_host DDPRUN TRAIN
#                                           the same for rank 0, which hosts the store
#   main_job_test.sh frozen_store_host_at_start TRAIN
#                                           rank 0 frozen while rank 1 joins: rank 1 ends naming it
#   main_job_test.sh refusals TRAIN         bad flags (NaN, inf, out of range, not whole, too many
#                                           threads, an unknown backend or init method, a data or
#                                           checkpoint directory that cannot be one) exit 2 naming the
#                                           flag and the rule, before the process group or the data
#   main_job_test.sh nonfinite TRAIN        a loss that is not finite (--lr 1e20) stops the job at that
#                                           step, exit 1, naming it and --lr; --allow-nonfinite goes on
#   main_job_test.sh filestore TRAIN        2 ranks started by hand (RANK, WORLD_SIZE) meeting over
#                                           --init-method file://: the Windows launch path (no launcher,
#                                           no TCP store), run here on Linux
#   main_job_test.sh zero DDPRUN TRAIN      --zero (Adam's state sharded, ZeroRedundancyOptimizer): 2
#                                           epochs at 2 ranks, the second resumed from the first's
#                                           checkpoint, print the same figures as plain Adam straight
#   main_job_test.sh fsdp DDPRUN TRAIN      --fsdp (ddp::fully_shard): 2 epochs at 2 ranks, the second
#                                           resumed from the first's checkpoint, print DDP's figures
#                                           straight (at 2 ranks the same sums: halving is exact)
#   main_job_test.sh fsdp_sharded DDPRUN TRAIN
#                                           the same with --sharded-checkpoint: each epoch's checkpoint
#                                           is an index and one file per rank, and the resume reads it;
#                                           without --fsdp the flag exits 2
#   main_job_test.sh identity DDPRUN TRAIN  a checkpoint names the run that wrote it: another run
#                                           resumes it only with --resume-from-other-run; a restart
#                                           by ddprun --max-restarts (same run id) resumes
# Exit 0: pass; 1: fail (with the reason and the output); 77: skipped (CTest SKIP_RETURN_CODE).
set -u -o pipefail
mode=$1
shift

fail() {
  echo "FAIL: $1"
  printf -- '--- output ---\n%s\n' "${out:-}"
  exit 1
}

# Waits at most $1 s for ddprun ($launcher, output in $log) to end after what $2 says happened
# just now; sets took (seconds), out (its output) and code (its exit code).
await_launcher() {
  local since=$SECONDS
  for _ in $(seq $(($1 * 10))); do kill -0 $launcher 2>/dev/null || break; sleep 0.1; done
  took=$((SECONDS - since))
  out=$(cat "$log")
  kill -0 $launcher 2>/dev/null && fail "ddprun still running $1 s after $2"
  wait $launcher
  code=$?
}

# A small slice of the training set keeps each run short; evaluation always uses all 10000.
small=(--limit-train 640 --batch-size 32)
epoch_line='epoch 1/1: train loss [0-9.]+ acc [0-9.]+% \| test loss [0-9.]+ acc [0-9.]+% \(10000 samples\) \| [0-9]+ samples/s'

case $mode in
  ddprun2 | ddprun3)
    ddprun=$1 train=$2
    nproc=${mode#ddprun}
    out=$("$ddprun" --standalone --nproc-per-node "$nproc" -- "$train" --epochs 1 "${small[@]}" 2>&1) ||
      fail "exit code $? from ddprun"
    grep -q "world $nproc (gloo+shm)" <<<"$out" || fail "the job did not run as a world of $nproc"
    # ddprun prefixes rank 0's lines with "[rank 0] ".
    grep -Eq "^\[rank 0\] $epoch_line" <<<"$out" || fail "no epoch line with (10000 samples) and samples/s"
    ;;

  mpirun | torchrun | srun)
    ddprun=$1 train=$2
    # The figures of each epoch without the throughput, which differs run to run.
    figures() { grep -Eo 'epoch [0-9]/2: train loss [0-9.]+ acc [0-9.]+% \| test loss [0-9.]+ acc [0-9.]+% \(10000 samples\)' <<<"$1"; }
    port=$((20000 + RANDOM % 20000))
    if [[ $mode == mpirun ]]; then
      if ! command -v mpirun >/dev/null 2>&1; then
        echo "SKIP: Open MPI's mpirun is not installed (Debian: openmpi-bin; scripts/setup.sh installs it)"
        exit 77
      fi
      # Running as root (containers, CI) needs mpirun's explicit consent. MPI knows no master.
      root=()
      [[ $(id -u) == 0 ]] && root=(--allow-run-as-root)
      engine=(mpirun "${root[@]}" --oversubscribe -n 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$port)
      says="world of 2 from Open MPI"
    elif [[ $mode == srun ]]; then
      if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
        echo "SKIP: Slurm is not installed (Debian: slurm-wlm and munge; scripts/setup.sh installs them)"
        exit 77
      fi
      if [[ $(id -u) != 0 ]]; then
        echo "SKIP: the test's Slurm cluster runs its daemons as root; run as root (CI does)"
        exit 77
      fi
      source "$(dirname "$0")/slurm_cluster.sh"
      trap stop_slurm EXIT
      start_slurm
      engine=(srun -n 2 --time=5)
      says="world of 2 from Slurm"
    else
      # The torchrun beside $DDP_PYTHON, the Python whose torch this build's LibTorch is (the
      # torch wheel's venv: tests/CMakeLists.txt sets it), else the one on PATH.
      python=python3 torchrun=torchrun
      if [[ -n ${DDP_PYTHON:-} ]]; then
        python=$DDP_PYTHON torchrun=$(dirname "$DDP_PYTHON")/torchrun
      fi
      version=$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null | tail -n1)
      if ! command -v "$torchrun" >/dev/null 2>&1 || [[ -z $version ]]; then
        echo "SKIP: torchrun is not installed (Debian: python3-torch; the LibTorch 2.6 chroot has it;" \
             "scripts/libtorch_wheel.sh's venv has the torch wheel's)"
        exit 77
      fi
      echo "torchrun: $torchrun (torch $version)"
      if [[ $version == 1.* ]]; then
        # Bookworm's torchrun 1.13 fails by itself on Python 3.11 (AttributeError: 'NoneType' object
        # has no attribute 'get' in torch/distributed/elastic/multiprocessing), before any rank starts.
        echo "SKIP: torchrun $version cannot start processes on this Python; torchrun 2.x runs this test (chroot)"
        exit 77
      fi
      # Debian's torch 2.6 asks TCPStore for libuv it was built without (tools/torch_without_libuv.sh).
      source "$(dirname "$0")/../../tools/torch_without_libuv.sh"
      torch_without_libuv "$python"
      # torchrun's default static rendezvous: its agent hosts the store at MASTER_ADDR:MASTER_PORT
      # and tells the ranks TORCHELASTIC_USE_AGENT_STORE=True (every rank connects as a client).
      engine=("$torchrun" --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port $port --no-python)
      says="world 2 (gloo+shm)"
    fi
    out=$(timeout 240 "$ddprun" --standalone --nproc-per-node 2 -- "$train" --epochs 2 "${small[@]}" 2>&1) ||
      fail "exit code $? from ddprun"
    expected=$(figures "$out")
    [[ $(wc -l <<<"$expected") == 2 ]] || fail "ddprun's run has no two epoch lines"
    out=$(timeout 240 "${engine[@]}" "$train" --epochs 2 "${small[@]}" 2>&1) || fail "exit code $? from $mode"
    grep -q "$says" <<<"$out" || fail "no '$says' line under $mode"
    [[ $(figures "$out") == "$expected" ]] ||
      fail "$mode's figures differ from ddprun's:"$'\n'"$expected"$'\n'"vs"$'\n'"$(figures "$out")"
    if [[ $mode == srun ]]; then
      # The README's sbatch script: the batch step starts the ranks with srun.
      printf '%s\n' '#!/bin/bash' '#SBATCH --job-name=train --ntasks=2 --time=00:05:00' \
        "srun $train --epochs 2 ${small[*]}" >"$cluster/job.sh"
      timeout 240 sbatch --wait -o "$cluster/job.out" "$cluster/job.sh" >/dev/null ||
        { code=$?; out=$(cat "$cluster/job.out" 2>&1); fail "sbatch --wait: exit code $code"; }
      out=$(cat "$cluster/job.out")
      [[ $(figures "$out") == "$expected" ]] || fail "the sbatch job's figures differ from ddprun's"
    fi
    ;;

  frozen_store_host_at_start)
    # Rank 0, started by hand, hosts the store and waits for rank 1; it is frozen before rank 1
    # joins. Rank 1's connection completes in rank 0's kernel, but no call is ever answered: it
    # must give up within its --timeout (plus the store's slack) and name rank 0.
    train=$1
    port=$((20000 + RANDOM % 20000))
    log0=$(mktemp)
    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$train" --epochs 1 --timeout 5 >"$log0" 2>&1 &
    rank0=$!
    trap 'kill -KILL $rank0 2>/dev/null; rm -f "$log0"' EXIT
    for _ in $(seq 300); do ss -ltn "sport = :$port" | grep -q LISTEN && break; sleep 0.1; done
    ss -ltn "sport = :$port" | grep -q LISTEN || { out=$(cat "$log0"); fail "rank 0 never listened on port $port"; }
    kill -STOP $rank0
    start=$SECONDS
    out=$(RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 120 "$train" --epochs 1 --timeout 5 2>&1)
    code=$?
    took=$((SECONDS - start))
    [[ $code != 124 ]] || fail "rank 1 still waited 120 s after rank 0 froze"
    [[ $code != 0 ]] || fail "rank 1 succeeded without rank 0"
    ((took <= 30)) || fail "rank 1 ended $took s after starting; --timeout was 5 s"
    grep -q "the store hosted by rank 0 at 127.0.0.1:$port did not answer" <<<"$out" || fail "rank 1 did not name rank 0's store"
    grep -m1 "did not answer" <<<"$out"
    echo "rank 1 ended $took s after it started, rank 0 frozen (--timeout 5), exit code $code"
    ;;

  killed_on_shm)
    # SIGKILL of a rank mid-epoch on the shared-memory transport, each rank in turn: ddprun ends
    # the job with a non-zero code naming the killed rank, within seconds, and /dev/shm holds
    # nothing of the job afterwards (the segments are unlinked once every rank has mapped them).
    ddprun=$1 train=$2
    for victim in 0 1; do
      log=$(mktemp)
      "$ddprun" --standalone --nproc-per-node 2 --grace-period 2 -- "$train" --epochs 1 --timeout 20 >"$log" 2>&1 &
      launcher=$!
      trap 'kill -KILL $launcher 2>/dev/null; rm -f "$log"' EXIT
      for _ in $(seq 600); do grep -q "world 2 (gloo+shm)" "$log" && break; sleep 0.1; done
      grep -q "world 2 (gloo+shm)" "$log" || { out=$(cat "$log"); fail "the job did not start on gloo+shm"; }
      sleep 1  # into the first epoch
      victim_pid="" run_id=""
      for pid in $(pgrep -P $launcher); do
        environ=$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null)
        grep -qx RANK=$victim <<<"$environ" && victim_pid=$pid && run_id=$(sed -n 's/^TORCHDDP_RUN_ID=//p' <<<"$environ")
      done
      [[ -n $victim_pid && -n $run_id ]] || { out=$(cat "$log"); fail "rank $victim's process or run id not found"; }
      ls /dev/shm | grep -q "^torchddp-$run_id" && { out=$(cat "$log"); fail "segments of the job stayed in /dev/shm while it ran"; }
      kill -KILL "$victim_pid"
      await_launcher 30 "rank $victim was killed"
      [[ $code != 0 ]] || fail "ddprun exited 0 although rank $victim was killed"
      grep -q "rank $victim (local rank $victim on node 0, pid $victim_pid) was killed by signal 9 (SIGKILL)" <<<"$out" ||
        fail "ddprun did not name rank $victim as killed"
      left=$(ls /dev/shm | grep "^torchddp-$run_id" || true)
      [[ -z $left ]] || fail "left in /dev/shm after the job: $left"
      ((took <= 10)) || fail "the job ended $took s after rank $victim was killed"
      echo "rank $victim killed: ddprun exited $code after $took s, nothing of run $run_id left in /dev/shm"
      rm -f "$log"
    done
    trap - EXIT
    ;;

  frozen | frozen_store_host)
    # A rank frozen mid-training (SIGSTOP): with --timeout 5 the job ends within seconds, the other
    # rank naming the collective that timed out and the frozen one, instead of waiting PyTorch's
    # default 30 minutes. Rank 0 also hosts the store: the stall check, which reads the others'
    # heartbeats there, must not wait for it forever (bounded_store.h).
    ddprun=$1 train=$2
    victim=1
    [[ $mode == frozen_store_host ]] && victim=0
    log=$(mktemp)
    "$ddprun" --standalone --nproc-per-node 2 --grace-period 2 -- "$train" --epochs 1 --timeout 5 >"$log" 2>&1 &
    launcher=$!
    frozen_pid=""
    trap 'kill -KILL $frozen_pid $launcher 2>/dev/null; rm -f "$log"' EXIT
    for _ in $(seq 600); do grep -q "world 2 (gloo+shm)" "$log" && break; sleep 0.1; done
    grep -q "world 2 (gloo+shm)" "$log" || { out=$(cat "$log"); fail "the job did not start"; }
    sleep 1  # into the first epoch
    for pid in $(pgrep -P $launcher); do
      tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx RANK=$victim && frozen_pid=$pid
    done
    [[ -n $frozen_pid ]] || { out=$(cat "$log"); fail "rank $victim's process not found"; }
    kill -STOP "$frozen_pid"
    await_launcher 120 "rank $victim froze"
    [[ $code != 0 ]] || fail "the job succeeded with a frozen rank"
    ((took <= 30)) || fail "the job ended $took s after rank $victim froze; --timeout was 5 s"
    grep -q "hung past the timeout" <<<"$out" || fail "no rank said a peer hung past the timeout"
    if ((victim == 1)); then
      # The stall check (heartbeat.h) names the frozen rank.
      grep -q "Stall check: rank 1 stopped (no heartbeat for 2.5 s" <<<"$out" || fail "rank 0 did not name rank 1 as stopped"
    else
      # The heartbeats live in the frozen rank's store: the check says it does not answer.
      grep -q "Stall check: the store is unreachable (the store hosted by rank 0 at 127.0.0.1:[0-9]* did not answer" <<<"$out" ||
        fail "rank 1 did not name rank 0's store as not answering"
    fi
    grep -m1 "Stall check" <<<"$out"
    echo "the job ended $took s after rank $victim froze (--timeout 5), exit code $code"
    ;;

  progress)
    train=$1
    if ! command -v script >/dev/null 2>&1; then
      echo "SKIP: util-linux 'script' is not installed, so no terminal can be given to the program"
      exit 77
    fi
    # The bar is redrawn with "\r" and ends at 100% (its last update is never throttled).
    bar='epoch 1/1 \[#{30}\] 100% loss [0-9.]+'
    cmd=$(printf '%q ' "$train" --epochs 1 "${small[@]}")
    out=$(script -qec "$cmd" /dev/null 2>&1) || fail "exit code $? under script"
    grep -Eq "$epoch_line" <<<"$out" || fail "no epoch line on the terminal"
    grep -Eq $'\r'"$bar" <<<"$out" || fail "no progress bar redrawn with a carriage return on a terminal"
    grep -q $'\r\033\\[K' <<<"$out" || fail "the bar is not cleared before the epoch line"
    out=$("$train" --epochs 1 "${small[@]}" 2>&1 | cat) || fail "exit code $? when piped"
    grep -Eq "^$epoch_line" <<<"$out" || fail "no plain epoch line when piped"
    [[ $out == *$'\r'* ]] && fail "carriage returns in piped output"
    grep -Eq "$bar" <<<"$out" && fail "a progress bar in piped output"
    ;;

  progress_ddprun)
    # Under ddprun on a terminal the rank's stdout is a pipe, but ddprun shows its redraws live and
    # says so (DDPRUN_TERMINAL=1): rank 0's bar reaches the terminal behind its prefix. Piped, none.
    ddprun=$1 train=$2
    if ! command -v script >/dev/null 2>&1; then
      echo "SKIP: util-linux 'script' is not installed, so no terminal can be given to ddprun"
      exit 77
    fi
    # Any state of the bar: ddprun shows the latest redraw it has read, and the last one (100%) can
    # reach it in one read with the clear that follows, which then leaves nothing to show.
    bar='epoch 1/1 \[#*\.*\] +[0-9]+% loss [0-9.]+'
    job=(env -u _STDBUF_O -u LD_PRELOAD -u DDPRUN_TERMINAL "$ddprun" --standalone --nproc-per-node 2 --
         "$train" --epochs 1 "${small[@]}")
    cmd=$(printf '%q ' "${job[@]}")
    out=$(timeout -k 5 120 script -qec "$cmd" /dev/null 2>&1) || fail "exit code $? under script"
    grep -Eq "$epoch_line" <<<"$out" || fail "no epoch line on the terminal"
    grep -Eq $'\r'"\[rank 0\] $bar" <<<"$out" || fail "no progress bar of rank 0 redrawn on ddprun's terminal"
    grep -Eq "\[rank 1\] epoch 1/1 \[#" <<<"$out" && fail "rank 1 drew a bar too"
    out=$(timeout -k 5 120 "${job[@]}" 2>&1 | cat) || fail "exit code $? when piped"
    grep -Eq "$epoch_line" <<<"$out" || fail "no epoch line when piped"
    grep -Eq "$bar" <<<"$out" && fail "a progress bar in piped output"
    ;;

  resume)
    train=$1
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    # Both starts are one run (--run-id): a checkpoint of another run is not resumed (identity).
    out=$("$train" --epochs 1 "${small[@]}" --checkpoint-dir "$dir" --run-id resume-test 2>&1) || fail "first run: exit code $?"
    grep -q "resumed" <<<"$out" && fail "the first run resumed from an empty directory"
    grep -qx "no checkpoint in $dir yet: starting from scratch" <<<"$out" || fail "no notice of a fresh start in an empty directory"
    [ -f "$dir/checkpoint-00000001.pt" ] || fail "no checkpoint-00000001.pt after epoch 1: $(ls "$dir")"
    out=$("$train" --epochs 2 "${small[@]}" --checkpoint-dir "$dir" --run-id resume-test 2>&1) || fail "second run: exit code $?"
    grep -qx "resumed from $dir/checkpoint-00000001.pt at epoch 2" <<<"$out" || fail "no 'resumed from ... at epoch 2'"
    grep -q "^epoch 1/2" <<<"$out" && fail "epoch 1 trained again after resuming"
    grep -Eq "^epoch 2/2: train loss [0-9.]+ .*\(10000 samples\)" <<<"$out" || fail "epoch 2 not trained"
    [ "$(grep -c '^epoch [0-9]*/2:' <<<"$out")" = 1 ] || fail "expected exactly one epoch line"
    [ -f "$dir/checkpoint-00000002.pt" ] || fail "no checkpoint-00000002.pt after epoch 2: $(ls "$dir")"
    ;;

  zero|fsdp|fsdp_sharded)
    ddprun=$1 train=$2
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    # --zero or --fsdp, epoch 1 then epoch 2 resumed from its checkpoint, against plain Adam through
    # DDP straight: the same figures (ZeRO steps what DDP averaged; fully_shard at 2 ranks sums the
    # same two numbers, and halving is exact).
    if [ "$mode" = zero ]; then
      flag=--zero named="optimizer Adam (ZeRO: state sharded over the ranks)"
    elif [ "$mode" = fsdp ]; then
      flag=--fsdp named="optimizer Adam (fully sharded: ddp::fully_shard)"
    else
      flag="--fsdp --sharded-checkpoint" named="optimizer Adam (fully sharded: ddp::fully_shard)"
    fi
    # A sharded checkpoint: its index and each rank's file.
    sharded_at() {
      for file in "$1" "$1.rank-0-of-2" "$1.rank-1-of-2"; do
        [ -f "$file" ] || fail "$flag: no $file: $(ls "$dir")"
      done
      local whole
      whole=$("$train" --epochs 1 --limit-train 64 --checkpoint-dir "$dir" 2>&1)
      grep -q "$1 is sharded" <<<"$whole" || fail "$flag: a run without --fsdp did not refuse $1 as sharded: $whole"
    }
    # The figures of each epoch without the throughput (it differs run to run) and the epoch count.
    figures() {
      grep -Eo 'epoch [0-9]/[0-9]: train loss [0-9.]+ acc [0-9.]+% \| test loss [0-9.]+ acc [0-9.]+% \(10000 samples\)' <<<"$1" |
        sed 's#/[0-9]:#:#'
    }
    run2() { "$ddprun" --standalone --nproc-per-node 2 -- "$train" "${small[@]}" "$@" 2>&1; }
    out=$(run2 --epochs 2) || fail "plain Adam: exit code $?"
    plain=$(figures "$out")
    [ "$(wc -l <<<"$plain")" = 2 ] || fail "plain Adam: expected two epoch lines"
    out=$(run2 --epochs 1 $flag --checkpoint-dir "$dir" --run-id $mode-test) || fail "$flag, epoch 1: exit code $?"
    grep -q "$named" <<<"$out" || fail "$flag not named on the first line"
    first=$(figures "$out")
    [ "$mode" = fsdp_sharded ] && sharded_at "$dir/checkpoint-00000001.pt"
    out=$(run2 --epochs 2 $flag --checkpoint-dir "$dir" --run-id $mode-test) || fail "$flag, epoch 2: exit code $?"
    grep -q "resumed from $dir/checkpoint-00000001.pt at epoch 2" <<<"$out" || fail "$flag did not resume its checkpoint"
    resumed=$(printf '%s\n%s' "$first" "$(figures "$out")")
    [ "$resumed" = "$plain" ] || fail "$flag's figures differ from plain Adam's: $resumed vs $plain"
    if [ "$mode" = fsdp_sharded ]; then
      sharded_at "$dir/checkpoint-00000002.pt"
      out=$("$train" --sharded-checkpoint --checkpoint-dir "$dir" 2>&1); code=$?
      [ $code = 2 ] && grep -q -- "--sharded-checkpoint saves the shards of --fsdp" <<<"$out" ||
        fail "--sharded-checkpoint without --fsdp: exit $code, $out"
    fi
    if [ "$mode" = fsdp ]; then
      out=$("$train" --fsdp --zero 2>&1); code=$?
      [ $code = 2 ] && grep -q "does not combine with --zero" <<<"$out" || fail "--fsdp --zero: exit $code, $out"
    fi
    echo "PASS: $mode"
    ;;

  refusals)
    train=$1
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    touch "$dir/a-file"
    # refused ARGS... EXPECTED-REGEX: exit code 2, the rule on stderr, and nothing started: no
    # process group (its "[torchddp]" line), no data loaded, no training.
    refused() {
      local expected=${*: -1}
      out=$(timeout 60 "$train" "${@:1:$#-1}" 2>&1)
      local code=$?
      [[ $code == 2 ]] || fail "'${*:1:$#-1}': exit code $code, expected 2"
      grep -Eq -- "$expected" <<<"$out" || fail "'${*:1:$#-1}': no '$expected'"
      grep -q "^\[torchddp\]\|train_fashion_mnist: world\|Fashion-MNIST" <<<"$out" && fail "'${*:1:$#-1}': the job started"
      echo "refused '${*:1:$#-1}': $(head -n1 <<<"$out")"
    }
    refused --timeout nan "^--timeout: must be a finite number of seconds from 1 to 604800, got 'nan'$"
    refused --device tpu "^--device: must be cpu, cuda or cuda:N, got 'tpu'$"
    refused --device cuda:99 "^--device: ('cuda:99' needs a CUDA GPU, and this process sees none \\(use cpu\\)|'cuda:99': the GPUs this process sees are cuda:0 to cuda:[0-9]+)$"
    lr_rule="must be a finite number above 0 and at most 1e\\+37 \\(Adam's first step, 10 x lr, must fit the parameters' 32-bit floats\\)"
    refused --lr inf "^--lr: $lr_rule, got 'inf'$"
    refused --lr nan "^--lr: $lr_rule, got 'nan'$"
    refused --lr 1e308 "^--lr: $lr_rule, got '1e308'$"
    refused --threads 100000 "^--threads: must be a whole number from 1 to [0-9]+ \\(4 x the [0-9]+ CPUs this process may run on: more threads than CPUs only take turns\\), got '100000'$"
    refused --threads 1.5 "^--threads: must be a whole number from 1 to [0-9]+ .*, got '1.5'$"
    refused --epochs two "^--epochs: must be a whole number from 1 to 1048576, got 'two'$"
    refused --epochs 1e3 "^--epochs: must be a whole number from 1 to 1048576, got '1e3'$"
    refused --batch-size 99999999999999999999 "^--batch-size: must be a whole number from 1 to 1048576 \\(samples per rank\\), got '99999999999999999999'$"
    # Numbers CLI11 alone took as something else: -1 and an overflow as "all", an overflow as seed -1.
    refused --limit-train -1 "^--limit-train: must be a whole number from 0 to 60000 \\(0: all 60000 training samples\\), got '-1'$"
    refused --limit-train 99999999999999999999 "^--limit-train: must be a whole number from 0 to 60000 \\(0: all 60000 training samples\\), got '99999999999999999999'$"
    refused --seed 99999999999999999999 "^--seed: must be a whole number from -9223372036854775808 to 9223372036854775807, got '99999999999999999999'$"
    # Values the library refused only once the job had started (exit code 1, not naming the flag).
    cap_rule="must be a finite number of MiB from 0 to 1e\\+12 \\(a cap above the model's size already puts every gradient in one bucket\\)"
    refused --bucket-cap-mb 1e30 "^--bucket-cap-mb: $cap_rule, got '1e30'$"
    refused --first-bucket-cap-mb nan "^--first-bucket-cap-mb: $cap_rule, got 'nan'$"
    refused --backend xyz "^--backend: xyz not in \\{gloo,nccl,auto\\}$"
    init_rule="must be env://, tcp://HOST:PORT \\(a port from 1 to 65535\\) or file:///PATH"
    refused --init-method foo:// "^--init-method: $init_rule, got 'foo://'$"
    refused --init-method tcp://host:99999 "^--init-method: $init_rule, got 'tcp://host:99999'$"
    refused --data-dir /nonexistent "^--data-dir: cannot read '/nonexistent/train-images-idx3-ubyte.gz' \\(No such file or directory\\); install Debian's dataset-fashion-mnist package"
    refused --powersgd-rank 1e30 "^--powersgd-rank: must be a whole number from 1 to 1048576, got '1e30'$"
    refused --powersgd-start-iter nan "^--powersgd-start-iter: must be a whole number from 2 to 1073741824, got 'nan'$"
    refused --no-such-flag "The following argument was not expected: --no-such-flag"
    refused --checkpoint-dir "$dir/a-file" "^--checkpoint-dir: '$dir/a-file' exists and is not a directory: name a directory for the checkpoints$"
    refused --checkpoint-dir "$dir/a-file/sub" "^--checkpoint-dir: cannot create the directory '$dir/a-file/sub': Not a directory"
    # The edges of the rules run: the smallest seed, caps of 0 and 1e12 MiB, the largest --lr (its
    # loss turns NaN, allowed here, and LibTorch's Adam does not fail converting its step to float).
    out=$(timeout 120 "$train" --epochs 1 --limit-train 64 --batch-size 32 --seed -9223372036854775808 --bucket-cap-mb 0 \
            --first-bucket-cap-mb 1e12 --lr 1e37 --allow-nonfinite --init-method env:// --backend gloo 2>&1) ||
      fail "values at the edges of the rules: exit code $?"
    grep -q "^epoch 1/1: " <<<"$out" || fail "values at the edges of the rules: no epoch line"
    ;;

  nonfinite)
    # Adam at --lr 1e20 makes the loss NaN within a few steps: the job stops at the first, before
    # that step's update, instead of training to NaN and exiting 0.
    train=$1
    out=$(timeout 120 "$train" --epochs 2 "${small[@]}" --lr 1e20 2>&1)
    code=$?
    [[ $code == 1 ]] || fail "--lr 1e20: exit code $code, expected 1"
    grep -Eq "^train_fashion_mnist: error: epoch 1/2, step [0-9]+ \(rank 0\): the training loss is (nan|inf|-inf), not a finite number, so training stopped before this step's update; try a lower --lr \(this run's is 1e\+20\), or pass --allow-nonfinite to keep going$" <<<"$out" ||
      fail "--lr 1e20: no error naming the step, the loss and --lr"
    grep -q "^epoch 1/2:" <<<"$out" && fail "--lr 1e20: the epoch went on after the loss stopped being finite"
    grep -m1 "error:" <<<"$out"
    out=$(timeout 120 "$train" --epochs 1 "${small[@]}" --lr 1e20 --allow-nonfinite 2>&1) || fail "--allow-nonfinite: exit code $?"
    grep -Eq "^epoch 1/1: train loss -?nan " <<<"$out" || fail "--allow-nonfinite: no epoch line with a NaN loss"
    grep "^epoch" <<<"$out"
    ;;

  filestore)
    train=$1
    dir=$(mktemp -d)
    rank1=""
    trap 'kill -KILL $rank1 2>/dev/null; rm -rf "$dir"' EXIT
    # No MASTER_ADDR/MASTER_PORT: nothing but the file tells the ranks where to meet.
    unset MASTER_ADDR MASTER_PORT
    RANK=1 WORLD_SIZE=2 timeout 240 "$train" --init-method "file://$dir/store" --epochs 1 "${small[@]}" >"$dir/rank1.log" 2>&1 &
    rank1=$!
    out=$(RANK=0 WORLD_SIZE=2 timeout 240 "$train" --init-method "file://$dir/store" --epochs 1 "${small[@]}" 2>&1) ||
      fail "rank 0: exit code $?"
    wait $rank1 || { code=$?; out=$(cat "$dir/rank1.log"); fail "rank 1: exit code $code"; }
    grep -q "world 2 (" <<<"$out" || fail "the job did not run as a world of 2"
    grep -Eq "^$epoch_line" <<<"$out" || fail "no epoch line with (10000 samples) and samples/s"
    grep -E "^$epoch_line" <<<"$out"
    ;;

  identity)
    ddprun=$1 train=$2
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    out=$("$train" --epochs 1 "${small[@]}" --checkpoint-dir "$dir" --run-id alpha 2>&1) || fail "run alpha: exit code $?"
    # Another run (its own --run-id, or none at all) is refused before training, naming both runs.
    out=$("$train" --epochs 2 "${small[@]}" --checkpoint-dir "$dir" --run-id beta 2>&1)
    code=$?
    [[ $code == 1 ]] || fail "run beta on alpha's checkpoint: exit code $code, expected 1"
    grep -qx "train_fashion_mnist: error: $dir/checkpoint-00000001.pt was written by run 'alpha', and this is run 'beta': resuming it would continue another job's training. To continue it, pass --resume-from-other-run (or start with --run-id alpha); otherwise give this job its own --checkpoint-dir" <<<"$out" ||
      fail "run beta: no message naming runs alpha and beta"
    grep -q "^epoch" <<<"$out" && fail "run beta trained"
    out=$("$train" --epochs 2 "${small[@]}" --checkpoint-dir "$dir" 2>&1)
    code=$?
    [[ $code == 1 ]] || fail "a run without an id on alpha's checkpoint: exit code $code, expected 1"
    grep -q "was written by run 'alpha', and this is a run without an id (no --run-id, and no launcher's run id)" <<<"$out" ||
      fail "the run without an id: no message"
    out=$("$train" --epochs 2 "${small[@]}" --checkpoint-dir "$dir" --run-id beta --resume-from-other-run 2>&1) ||
      fail "run beta with --resume-from-other-run: exit code $?"
    grep -qx "resumed from $dir/checkpoint-00000001.pt at epoch 2 (written by run 'alpha')" <<<"$out" ||
      fail "run beta with --resume-from-other-run did not resume"
    # Under ddprun: a restart (--max-restarts, the same TORCHDDP_RUN_ID) resumes its own checkpoint;
    # a new ddprun job on the same directory is another run.
    rm -rf "$dir"/*
    script="if [ \"\$DDPRUN_RESTART_COUNT\" = 0 ]; then \"\$0\" --epochs 1 \"\$@\" || exit 1; exit 3; fi; exec \"\$0\" --epochs 2 \"\$@\""
    out=$(timeout 240 "$ddprun" --standalone --nproc-per-node 1 --max-restarts 1 -- bash -c "$script" "$train" \
            "${small[@]}" --checkpoint-dir "$dir" 2>&1) || fail "ddprun with a restart: exit code $?"
    grep -Eq "^\[rank 0\] resumed from $dir/checkpoint-00000001.pt at epoch 2$" <<<"$out" ||
      fail "the restarted attempt did not resume its own checkpoint"
    out=$(timeout 240 "$ddprun" --standalone --nproc-per-node 1 -- "$train" --epochs 3 "${small[@]}" --checkpoint-dir "$dir" 2>&1)
    code=$?
    [[ $code == 1 ]] || fail "a new ddprun job on the previous job's checkpoint: exit code $code, expected 1"
    grep -q "checkpoint-00000002.pt was written by run '[0-9a-f]\{16\}', and this is run '[0-9a-f]\{16\}'" <<<"$out" ||
      fail "the new ddprun job: no message naming both runs"
    ;;

  *)
    echo "usage: $0 ddprun2|ddprun3 DDPRUN TRAIN | progress TRAIN | resume TRAIN | refusals TRAIN | nonfinite TRAIN | filestore TRAIN | identity DDPRUN TRAIN"
    exit 2
    ;;
esac
echo "PASS: $mode"
