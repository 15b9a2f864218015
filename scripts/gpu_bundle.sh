#!/usr/bin/env bash
# The dependencies scripts/gpu_check.sh needs and a bare GPU machine lacks, in one folder that
# travels with the working tree: the header-only libraries, GoogleTest's sources, Gloo's, OpenSSL's
# and zlib's headers, and Fashion-MNIST (the main job's data). A machine with PyTorch, CMake, ninja
# and a C++ compiler but none of our Debian packages (and no package manager) then builds and runs
# the GPU check: the build takes each dependency from the system when it has it, else from here
# (-DDDP_DEPS_BUNDLE=<folder>, cmake/DepsBundle.cmake).
#
#   bash scripts/gpu_bundle.sh            # makes .gpu-bundle/ (git-ignored), ~35 MiB
#   bash scripts/gpu_bundle.sh /some/dir  # elsewhere
#
# Everything comes from Debian's own packages (apt-get download: the .deb files only, nothing is
# installed), at the versions this machine's apt knows, so the bundle holds what the suite is
# built and tested with here. What is NOT in it, and why:
#   - LibTorch, CUDA, NCCL: the machine's PyTorch brings them (torch.utils.cmake_prefix_path).
#   - the libcrypto.so.3 and libz.so.1 that ddprun and the checkpoint code link to: every Linux
#     with python3 has them (its ssl and zlib modules load them); the bundle holds their headers.
#   - GoogleMock: no test uses it.
# Limit: 40 MiB (a GPU machine's call carries at most 64 MiB, the working tree included); the
# script fails if the bundle grows past it. MANIFEST lists each package, its version and the
# sha256 of its .deb; licenses/ holds each package's copyright file.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${1:-$PWD/.gpu-bundle}
limit_mib=40
log() { echo "[gpu-bundle] $*"; }

# package -> what of it the bundle keeps (paths inside the .deb -> folder in the bundle)
packages=(libcli11-dev nlohmann-json3-dev libgloo-dev libssl-dev zlib1g-dev googletest dataset-fashion-mnist)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log "downloading ${packages[*]}"
# apt-get download needs the package lists; scripts/setup.sh's apt-get update made them (CI), else
# make them once here.
if ! (cd "$work" && timeout 600 apt-get download -qq "${packages[@]}" >/dev/null 2>"$work/apt.err"); then
  log "apt-get download failed ($(head -c 300 "$work/apt.err")); refreshing the package lists once"
  [[ $(id -u) -eq 0 ]] && timeout 600 apt-get update -qq || sudo -n timeout 600 apt-get update -qq
  (cd "$work" && timeout 600 apt-get download -qq "${packages[@]}" >/dev/null)
fi

staging=$work/staging
rm -rf "$staging" && mkdir -p "$staging"/{licenses,cli11/include,nlohmann_json/include,gloo/include,openssl/include/openssl,zlib/include,fashion-mnist}
{
  echo "# torchddp dependency bundle (scripts/gpu_bundle.sh), made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "# package version sha256(.deb)"
} >"$staging/MANIFEST"
for p in "${packages[@]}"; do
  deb=$(ls "$work"/"${p}"_*.deb)
  root=$work/root-$p
  dpkg-deb -x "$deb" "$root"
  echo "$p $(dpkg-deb -f "$deb" Version) $(sha256sum "$deb" | cut -d' ' -f1)" >>"$staging/MANIFEST"
  cp "$root/usr/share/doc/$p/copyright" "$staging/licenses/$p.copyright" 2>/dev/null || true
  case $p in
    libcli11-dev)       cp -r "$root/usr/include/CLI" "$staging/cli11/include/" ;;
    nlohmann-json3-dev) cp -r "$root/usr/include/nlohmann" "$staging/nlohmann_json/include/" ;;
    libgloo-dev)        cp -r "$root/usr/include/gloo" "$staging/gloo/include/" ;;
    # Debian puts configuration.h in the multiarch folder; one include folder holds both here.
    libssl-dev)         cp -r "$root/usr/include/openssl/." "$root"/usr/include/*-linux-gnu/openssl/. \
                           "$staging/openssl/include/openssl/" ;;
    zlib1g-dev)         cp "$root/usr/include/zlib.h" "$root/usr/include/zconf.h" "$staging/zlib/include/" ;;
    # GoogleTest's sources without GoogleMock, docs and its own tests (built by DepsBundle.cmake).
    googletest)
      src=$root/usr/src/googletest
      mkdir -p "$staging/googletest/googletest"
      cp "$src/CMakeLists.txt" "$staging/googletest/"
      cp -r "$src/googletest/CMakeLists.txt" "$src/googletest/cmake" "$src/googletest/include" "$src/googletest/src" \
            "$staging/googletest/googletest/" ;;
    dataset-fashion-mnist) cp "$root"/usr/share/datasets/fashion-mnist/*-ubyte.gz "$staging/fashion-mnist/" ;;
  esac
done
for f in CLI/CLI.hpp nlohmann/json.hpp gloo/config.h openssl/hmac.h openssl/configuration.h zlib.h; do
  ls "$staging"/*/include/"$f" >/dev/null 2>&1 || { log "missing from the bundle: $f"; exit 1; }
done
[[ $(ls "$staging/fashion-mnist" | wc -l) -eq 4 ]] || { log "Fashion-MNIST: expected 4 files"; exit 1; }

size_kib=$(du -sk "$staging" | cut -f1)
if ((size_kib > limit_mib * 1024)); then
  log "the bundle is $((size_kib / 1024)) MiB, over its limit of $limit_mib MiB"
  exit 1
fi
rm -rf "$bundle"
mkdir -p "$(dirname "$bundle")"
mv "$staging" "$bundle"
log "$bundle: $(du -sh "$bundle" | cut -f1) ($(grep -vc '^#' "$bundle/MANIFEST") packages; limit $limit_mib MiB)"
