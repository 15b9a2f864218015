#!/usr/bin/env bash
# The GPU proof in one command: on any machine with python3 + torch (a CUDA build), CMake, ninja
# and a C++ compiler, and none of our Debian packages (no package manager needed), configure the
# library, ddprun and the GPU tests against that torch with the dependency bundle, build them with
# every core, run everything that needs a GPU, and write a short report.
#
#   bash scripts/gpu_bundle.sh      # here, once: the dependencies, in .gpu-bundle/ (~35 MiB)
#   # copy the working tree and .gpu-bundle/ to the GPU machine, then there:
#   bash scripts/gpu_check.sh       # the report in $OUT/gpu_report.txt (here, 2 cores: 4-7 min)
#
# What runs (each result in the report; a GPU test that skips where torch sees a GPU fails):
#   gpu_tests      tests/ddp's files with the GPU tests: Cuda.* (Gloo with CUDA tensors at world 2
#                  on one GPU, a model split across cpu and cuda:0, device_ids on the GPU, NCCL at
#                  world 1) and Nccl.* (which NCCL is built against and loaded), with the CPU tests
#                  of the same files
#   launch_tests   Launch.GpuCount* (ddprun --nproc-per-node gpu starts one rank per GPU)
#   the main job   train_fashion_mnist, one epoch on the bundle's Fashion-MNIST: on the CPU (Gloo,
#                  world 2) and, where it has a --device flag, on the GPU with --backend nccl at
#                  world 1 and with CUDA tensors over Gloo at world 2: samples/s of each
#   model_parallel_ddp under ddprun at world 2: net1 on the CPU, net2 on cuda:0
# Without a GPU (the rehearsal, scripts/gpu_rehearsal.sh) the same runs: the GPU tests skip saying
# why and everything else must pass.
#
# Environment:
#   OUT              where the report and the logs go (default: build-gpu/out); the device tool sets it
#   PYTHON           the interpreter whose torch is built against (default python3)
#   DDP_DEPS_BUNDLE  the dependency bundle (default .gpu-bundle in the checkout)
#   DDP_GPU_BUILD    the build directory (default build-gpu)
#   DDP_BUILD_JOBS   build jobs (default: nproc)
#   EPOCH_SAMPLES    training samples per main-job run (default 60000, the whole set)
#   DDP_COMMIT       the commit to name in the report where the copy has no .git
# Exit status: 0 when every test and run passed or skipped for its stated reason, else 1.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
start=$SECONDS
python=${PYTHON:-python3}
bundle=${DDP_DEPS_BUNDLE:-$repo/.gpu-bundle}
build=${DDP_GPU_BUILD:-$repo/build-gpu}
jobs=${DDP_BUILD_JOBS:-$(nproc)}
samples=${EPOCH_SAMPLES:-60000}
out=${OUT:-$build/out}
mkdir -p "$out"
report=$out/gpu_report.txt
log=$out/gpu_check.log
: >"$report"
: >"$log"
failures=0
say() { echo "$*" | tee -a "$report"; }                 # a line of the report (and the console)
note() { echo "[gpu-check] $*" | tee -a "$log"; }       # progress: the console and the log
fail() { say "FAILED: $*"; failures=$((failures + 1)); }
elapsed() { echo "$((SECONDS - $1)) s"; }

# --- 1. the machine ------------------------------------------------------------------------------
# A CUDA LibTorch's CMake files enable CMake's CUDA language: nvcc must be found (CUDACXX or PATH).
if [[ -z ${CUDACXX:-} ]] && ! command -v nvcc >/dev/null; then
  for nvcc in "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
    [[ -x $nvcc ]] && { export CUDACXX=$nvcc; break; }
  done
fi
for tool in "$python" cmake ninja "${CXX:-c++}"; do
  [[ $tool == c++ ]] && ! command -v c++ >/dev/null && command -v g++ >/dev/null && export CXX=g++ && continue
  command -v "$tool" >/dev/null || { say "FAILED: $tool is not on PATH (needed: python3 with torch, cmake, ninja, a C++ compiler)"; exit 1; }
done
[[ -f $bundle/MANIFEST ]] || { say "FAILED: no dependency bundle at $bundle (make it with scripts/gpu_bundle.sh)"; exit 1; }
machine=$("$python" -W ignore - <<'EOF'
import torch
cuda = torch.cuda.is_available()
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as error:  # a build without NCCL
    nccl = f"none ({error})"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL {nccl}")
print(f"GPU: {torch.cuda.get_device_name(0) + f' (of {torch.cuda.device_count()})' if cuda else 'none (torch.cuda.is_available() is False)'}")
print(f"has_gpu={int(cuda)}")
EOF
)
has_gpu=$(sed -n 's/^has_gpu=//p' <<<"$machine")
commit=${DDP_COMMIT:-$(git -C "$repo" log -1 --format=%h 2>/dev/null || echo 'unknown (no .git here: pass DDP_COMMIT)')}
say "torchddp GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $commit"
say "$(grep -v '^has_gpu=' <<<"$machine")"
say "driver: $( (nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi') | head -1)"
say "machine: $(nproc) cores, $(uname -r), cmake $(cmake --version | head -1 | awk '{print $3}'), $("${CXX:-c++}" --version | head -1)"

# --- 2. configure and build -----------------------------------------------------------------------
# torch.utils.cmake_prefix_path finds TorchConfig.cmake; torch's own folder goes first, as in
# scripts/libtorch_wheel.sh (TorchConfig finds libc10.so with find_library).
prefix=$("$python" -W ignore -c 'import os, torch.utils; p = torch.utils.cmake_prefix_path
print(p + ";" + os.path.dirname(os.path.dirname(p)))')
phase=$SECONDS
note "configuring $build (bundle $bundle)"
if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$prefix" \
       -DDDP_DEPS_BUNDLE="$bundle" -DDDP_GPU_CHECK=ON -DDDP_BUILD_BENCHMARKS=OFF >>"$log" 2>&1; then
  tail -n 30 "$log"
  say "FAILED: configure (the end of $log above)"
  exit 1
fi
grep -E 'torchddp: (LibTorch|CLI11|nlohmann_json|GoogleTest|Gloo|zlib|OpenSSL)' "$log" | sed 's/^-- torchddp: /  /' | tee -a "$report"
targets=(ddprun launch_child launch_tests gpu_tests train_fashion_mnist model_parallel_ddp)
note "building ${targets[*]} with $jobs jobs"
if ! cmake --build "$build" -j "$jobs" $(printf -- '--target %s ' "${targets[@]}") >>"$log" 2>&1; then
  grep -E 'error|Error' "$log" | head -n 20
  say "FAILED: build (errors in $log)"
  exit 1
fi
say "configure and build: $(elapsed $phase) with $jobs jobs"

# --- 3. the tests ---------------------------------------------------------------------------------
# One line a test from GoogleTest's XML: its result, its name, its time and, for a skip or a
# failure, the first line of its message. Prints "counts <passed> <skipped> <failed> <gpu-skips>".
summarize() {  # summarize <xml> <regex of the tests that need a GPU>
  "$python" - "$1" "$2" <<'EOF'
import re, sys, xml.etree.ElementTree as ET
xml, gpu = sys.argv[1], re.compile(sys.argv[2])
counts = {"passed": 0, "skipped": 0, "failed": 0}
gpu_skips = 0
for case in ET.parse(xml).iter("testcase"):
    name = f"{case.get('classname')}.{case.get('name')}"
    failure, skipped = case.find("failure"), case.find("skipped")
    result = "failed" if failure is not None else "skipped" if skipped is not None or case.get("result") == "skipped" else "passed"
    counts[result] += 1
    message = ""
    if result != "passed":
        node = failure if failure is not None else skipped
        text = (node.get("message") or node.text or "") if node is not None else ""
        lines = [l for l in text.splitlines() if l.strip() and not re.match(r"^\S+:\d+$", l.strip())]
        message = ": " + (lines[-1] if result == "skipped" and lines else lines[0] if lines else "").strip()
        if result == "skipped" and gpu.search(name):
            gpu_skips += 1
    if result != "passed" or gpu.search(name):
        print(f"  {result.upper():7} {name} ({float(case.get('time', 0)):.1f} s){message}")
print(f"counts {counts['passed']} {counts['skipped']} {counts['failed']} {gpu_skips}")
EOF
}
run_gtest() {  # run_gtest <label> <binary> <filter> <regex of GPU tests> <timeout s>
  local label=$1 binary=$2 filter=$3 gpu=$4 limit=$5 xml=$out/$1.xml phase=$SECONDS status=0
  note "running $label ($filter)"
  timeout --kill-after=10 "$limit" "$binary" --gtest_filter="$filter" --gtest_output="xml:$xml" >>"$log" 2>&1 || status=$?
  if [[ ! -f $xml ]]; then
    fail "$label: no results (exit $status$([[ $status -eq 124 ]] && echo ", stopped after $limit s"))"
    return
  fi
  local lines counts
  lines=$(summarize "$xml" "$gpu")
  counts=($(tail -n 1 <<<"$lines"))
  say "$label: ${counts[1]} passed, ${counts[2]} skipped, ${counts[3]} failed ($(elapsed $phase))"
  sed '$d' <<<"$lines" | tee -a "$report"
  [[ $status -eq 0 && ${counts[3]} -eq 0 ]] || fail "$label: exit $status, ${counts[3]} failed"
  if [[ $has_gpu == 1 && ${counts[4]} -gt 0 ]]; then
    fail "$label: torch sees a GPU, yet ${counts[4]} GPU test(s) skipped"
  fi
}
run_gtest gpu_tests "$build/tests/gpu/gpu_tests" '*' '^(Cuda|Nccl)\.' 600
grep -m1 -o 'built against NCCL .*' "$log" | sed 's/^/  /' | tee -a "$report" || true  # Nccl.Reports...'s own line
run_gtest launch_tests "$build/tests/launch/launch_tests" 'Launch.GpuCount*:LaunchBadInput.GpuCount*' '^Launch\.Gpu' 300

# --- 4. the main job and the model-parallel example ----------------------------------------------
ddprun=$build/launch/ddprun
data=/usr/share/datasets/fashion-mnist
[[ -f $data/train-images-idx3-ubyte.gz ]] || data=$bundle/fashion-mnist
train=$build/examples/train_fashion_mnist/train_fashion_mnist
main_job() {  # main_job <label> <world> <flags...>: one epoch; prints its samples/s into the report
  local label=$1 world=$2 phase=$SECONDS status=0 output
  shift 2
  output=$(timeout --kill-after=10 600 "$ddprun" --nproc-per-node "$world" --standalone \
             "$train" --epochs 1 --limit-train "$samples" --data-dir "$data" --threads 1 "$@" 2>&1) || status=$?
  printf '%s\n' "--- main job, $label" "$output" >>"$log"
  local epoch
  epoch=$(grep -E '(^|\] )epoch 1/1: ' <<<"$output" | tail -n 1 || true)  # ddprun prefixes "[rank 0] "
  if [[ $status -ne 0 || -z $epoch ]]; then
    fail "main job, $label: exit $status ($(grep -v '^\s*$' <<<"$output" | tail -n 1))"
    return
  fi
  say "main job, $label: $(sed -E 's/.*test loss [0-9.]+ acc ([0-9.]+%).*\| ([0-9]+ samples\/s).*/\2, test accuracy \1/' <<<"$epoch") ($(elapsed $phase))"
  rate=$(sed -E 's/.*\| ([0-9]+) samples\/s.*/\1/' <<<"$epoch")
}
ratio() {  # ratio <label> <samples/s> <against, samples/s>
  [[ -n $2 && -n $3 && $3 -gt 0 ]] && say "  $1: $(awk -v a="$2" -v b="$3" 'BEGIN {printf "%.2f", a / b}')x the CPU run's samples/s"
}
rate=""
main_job "CPU, Gloo, world 2" 2 --backend gloo
cpu_rate=$rate
if "$train" --help 2>/dev/null | grep -q -- '--device'; then
  if [[ $has_gpu == 1 ]]; then
    rate="" && main_job "GPU, NCCL, world 1" 1 --backend nccl --device cuda
    ratio "GPU, NCCL, world 1" "$rate" "$cpu_rate" || true
    rate="" && main_job "GPU, Gloo with CUDA tensors, world 2 on one GPU" 2 --backend gloo --device cuda
    ratio "GPU, Gloo with CUDA tensors, world 2" "$rate" "$cpu_rate" || true
  else
    say "main job on the GPU: skipped, no GPU here (torch.cuda.is_available() is False)"
  fi
else
  say "main job on the GPU: not run, train_fashion_mnist has no --device flag (it trains on the CPU only)"
fi

phase=$SECONDS
status=0
output=$(timeout --kill-after=10 300 "$ddprun" --nproc-per-node 2 --standalone "$build/examples/model_parallel/model_parallel_ddp" 2>&1) || status=$?
printf '%s\n' "--- model_parallel_ddp" "$output" >>"$log"
placement=$(grep -m1 -o 'net1 on .*' <<<"$output" || true)
if [[ $status -ne 0 ]]; then
  fail "model_parallel_ddp at world 2: exit $status ($(tail -n 1 <<<"$output"))"
elif [[ $has_gpu == 1 && $placement != *"net2 on cuda:0"* ]]; then
  fail "model_parallel_ddp at world 2: a GPU is here, yet: $placement"
else
  say "model_parallel_ddp at world 2: passed, $placement ($(elapsed $phase))"
fi

say "total: $(elapsed $start); $failures failure(s); log: $log"
[[ $failures -eq 0 ]]
