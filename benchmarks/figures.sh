#!/usr/bin/env bash
# Re-measures the figures the README's "Figures" section quotes and prints them as one Markdown
# table (the machine, the LibTorch version and the load average in its header), so that the README
# shows today's numbers and anyone can reproduce them with one command:
#
#   bash benchmarks/figures.sh [--quick] [--readme] [--build DIR] [--out DIR] [--python PYTHON]
#
#   --quick   fewer rounds, the main job timed on the existing build instead of from a fresh clone,
#             and the root-only link and hosts figures left out: about 2 minutes on a 2-core
#             machine once built (the full run: 7 minutes here when quiet, 13 beside other builds)
#   --build   the build folder holding ddprun, the main job and ddp_bench (default: build; made with
#             `bash scripts/build.sh ddprun train_fashion_mnist ddp_bench hosts_bench launch_child`,
#             set-up included, when something is missing, as in a fresh clone)
#   --out     where the logs, ddp_bench's JSON and plots and figures.md go (default:
#             benchmarks/results/<UTC date>-figures)
#   --python  the Python whose torch runs the Python DDP peer (default: /usr/bin/python3 when its
#             torch is the same major.minor as the build's LibTorch, else what
#             main_job_vs_python.sh picks)
#   --readme  also put the table into README.md (between <!-- figures --> and <!-- /figures -->)
#             and copy the plots it shows into docs/figures/
#
# What it measures, each a row of the table (a figure that cannot be measured here is a row that
# says why):
#   1. the main job, `bash scripts/main.sh`, from a fresh `git clone` of this checkout's HEAD
#      (set-up, the build of ddprun and the training program, 3 epochs at 2 ranks): wall time, test
#      accuracy after each epoch, samples/s. --quick: the same 3 epochs under ddprun on --build.
#   2. the main job against PyTorch's Python DDP (benchmarks/main_job_vs_python.sh, 1 epoch) at 1
#      and 2 ranks: samples/s of each and ours/Python; Gloo alone (TORCHDDP_SHM=0) at 2 ranks.
#   3. ddp_bench's headline (mlp_b4 and resnet_b32 at 2 ranks, 25 MiB buckets): step times of
#      local, c10d's Reducer and ours, ours/reducer, ours/local, and with shared memory off.
#   4. the allreduce of float32 at 2 ranks over gloo+shm against Gloo alone (4 KB to 33.6 MB).
#   5. ddprun's start-up (tests/launch/bench_startup.sh: 4 ranks to their first all_reduce).
#   6. (not --quick; root) 2 simulated hosts x 2 ranks over 1 Gbit/s links: hierarchical/flat
#      (benchmarks/over_hosts.sh), and the compression hooks over a 1 Gbit/s link
#      (benchmarks/over_link.sh, shared memory off: the link stands for two machines).
set -u -o pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
quick=0 build=$repo/build out="" python="" readme=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --quick) quick=1 ;;
    --build) build=$(cd "$2" && pwd); shift ;;
    --out) out=$2; shift ;;
    --python) python=$2; shift ;;
    --readme) readme=1 ;;
    -h|--help) sed -n '2,/^set -u/{/^#/p}' "$0"; exit 0 ;;
    *) echo "figures.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
day=$(date -u +%Y-%m-%d)
out=${out:-$repo/benchmarks/results/$day-figures}
mkdir -p "$out"
out=$(cd "$out" && pwd)
rows=$out/rows.md
: >"$rows"
row() { printf '| %s | %s | %s |\n' "$1" "$2" "$3" >>"$rows"; }
log() { echo "figures.sh: $*" >&2; }
started=$SECONDS
load_start=$(cut -d' ' -f1-3 /proc/loadavg)

job=$build/examples/train_fashion_mnist/train_fashion_mnist
ddprun=$build/launch/ddprun
bench=$build/benchmarks/ddp_bench
child=$build/tests/launch/launch_child
if [[ ! -x $job || ! -x $ddprun || ! -x $bench || ! -x $child ]]; then
  log "building what is missing in $build"
  (cd "$repo" && bash scripts/build.sh ddprun train_fashion_mnist ddp_bench hosts_bench launch_child) >"$out/build.log" 2>&1 ||
    { log "the build failed: $out/build.log"; exit 1; }
fi
libtorch=$(cat "$build/libtorch_version.txt" 2>/dev/null || echo unknown)
deb=$(dpkg-query -W -f '${Version}' libtorch-dev 2>/dev/null)
libtorch_said="LibTorch $libtorch"
[[ -n $deb ]] && libtorch_said+=" (Debian's libtorch-dev $deb)"
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
mem=$(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null | grep -q openblas && echo OpenBLAS || echo "the reference BLAS")
# The samples/s and accuracy of a main-job output: "acc1 / acc2 / acc3" and "s1 / s2 / s3".
accuracies() { grep -Eo 'test loss [0-9.]+ acc [0-9.]+%' <<<"$1" | awk '{ printf "%s%s", (NR > 1 ? " / " : ""), $5 }'; }
speeds() { grep -Eo '[0-9]+ samples/s' <<<"$1" | awk '{ printf "%s%s", (NR > 1 ? " / " : ""), $1 }'; }

# 1. The main job.
if [[ $quick == 1 ]]; then
  log "1/6 the main job, 3 epochs at 2 ranks on $build"
  t0=$SECONDS
  o=$("$ddprun" --standalone --nproc-per-node 2 -- "$job" --epochs 3 2>&1 | tee "$out/main_job.log")
  if grep -q 'epoch 3/3' <<<"$o"; then
    row "main job: 3 epochs at 2 ranks (build already there)" \
        "$((SECONDS - t0)) s; test accuracy $(accuracies "$o"); $(speeds "$o") samples/s" \
        "\`ddprun --standalone --nproc-per-node 2 -- train_fashion_mnist --epochs 3\`"
  else row "main job: 3 epochs at 2 ranks" "failed (main_job.log)" "ddprun"; fi
  row "main job from a fresh clone" "not measured (--quick)" "\`bash scripts/main.sh\` in a fresh clone"
else
  log "1/6 the main job from a fresh clone (bash scripts/main.sh)"
  clone=$(mktemp -d /tmp/torchddp-figures.XXXXXX)
  git clone -q "$repo" "$clone/torchddp"
  t0=$SECONDS
  o=$(cd "$clone/torchddp" && bash scripts/main.sh 2>&1 | tee "$out/main_job.log")
  t=$((SECONDS - t0))
  if grep -q 'epoch 3/3' <<<"$o"; then
    row "main job from a fresh clone: \`bash scripts/main.sh\` (set-up, build, 3 epochs at 2 ranks; ccache as it is)" \
        "$t s in all; test accuracy $(accuracies "$o"); $(speeds "$o") samples/s" "\`bash scripts/main.sh\`"
  else row "main job from a fresh clone" "failed after $t s (main_job.log)" "\`bash scripts/main.sh\`"; fi
  rm -rf "$clone"
fi

# 2. Against PyTorch's Python DDP.
if [[ -z $python ]]; then
  want=$(cut -d. -f1-2 <<<"$libtorch")
  have=$(/usr/bin/python3 -c 'import warnings; warnings.simplefilter("ignore"); import torch; print(torch.__version__)' 2>/dev/null | cut -d. -f1-2)
  [[ -n $have && $have == "$want" ]] && python=/usr/bin/python3
fi
log "2/6 the main job against Python DDP (1 epoch, worlds 2 and 1)"
o=$(ROUNDS=$([[ $quick == 1 ]] && echo 1 || echo 2) bash "$repo/benchmarks/main_job_vs_python.sh" "$job" $python 1 2>&1 | tee "$out/main_job_vs_python.log")
if grep -q '^| 2 |' <<<"$o"; then
  peer=$(grep -Eo 'Python DDP \(torch [^)]*\)' <<<"$o" | head -1)
  for w in 2 1; do
    IFS='|' read -r _ _ ours gloo py ratio gratio _ <<<"$(grep "^| $w |" <<<"$o")"
    v="ours $(xargs <<<"$ours"), $peer $(xargs <<<"$py"): ours/Python **$(xargs <<<"$ratio")**"
    [[ $w == 2 ]] && v+="; Gloo alone (\`TORCHDDP_SHM=0\`) $(xargs <<<"$gloo"), /Python $(xargs <<<"$gratio")"
    row "main job against Python DDP, 1 epoch at world $w (samples/s per run)" "$v" "\`benchmarks/main_job_vs_python.sh\`"
  done
else row "main job against Python DDP" "not measured: $(tail -1 <<<"$o")" "\`benchmarks/main_job_vs_python.sh\`"; fi

# 3 and 4. ddp_bench's headline and the allreduce.
rounds=$([[ $quick == 1 ]] && echo 3 || echo 5)
log "3/6 ddp_bench: mlp_b4 and resnet_b32 at 2 ranks, 25 MiB buckets, $rounds rounds"
# The full run sweeps the bucket caps for the plots; the table quotes 25 MiB, PyTorch's default.
caps=$([[ $quick == 1 ]] && echo 25 || echo 0,1,5,25,100)
"$bench" --configs mlp:4,resnet:32 --world 2 --caps "$caps" --rounds "$rounds" --no-hooks --no-features --no-memory \
  --out "$out/ddp_bench" >"$out/ddp_bench.log" 2>&1 || log "ddp_bench failed: $out/ddp_bench.log"
python3 - "$out/ddp_bench" "$rounds" "$caps" >>"$rows" <<'EOF' || log "no ddp_bench figures"
import json, sys
d, rounds, caps = sys.argv[1], sys.argv[2], sys.argv[3]
rows = json.load(open(f"{d}/results.json"))["rows"]
def ms(model, variant):
    r = [x for x in rows if x["model"] == model and x["variant"] == variant and x.get("bucket_cap_mb") in (None, 25.0)]
    return r[0]["median_ms"] if r else float("nan")
for model, batch in (("mlp", 4), ("resnet", 32)):
    local, red, ours, view, gloo = (ms(model, v) for v in ("local", "reducer", "ours", "ours_view", "ours_gloo"))
    print(f"| ddp_bench `{model}_b{batch}`, 2 ranks, 25 MiB buckets (median step, {rounds} rounds) "
          f"| local {local:.1f} ms, c10d's Reducer {red:.1f} ms, ours {ours:.1f} ms: ours/reducer **{ours / red:.2f}**, "
          f"ours/local {ours / local:.2f}; with `gradient_as_bucket_view` /reducer {view / red:.2f}; "
          f"shared memory off (Gloo alone) /reducer {gloo / red:.2f} "
          f"| `ddp_bench --configs mlp:4,resnet:32 --caps {caps} --rounds {rounds} --no-hooks --no-features --no-memory` |")
a = json.load(open(f"{d}/allreduce_w2.json"))["sizes"]
def size(b):
    return f"{b // 1024} KB" if b < 1 << 20 else f"{b / 1e6:.1f} MB"
cells = ", ".join(f"{size(s['bytes'])} {s['default_ms']:.3f} against {s['gloo_ms']:.3f} ms (**{s['ratio']:.2f}x**)" for s in a)
print(f"| allreduce of float32 at 2 ranks, gloo+shm against Gloo alone (median of 100) | {cells} | the same run |")
EOF
log "4/6 (the allreduce came with ddp_bench)"

# 5. ddprun's start-up.
log "5/6 ddprun's start-up"
repeats=$([[ $quick == 1 ]] && echo 3 || echo 5)
o=$(bash "$repo/tests/launch/bench_startup.sh" "$build" 4 "$repeats" 2>&1 | tee "$out/startup.log")
firsts=$(grep -Eo 'done after [0-9]+ ms' <<<"$o" | awk '{ print $3 }' | sort -n)
hands=$(grep -Eo 'no launcher: [0-9]+ ms' <<<"$o" | awk '{ print $3 }' | sort -n)
alone=$(grep -Eo 'ddprun alone [0-9]+ ms' <<<"$o" | awk '{ print $3 }' | sort -n)
median() { awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }'; }
if [[ -n $firsts ]]; then
  row "ddprun's start-up: 4 ranks until the last finished its first all_reduce" \
      "median **$(median <<<"$firsts") ms** ($(xargs <<<"$firsts" | sed 's/ /, /g') ms); the same ranks started by hand $(median <<<"$hands") ms; \`ddprun --standalone true\` $(median <<<"$alone") ms" \
      "\`bash tests/launch/bench_startup.sh build 4 $repeats\`"
else row "ddprun's start-up" "failed (startup.log)" "\`tests/launch/bench_startup.sh\`"; fi

# 6. Over shaped links: root only.
why=""
[[ $quick == 1 ]] && why="not measured (--quick)"
[[ -z $why && $(id -u) != 0 ]] && why="not measured: needs root (network namespaces, tc)"
[[ -z $why ]] && ! command -v tc >/dev/null && why="not measured: no tc (iproute2)"
if [[ -n $why ]]; then
  row "2 hosts x 2 ranks over 1 Gbit/s links: hierarchical/flat" "$why" "\`sudo bash benchmarks/over_hosts.sh build/benchmarks/hosts_bench --rates 1gbit\`"
  row "communication hooks over a 1 Gbit/s link, \`mlp_b4\`" "$why" "\`TORCHDDP_SHM=0 sudo -E bash benchmarks/over_link.sh 1gbit build/benchmarks/ddp_bench --configs mlp:4 --caps 25\`"
else
  log "6/6 over shaped links (root)"
  o=$(bash "$repo/benchmarks/over_hosts.sh" "$build/benchmarks/hosts_bench" --rates 1gbit -- --rounds 3 2>&1 | tee "$out/over_hosts.log")
  code=$?
  line=$(grep -i 'hierarchical/flat' <<<"$o" | tail -1)
  flat=$(grep -Eo '^flat .* median [0-9.]+ ms' <<<"$o" | grep -Eo '[0-9.]+ ms$' | tail -1)
  hier=$(grep -Eo '^hierarchical .* median [0-9.]+ ms' <<<"$o" | grep -Eo '[0-9.]+ ms$' | tail -1)
  if [[ $code == 77 ]]; then row "2 hosts x 2 ranks over 1 Gbit/s links: hierarchical/flat" "not measured: $(tail -1 <<<"$o")" "\`benchmarks/over_hosts.sh\`"
  elif [[ $code == 0 && -n $line ]]; then row "2 hosts x 2 ranks over 1 Gbit/s links (\`mlp_b4\`, 25 MiB buckets)" "flat Gloo $flat a step, hierarchical $hier: hierarchical/flat **${line##*= }**" "\`sudo bash benchmarks/over_hosts.sh build/benchmarks/hosts_bench --rates 1gbit\`"
  else row "2 hosts x 2 ranks over 1 Gbit/s links" "failed (over_hosts.log)" "\`benchmarks/over_hosts.sh\`"; fi
  # Shared memory off: the link stands for two machines, which share no memory (on, the ranks
  # would not use the link at all).
  TORCHDDP_SHM=0 bash "$repo/benchmarks/over_link.sh" 1gbit "$bench" --configs mlp:4 --world 2 --caps 25 --rounds 2 --no-features --no-memory \
    --out "$out/over_link" >"$out/over_link.log" 2>&1
  python3 - "$out/over_link" >>"$rows" <<'EOF' || row "communication hooks over a 1 Gbit/s link" "failed (over_link.log)" "\`benchmarks/over_link.sh\`"
import json, sys
rows = json.load(open(f"{sys.argv[1]}/results.json"))["rows"]
ms = {r["variant"]: r["median_ms"] for r in rows if r.get("bucket_cap_mb") in (25.0, None)}
print(f"| communication hooks on `mlp_b4` over a 1 Gbit/s link (2 ranks, 25 MiB buckets, Gloo) | ours without a hook "
      f"{ms['ours']:.0f} ms a step; with the fp16 hook {ms['ours+fp16'] / ms['ours']:.2f}x that, bf16 **{ms['ours+bf16'] / ms['ours']:.2f}x**, "
      f"PowerSGD rank 1 **{ms['ours+powersgd1'] / ms['ours']:.2f}x**; c10d's Reducer {ms['reducer']:.0f} ms, its fp16 hook "
      f"{ms['reducer+fp16']:.0f} ms | `TORCHDDP_SHM=0 sudo -E bash benchmarks/over_link.sh 1gbit build/benchmarks/ddp_bench --configs mlp:4 --caps 25` |")
EOF
fi

load_end=$(cut -d' ' -f1-3 /proc/loadavg)
{
  echo "**Figures, $day** ($(nproc) cores, $cpu, $mem; $libtorch_said with $blas; Gloo over loopback," \
       "one torch thread per rank; a machine shared with other work: load average $load_start at the start," \
       "$load_end at the end;" \
       "$([[ $quick == 1 ]] && echo "\`bash benchmarks/figures.sh --quick\`" || echo "\`bash benchmarks/figures.sh\`"), $(((SECONDS - started + 30) / 60)) min)"
  echo
  echo "| figure | measured | command |"
  echo "| --- | --- | --- |"
  cat "$rows"
} >"$out/figures.md"
rm -f "$rows"
git -C "$repo" rev-parse --short HEAD >"$out/commit.txt" 2>/dev/null
cat "$out/figures.md"
if [[ $readme == 1 ]]; then
  mkdir -p "$repo/docs/figures"
  for plot in steps_mlp_b4_w2.png steps_resnet_b32_w2.png allreduce_w2.png; do
    [[ -f $out/ddp_bench/$plot ]] && cp "$out/ddp_bench/$plot" "$repo/docs/figures/$plot"
  done
  python3 - "$repo/README.md" "$out/figures.md" <<'EOF2' && log "README.md's figures table replaced"
import sys
readme, table = sys.argv[1], open(sys.argv[2]).read().strip()
text = open(readme).read()
start, end = "<!-- figures -->", "<!-- /figures -->"
if start not in text or end not in text:
    sys.exit("figures.sh: README.md has no <!-- figures --> ... <!-- /figures --> block")
head, rest = text.split(start, 1)
open(readme, "w").write(head + start + "\n" + table + "\n" + end + rest.split(end, 1)[1])
EOF2
fi
log "wrote $out/figures.md (logs, ddp_bench's JSON and plots beside it)"
