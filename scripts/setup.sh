#!/usr/bin/env bash
# Installs every dependency of torchddp on Debian bookworm. Idempotent: silent when all present.
# With arguments, installs those packages instead (a script's own extras: scripts/windows_syntax.sh).
set -euo pipefail
packages=(cmake g++ ninja-build ccache pkg-config zlib1g-dev
          libssl-dev            # ddprun: HMAC-SHA256 for the launchers' store
          libtorch-dev libgloo-dev libfmt-dev libgtest-dev libgmock-dev libcli11-dev
          nlohmann-json3-dev dataset-fashion-mnist gnuplot-nox procps iproute2
          libopenblas0-pthread  # a real BLAS: Debian's LibTorch otherwise uses the reference one
          openmpi-bin           # the test that the main job runs under mpirun
          slurm-wlm munge       # ... and under srun/sbatch of a one-node Slurm the test starts
          openssh-server        # ... and ddprun -H over ssh between two network-namespace hosts (tests/launch)
          clang libclang-rt-14-dev  # scripts/fuzz.sh: libFuzzer
          python3-torch)  # python3-torch: the checkpoint test that Python reads our files
[ $# -gt 0 ] && packages=("$@")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "setup: installing ${missing[*]}"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
