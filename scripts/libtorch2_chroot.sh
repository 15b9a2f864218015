#!/usr/bin/env bash
# The whole test suite again, built against LibTorch 2.x: Debian trixie's libtorch-dev (2.6) in a
# debootstrap chroot. CI runs it after scripts/test.sh (the host's LibTorch 1.13.1), so both
# branches of ddp/internal/compat/versions.h are compiled and tested on every run.
#
#   bash scripts/libtorch2_chroot.sh            # as root: debootstrap, mount and chroot need it
#   bash scripts/libtorch2_chroot.sh -R consumer   # extra arguments go to ctest
#
# Environment:
#   DDP_CHROOT  where the chroot lives (default /var/tmp/torchddp-trixie, outside the checkout):
#               created once (~1 min), then reused, so a developer's second run only rebuilds
#   MIRROR      Debian mirror (default: this machine's deb.debian.org-style apt source)
#   SUITE       Debian suite (default trixie)
#   JOBS        parallel build jobs (default: nproc)
#   PREPARE_ONLY=1  stop once the chroot and its packages are in place (no build, no tests)
#   TARGETS     build only these targets (e.g. "ddp_amp_tests ddp_nn_tests"; pair with -R for ctest)
#   ALL_TESTS=1 also run the tests labelled `once` (ddprun's own behaviour, the add_subdirectory
#               build): what they check does not change with LibTorch's version, and the host's
#               tier runs them (they are a third of the suite's time)
#
# Steps: debootstrap (skipped when the chroot exists) -> apt-get install the build dependencies
# (skipped when installed) -> bind-mount this checkout at /src -> configure and build into the
# chroot's /root/build (the host's ./build is never touched) -> ctest. Every mount is undone on
# exit, failure included.
set -euo pipefail

CHROOT=${DDP_CHROOT:-/var/tmp/torchddp-trixie}
SUITE=${SUITE:-trixie}
JOBS=${JOBS:-$(nproc)}
REPO=$(cd "$(dirname "$0")/.." && pwd)
# The host's scripts/setup.sh list. python3-torch (2.6): the Python interop tests with 2.6's
# torch.load (weights_only by default) and torchrun 2.x (the main job under it).
# libopenblas0-pthread: as on the host, LibTorch's BLAS calls go to OpenBLAS, not the reference BLAS.
PACKAGES="cmake g++ ninja-build ccache pkg-config zlib1g-dev libtorch-dev libgloo-dev libfmt-dev
          libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev dataset-fashion-mnist gnuplot-nox
          procps iproute2 python3-torch openmpi-bin libopenblas0-pthread libssl-dev"

log() { echo "[libtorch2] $*"; }

if [[ $(id -u) -ne 0 ]]; then
  # debootstrap, mount and chroot need root: use sudo when it needs no password (CI), else say so.
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    exec sudo -E bash "$0" "$@"
  fi
  echo "libtorch2_chroot.sh: must run as root (debootstrap, mount and chroot need it); try: sudo bash $0" >&2
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
  if ! command -v debootstrap >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null ||
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  fi
  log "debootstrap $SUITE from $MIRROR into $CHROOT"
  rm -rf "$CHROOT"  # a half-made chroot from an interrupted run
  debootstrap --variant=minbase "$SUITE" "$CHROOT" "$MIRROR" >/dev/null
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
  for m in "${mounted[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" || true; done
  # Whatever the tests mounted inside (`ip netns add` mounts the chroot's /run/netns), deepest first.
  awk -v root="$CHROOT/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r |
    while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" || true; done
}
trap cleanup EXIT
mount_once "$CHROOT/proc" -t proc proc
mount_once "$CHROOT/sys" -t sysfs sys
mount_once "$CHROOT/dev" --bind /dev
mount_once "$CHROOT/dev/pts" --bind /dev/pts
mount_once "$CHROOT/src" --bind "$REPO"
cp -L /etc/resolv.conf "$CHROOT/etc/resolv.conf" 2>/dev/null || true

in_chroot() {
  chroot "$CHROOT" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    CCACHE_DIR=/root/.ccache DEBIAN_FRONTEND=noninteractive CI="${CI:-}" bash -c "$1"
}

# shellcheck disable=SC2086
missing=$(in_chroot "for p in $(echo $PACKAGES); do
                       dpkg-query -W -f='\${Status}' \$p 2>/dev/null | grep -q 'install ok installed' || echo \$p
                     done")
if [[ -n $missing ]]; then
  log "installing in the chroot: $(echo $missing)"
  in_chroot "apt-get update -qq && apt-get install -y -qq --no-install-recommends $(echo $missing) >/dev/null"
fi

[[ ${PREPARE_ONLY:-0} == 1 ]] && { log "chroot ready at $CHROOT"; exit 0; }

# --- 2. configure, build, test --------------------------------------------------------------------
log "LibTorch in the chroot: libtorch-dev $(in_chroot "dpkg-query -W -f='\${Version}' libtorch-dev")"
in_chroot "[ -f /root/build/build.ninja ] || cmake -S /src -B /root/build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null"
in_chroot "cmake --build /root/build -j $JOBS ${TARGETS:+--target $TARGETS}"
log "test suite against LibTorch $(in_chroot "cat /root/build/libtorch_version.txt")"
ctest_args=""
[[ ${ALL_TESTS:-0} == 1 ]] || ctest_args="-LE once "
[[ $# -gt 0 ]] && ctest_args+=$(printf '%q ' "$@")
in_chroot "cd /root/build && ctest --output-on-failure -j ${DDP_TEST_JOBS:-2} $ctest_args"
