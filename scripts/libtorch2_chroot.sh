#!/usr/bin/env bash
# Builds torchddp's DDP tests against LibTorch 2.x (Debian trixie's libtorch-dev) inside a
# debootstrap chroot and runs them. Not part of CI: a developer's one-command check.
#
#   sudo scripts/libtorch2_chroot.sh            # chroot at /work/chroot-trixie
#   CHROOT=/tmp/trixie MIRROR=http://deb.debian.org/debian sudo -E scripts/libtorch2_chroot.sh
#
# Environment:
#   CHROOT   where the chroot lives (default /work/chroot-trixie); created once, then reused
#   MIRROR   Debian mirror (default: the first deb.debian.org-style URI of this machine's apt sources)
#   SUITE    Debian suite (default trixie)
#   TARGETS  ninja targets (default ddp_tests); "all" builds every area, examples and the launcher
#   JOBS     parallel jobs (default 2)
#   AREAS    DDP_LIBRARY_AREAS (default "ddp;sampler;checkpoint"; "ddp" when another area is broken)
#   REF      git ref to export into the chroot (default HEAD: committed state only)
#   UNMOUNT  1: unmount proc/sys/dev on exit (default 1)
#
# Steps: debootstrap (skipped when $CHROOT/usr/bin/apt-get exists) -> apt-get install the build
# dependencies (skipped when already installed) -> git archive $REF into $CHROOT/src ->
# cmake + ninja inside the chroot -> run build/tests/ddp/ddp_tests inside the chroot.
set -euo pipefail

CHROOT=${CHROOT:-/work/chroot-trixie}
SUITE=${SUITE:-trixie}
JOBS=${JOBS:-2}
TARGETS=${TARGETS:-ddp_tests}
REF=${REF:-HEAD}
AREAS=${AREAS:-ddp;sampler;checkpoint}
UNMOUNT=${UNMOUNT:-1}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PACKAGES="cmake g++ ninja-build ccache zlib1g-dev libtorch-dev libgloo-dev libgtest-dev libgmock-dev
          libfmt-dev libcli11-dev nlohmann-json3-dev"

log() { echo "[libtorch2_chroot] $*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
  echo "must run as root (debootstrap, mount, chroot)" >&2
  exit 2
fi

if [[ -z ${MIRROR:-} ]]; then
  MIRROR=$(grep -hsoE '^(URIs:|deb)[[:space:]]+[^[:space:]]*https?://[^[:space:]]+/debian/?([[:space:]]|$)' \
             /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null |
           grep -oE 'https?://[^[:space:]]+' | grep -v security | head -n1 || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi

# --- 1. the chroot -------------------------------------------------------------------------------
if [[ ! -x $CHROOT/usr/bin/apt-get ]]; then
  command -v debootstrap >/dev/null || apt-get install -y debootstrap
  log "debootstrap $SUITE from $MIRROR into $CHROOT"
  debootstrap --variant=minbase "$SUITE" "$CHROOT" "$MIRROR"
else
  log "chroot $CHROOT exists: skipping debootstrap"
fi

mounted=()
mount_once() {  # mount_once <target> <mount args...>
  local target=$1; shift
  mkdir -p "$target"
  if ! mountpoint -q "$target"; then
    mount "$@" "$target"
    mounted=("$target" "${mounted[@]}")
  fi
}
cleanup() {
  if [[ $UNMOUNT == 1 ]]; then
    for m in "${mounted[@]}"; do umount "$m" || umount -l "$m" || true; done
  fi
}
trap cleanup EXIT
mount_once "$CHROOT/proc" -t proc proc
mount_once "$CHROOT/sys" -t sysfs sys
mount_once "$CHROOT/dev" --bind /dev
mount_once "$CHROOT/dev/pts" --bind /dev/pts
cp -L /etc/resolv.conf "$CHROOT/etc/resolv.conf" 2>/dev/null || true

in_chroot() { chroot "$CHROOT" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 bash -c "$1"; }

npackages=$(wc -w <<<"$PACKAGES")
# shellcheck disable=SC2086
ninstalled=$(in_chroot "dpkg-query -W -f='\${Status}\n' $(echo $PACKAGES) 2>/dev/null | grep -c 'install ok installed'" || true)
if [[ ${ninstalled:-0} -eq $npackages ]]; then
  log "build dependencies already installed"
else
  log "installing: $(echo $PACKAGES)"
  # shellcheck disable=SC2086
  in_chroot "export DEBIAN_FRONTEND=noninteractive; apt-get update &&
             apt-get install -y --no-install-recommends $(echo $PACKAGES)"
fi
log "LibTorch in the chroot: $(in_chroot "dpkg-query -W -f='\${Version}' libtorch-dev")"

# --- 2. the sources, configure, build -------------------------------------------------------------
log "exporting $REF of $REPO into $CHROOT/src"
mkdir -p "$CHROOT/src"
# Replace the sources but keep /src/build (incremental rebuilds).
find "$CHROOT/src" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
git -C "$REPO" archive "$REF" | tar -x -C "$CHROOT/src"

if [[ $TARGETS == all ]]; then
  cmake_options="-DDDP_BUILD_EXAMPLES=ON -DDDP_BUILD_BENCHMARKS=ON -DDDP_BUILD_LAUNCHER=ON"
  ninja_targets=""
else
  # The launcher stays configured (tests/launch needs the ddprun target to configure); ninja only
  # builds the requested targets.
  cmake_options="-DDDP_BUILD_EXAMPLES=OFF -DDDP_BUILD_BENCHMARKS=OFF -DDDP_BUILD_LAUNCHER=ON"
  ninja_targets=$TARGETS
fi
in_chroot "cd /src && cmake -S . -B build -G Ninja $cmake_options -DDDP_LIBRARY_AREAS='$AREAS' && ninja -C build -j$JOBS $ninja_targets"

# --- 4. run the DDP tests (multi-process over loopback, shared with the host) ---------------------
log "running /src/build/tests/ddp/ddp_tests in the chroot"
in_chroot "cd /src/build && ./tests/ddp/ddp_tests"
