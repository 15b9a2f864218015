#!/usr/bin/env bash
# A rehearsal of the GPU check (scripts/gpu_check.sh) here, without a GPU: on a machine like a lent
# GPU machine, which has python3 with a CUDA torch, the CUDA toolkit, CMake, ninja and g++, but none
# of our Debian packages and no package manager. So that the one command works the first time a
# GPU machine is lent, and keeps working (CI runs this; .ci/run).
#
#   bash scripts/gpu_rehearsal.sh       # as root (debootstrap, mount and chroot need it); 4-7 min on 2 cores
#
# The stand-in machine: a debootstrap chroot (as scripts/libtorch2_chroot.sh makes, but minimal)
# holding only python3, g++, cmake and ninja-build, installed by debootstrap itself (their -dev
# dependencies are the compiler's own: libc6-dev, libcrypt-dev, libgcc-12-dev, libnsl-dev,
# libstdc++-12-dev, libtirpc-dev, linux-libc-dev; the rehearsal fails if any of our dependencies'
# packages is there, and prints the -dev ones). Inside, nothing is installed:
#   - python3 is a venv (/opt/torch-venv) whose site-packages is the torch 2.15 CUDA wheel's venv
#     of scripts/libtorch_wheel.sh, mounted read-only (its python must be the chroot's: 3.11 is
#     bookworm's, 3.13 trixie's; the suite is picked to match);
#   - the CUDA toolkit, which the GPU machine's image has and a CUDA LibTorch's CMake files need
#     (nvcc), is this machine's, mounted read-only at the same path;
#   - apt-get, apt and dpkg are replaced by a program that refuses, for the whole run.
# What travels is what the device tool sends: the tracked and untracked-not-ignored files of this
# checkout plus the bundle (scripts/gpu_bundle.sh, made if missing), copied fresh into the chroot
# each run and built from scratch there; its size is printed against the 64 MiB limit. Then
# gpu_check.sh runs there: the GPU tests must skip, saying why, and everything else pass. Its report
# is printed as it runs (and kept in .ci-logs/), then the rehearsal's rc and wall time.
#
# Environment:
#   DDP_GPU_CHROOT   the chroot (default /var/tmp/torchddp-gpu-rehearsal; made once, ~2 min)
#   DDP_WHEEL_VENV   the torch wheel's venv (default .venv-torch; made by scripts/libtorch_wheel.sh)
#   CUDA_HOME        the CUDA toolkit to mount (default /usr/local/cuda)
#   MIRROR           Debian mirror (default: as scripts/libtorch2_chroot.sh)
#   REHEARSE_COMMIT  rehearse this commit (e.g. HEAD: git archive) instead of the working tree
#   REHEARSAL_CMAKE  a CMake folder (bin/cmake) to use instead of bookworm's 3.25, e.g. PyPI's cmake
#                    wheel's cmake/data (4.4.5 rehearsed so, 2026-11-28)
#   KEEP_BUILD=1     keep the last rehearsal's build (a developer's rerun); by default it starts afresh
#   PREPARE_ONLY=1   stop once the chroot is made (CI makes it in the background)
#   DDP_BUILD_JOBS, EPOCH_SAMPLES   passed to gpu_check.sh (defaults: nproc; 10000 here, to keep
#                                   CI's time: the CPU run of the main job is not what is rehearsed)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
start=$SECONDS
CHROOT=${DDP_GPU_CHROOT:-/var/tmp/torchddp-gpu-rehearsal}
venv=${DDP_WHEEL_VENV:-$repo/.venv-torch}
cuda=$(readlink -f "${CUDA_HOME:-/usr/local/cuda}")
log() { echo "[gpu-rehearsal] $*"; }

if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    exec sudo -E bash "$0" "$@"
  fi
  echo "gpu_rehearsal.sh: must run as root (debootstrap, mount and chroot need it); try: sudo bash $0" >&2
  exit 2
fi
[[ -x $cuda/bin/nvcc ]] || { log "no CUDA toolkit at ${CUDA_HOME:-/usr/local/cuda} (the GPU machine has one; set CUDA_HOME)"; exit 2; }

# --- 1. what travels: the torch venv and the bundle, made here if missing -------------------------
prepare_only=${PREPARE_ONLY:-0}
if [[ $prepare_only != 1 ]]; then
  [[ -f $venv/.torchddp-installed ]] || PREPARE_ONLY=1 DDP_WHEEL_VENV=$venv bash scripts/libtorch_wheel.sh
  [[ -f .gpu-bundle/MANIFEST ]] || bash scripts/gpu_bundle.sh
fi
# The venv's python, or (the venv still being made, PREPARE_ONLY) the one that makes it.
if [[ -f $venv/pyvenv.cfg ]]; then
  py_version=$(sed -n 's/^version *= *\([0-9]*\.[0-9]*\).*/\1/p' "$venv/pyvenv.cfg")
else
  py_version=$("${PYTHON:-python3}" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
fi
case $py_version in
  3.11) SUITE=bookworm ;;
  3.13) SUITE=trixie ;;
  *) log "the venv's python is $py_version: no Debian suite here has that python3 (3.11: bookworm, 3.13: trixie)"; exit 2 ;;
esac
site=$venv/lib/python$py_version/site-packages

# --- 2. the chroot: python3, g++, cmake, ninja, nothing else of ours -------------------------------
mounted=()
mount_once() {  # mount_once <target> <mount args...>: private, so nothing mounted under it reaches the host
  local target=$1; shift
  [[ -e $target ]] || mkdir -p "$target"
  if ! mountpoint -q "$target"; then
    mount "$@" "$target"
    mounted=("$target" "${mounted[@]}")
    mount --make-private "$target"
  fi
}
unmount_all() {  # ours, then whatever is left under the chroot (an interrupted run's), deepest first
  for m in "${mounted[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" || true; done
  mounted=()
  awk -v root="$CHROOT/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r |
    while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" || true; done
}
trap unmount_all EXIT
if [[ -z ${MIRROR:-} ]]; then
  MIRROR=$(grep -hsoE '^(URIs:|deb)[[:space:]]+[^[:space:]]*https?://[^[:space:]]+/debian/?([[:space:]]|$)' \
             /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
           grep -oE 'https?://[^[:space:]]+' | grep -v security | head -n1 || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
include=python3,g++,cmake,ninja-build
stamp=$CHROOT/.torchddp-rehearsal
if [[ ! -f $stamp ]] || [[ $(cat "$stamp") != "$SUITE $include" ]]; then
  command -v debootstrap >/dev/null || bash scripts/setup.sh debootstrap
  log "debootstrap $SUITE ($include) from $MIRROR into $CHROOT"
  unmount_all  # never rm -rf through a mount of the host's /dev or of the venv
  if awk -v root="$CHROOT/" 'index($2, root) == 1 {found = 1} END {exit !found}' /proc/mounts; then
    log "mounts remain under $CHROOT: not removing it"; exit 1
  fi
  rm -rf "$CHROOT"
  timeout 1200 debootstrap --variant=minbase --include="$include" "$SUITE" "$CHROOT" "$MIRROR" >/dev/null
  chroot "$CHROOT" /usr/bin/python3 -m venv --without-pip /opt/torch-venv
  echo "$SUITE $include" >"$stamp"
fi
[[ $prepare_only == 1 ]] && { log "chroot ready at $CHROOT"; exit 0; }
[[ -d $site/torch ]] || { log "no torch in $site"; exit 2; }
ours="libtorch-dev libgloo-dev libfmt-dev libgtest-dev googletest libcli11-dev nlohmann-json3-dev libssl-dev
      zlib1g-dev dataset-fashion-mnist python3-torch ccache"
# shellcheck disable=SC2086
present=$( (chroot "$CHROOT" dpkg-query -W -f='${Package} ${Status}\n' $ours 2>/dev/null || true) |
          awk '/install ok installed/ {print $1}')
[[ -z $present ]] || { log "the chroot has our dependencies' packages: $present"; exit 1; }
dev_packages=$(chroot "$CHROOT" dpkg-query -W -f='${Package} ${Status}\n' '*-dev' 2>/dev/null |
               awk '/install ok installed/ {print $1}' | paste -sd ' ' -)
log "chroot $CHROOT ($SUITE): $(chroot "$CHROOT" dpkg-query -W -f='.\n' | wc -l) packages; -dev ones (the compiler's): $dev_packages"

# --- 3. mounts, the package manager refused, the tree copied -------------------------------------
mount_once "$CHROOT/proc" -t proc proc
mount_once "$CHROOT/sys" -t sysfs sys
mount_once "$CHROOT/dev" --bind /dev
mount_once "$CHROOT/dev/pts" --bind /dev/pts
mount_once "$CHROOT/dev/shm" -t tmpfs -o size=2g tmpfs
mount_once "$CHROOT/opt/torch-venv/lib/python$py_version/site-packages" --bind -o ro "$site"
mount_once "$CHROOT$cuda" --bind -o ro "$cuda"
[[ $cuda == /usr/local/cuda ]] || ln -sfn "$cuda" "$CHROOT/usr/local/cuda"
refuse=$CHROOT/usr/local/sbin/refuse-package-manager
printf '#!/bin/sh\necho "$0: no package manager on this machine (the GPU check rehearsal)" >&2\nexit 100\n' >"$refuse"
chmod 755 "$refuse"
for tool in /usr/bin/apt-get /usr/bin/apt /usr/bin/dpkg; do
  [[ -e $CHROOT$tool ]] && mount_once "$CHROOT$tool" --bind -o ro "$refuse"
done

tree=$CHROOT/root/torchddp
commit=$(git rev-parse --short "${REHEARSE_COMMIT:-HEAD}")
[[ -n ${REHEARSE_COMMIT:-} || -z $(git status --porcelain) ]] || commit+=" with work in progress"
rm -rf "$tree" && mkdir -p "$tree"
if [[ ${REHEARSE_COMMIT:-} ]]; then
  git archive "$REHEARSE_COMMIT" | tar -x -C "$tree"  # a commit alone, without the work in progress beside it
else
  # (a tracked file deleted in the working tree is left out, as the device tool leaves it)
  git ls-files -co --exclude-standard -z | tar -c --null --ignore-failed-read -T - -f - 2>/dev/null | tar -x -C "$tree"
fi
cp -r .gpu-bundle "$tree/.gpu-bundle"
tree_kib=$(du -sk "$tree" | cut -f1)
bundle_kib=$(du -sk "$tree/.gpu-bundle" | cut -f1)
log "what travels: $((tree_kib / 1024)) MiB (limit 64 MiB), of which the bundle $((bundle_kib / 1024)) MiB (limit 40 MiB)"
((tree_kib <= 64 * 1024 && bundle_kib <= 40 * 1024)) || { log "over the limit"; exit 1; }

# --- 4. the check, as on the GPU machine -----------------------------------------------------------
# Another CMake than bookworm's 3.25 (the GPU image's is PyPI's cmake, 4.x): REHEARSAL_CMAKE=<its folder>.
rm -rf "$CHROOT/opt/cmake"
path=/opt/torch-venv/bin:/usr/sbin:/usr/bin:/sbin:/bin
if [[ -n ${REHEARSAL_CMAKE:-} ]]; then
  cp -r "$REHEARSAL_CMAKE" "$CHROOT/opt/cmake"
  path=/opt/cmake/bin:$path
fi
in_chroot() {
  chroot "$CHROOT" /usr/bin/env -i HOME=/root PATH=$path LANG=C.UTF-8 \
    OUT=/root/out DDP_GPU_BUILD=/root/build-gpu DDP_COMMIT="$commit" DDP_BUILD_JOBS="${DDP_BUILD_JOBS:-$(nproc)}" EPOCH_SAMPLES="${EPOCH_SAMPLES:-10000}" bash -c "$1"
}
in_chroot "apt-get --version" >/dev/null 2>&1 && { log "apt-get still works in the chroot"; exit 1; }
rm -rf "$CHROOT/root/out"
[[ ${KEEP_BUILD:-0} == 1 ]] || rm -rf "$CHROOT/root/build-gpu"
log "set-up took $((SECONDS - start)) s; running scripts/gpu_check.sh in the chroot"
check_start=$SECONDS
rc=0
in_chroot "cd /root/torchddp && bash scripts/gpu_check.sh" || rc=$?
check_s=$((SECONDS - check_start))
mkdir -p .ci-logs
cp "$CHROOT/root/out/gpu_report.txt" "$CHROOT/root/out/gpu_check.log" .ci-logs/ 2>/dev/null || true
log "the report above is in .ci-logs/gpu_report.txt, the whole log in .ci-logs/gpu_check.log"

# The rehearsal's own claims: every GPU test skipped with a reason, nothing failed.
if [[ $rc -eq 0 ]]; then
  if ! grep -qE '^ +SKIPPED +Cuda\.[A-Za-z]+ .*: .+' "$CHROOT/root/out/gpu_report.txt"; then
    log "no Cuda.* test skipped with a reason in the report"; rc=1
  fi
  if grep -qE '^ +PASSED +Cuda\.' "$CHROOT/root/out/gpu_report.txt"; then
    log "a Cuda.* test passed without a GPU"; rc=1
  fi
fi
log "rehearsal: rc $rc; gpu_check.sh took ${check_s} s, the whole rehearsal $((SECONDS - start)) s (with $(nproc) cores)"
exit $rc
