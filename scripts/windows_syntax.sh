#!/usr/bin/env bash
# Windows, as far as this Linux machine can show it: every library source the Windows build
# compiles is run through MinGW-w64's g++ (x86_64-w64-mingw32, POSIX threads: std::thread) with
# -fsyntax-only against LibTorch's headers. Syntax and declarations only: nothing is linked or run.
# The file list and each file's flags come from CMake itself, configured for Windows with the cross
# compiler (CMAKE_SYSTEM_NAME=Windows), so WIN32's choices in CMakeLists.txt (the shared-memory core
# left out) and new files are picked up without a list here.
# Usage: bash scripts/windows_syntax.sh   (root or sudo: installs the cross compiler once)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
cxx=x86_64-w64-mingw32-g++-posix  # the -posix variant: the -win32 one has no std::thread/std::mutex
bash scripts/setup.sh g++-mingw-w64-x86-64-posix cmake ninja-build python3 libtorch-dev libgloo-dev zlib1g-dev

work=$(mktemp -d /tmp/torchddp-windows-syntax.XXXXXX)
trap 'rm -rf "$work"' EXIT

# --- the shims: LibTorch's Debian headers describe a Linux build; these make them read as a Windows one
# view/: only what the library's includes need from /usr/include, as links (glibc's own headers
# must stay unreachable, so a POSIX header the library uses fails here as it would on Windows).
mkdir -p "$work/view" "$work/override/c10/macros" "$work/torch-cmake"
for entry in torch ATen c10 caffe2 gloo zlib.h zconf.h; do
  ln -s "/usr/include/$entry" "$work/view/$entry"
done
# cmake_macros.h as LibTorch's default Windows build has it: no glog, gflags or NUMA (Debian's Linux
# build has them), and C10_BUILD_SHARED_LIBS off, else MinGW rejects the inline functions it marks dllimport.
sed -E 's|^#define (C10_BUILD_SHARED_LIBS\|C10_USE_GLOG\|C10_USE_GFLAGS\|C10_USE_NUMA)$|/* #undef \1 */|' \
  /usr/include/c10/macros/cmake_macros.h > "$work/override/c10/macros/cmake_macros.h"
[ "$(grep -c '^#define' "$work/override/c10/macros/cmake_macros.h")" -eq 1 ] ||  # the include guard only
  { echo "windows_syntax: c10/macros/cmake_macros.h has a setting this script does not know"; exit 1; }
# Gloo spells the Windows SDK's header BaseTsd.h; MinGW's is basetsd.h (Linux file names are case-sensitive).
echo '#include <basetsd.h>' > "$work/override/BaseTsd.h"
# <objbase.h> defines `interface` as a macro; ProcessGroupGloo.hpp names a parameter `interface`: undo it first.
mkdir -p "$work/override/torch/csrc/distributed/c10d"
cat > "$work/override/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp" <<'EOF'
#undef interface
#include_next <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
EOF
# find_package(Torch) and find_package(ZLIB) for the cross build: headers only, nothing to link;
# LibTorch's Windows builds define USE_DISTRIBUTED and USE_C10D_GLOO (no RPC/TensorPipe there).
cat > "$work/torch-cmake/TorchConfig.cmake" <<EOF
add_library(torch INTERFACE IMPORTED)
set_target_properties(torch PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "$work/override;$work/view;$work/view/torch/csrc/api/include"
  INTERFACE_COMPILE_DEFINITIONS "USE_DISTRIBUTED;USE_C10D_GLOO")
set(TORCH_LIBRARIES torch)
set(TORCH_INCLUDE_DIRS $work/view $work/view/torch/csrc/api/include)
include(/usr/lib/x86_64-linux-gnu/cmake/Torch/TorchConfigVersion.cmake)
set(Torch_VERSION \${PACKAGE_VERSION})
set(Torch_FOUND TRUE)
EOF
cat > "$work/toolchain.cmake" <<EOF
set(CMAKE_SYSTEM_NAME Windows)
set(CMAKE_CXX_COMPILER $cxx)
EOF

# --- CMake, configured for Windows: the library only, its compile commands written out (one per
# source: no unity batches, so a failure names its file)
echo "== windows_syntax: configuring for Windows ($cxx)"
cmake -S . -B "$work/build" -G Ninja --log-level=WARNING \
  -DCMAKE_TOOLCHAIN_FILE="$work/toolchain.cmake" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTorch_DIR="$work/torch-cmake" -DZLIB_INCLUDE_DIR="$work/view" -DZLIB_LIBRARY="$work/no-zlib-linked" \
  -DCCACHE_PROGRAM=CCACHE_PROGRAM-NOTFOUND -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DDDP_UNITY_BUILD=OFF \
  -DDDP_BUILD_TESTS=OFF -DDDP_BUILD_EXAMPLES=OFF -DDDP_BUILD_LAUNCHER=OFF \
  -DDDP_BUILD_BENCHMARKS=OFF -DDDP_INSTALL=OFF > "$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; exit 1; }

# The precompiled <torch/torch.h> the parts share, built once for real (each check then reads it
# instead of parsing LibTorch's headers again), and one small script per library source: its
# compile command with -fsyntax-only instead of -o/-c.
mkdir -p "$work/checks"
python3 - "$work/build/compile_commands.json" "$PWD" "$work" <<'EOF'
import json, shlex, sys
entries, source_dir, work = json.load(open(sys.argv[1])), sys.argv[2] + "/", sys.argv[3]
sources = sorted((e for e in entries if e["file"].startswith(source_dir)), key=lambda e: e["file"])
for e in entries:
    if not e["file"].startswith(source_dir):  # CMake's cmake_pch.hxx.cxx
        open(f"{work}/pch.sh", "w").write(f"cd {shlex.quote(e['directory'])} && exec {e['command']}\n")
for i, e in enumerate(sources):
    args, out, skip = shlex.split(e["command"]), [], False
    for a in args:
        if skip: skip = False; continue
        if a in ("-o", "-c"): skip = True; continue
        out.append(a)
    out.insert(1, "-fsyntax-only")
    with open(f"{work}/checks/{i:04d}.sh", "w") as f:
        f.write(f"# {e['file'][len(source_dir):]}\ncd {shlex.quote(e['directory'])} && exec {shlex.join(out)} {shlex.quote(e['file'])}\n")
EOF
total=$(ls "$work/checks" | wc -l)
[ "$total" -gt 0 ] || { echo "windows_syntax: CMake listed no library sources"; exit 1; }
echo "== windows_syntax: precompiling <torch/torch.h> for Windows"
[ ! -f "$work/pch.sh" ] || bash "$work/pch.sh" || { echo "windows_syntax: LibTorch's headers do not compile for Windows (above)"; exit 1; }

# --- the check: two files at a time (two cores); a failing file keeps its log
echo "== windows_syntax: checking $total library sources"
ls "$work"/checks/*.sh | xargs -P 2 -n 1 sh -c 'bash "$1" > "$1.log" 2>&1 || touch "$1.failed"' _
failed=0
for mark in "$work"/checks/*.failed; do
  [ -e "$mark" ] || continue
  failed=$((failed + 1))
  check=${mark%.failed}
  echo "-- FAILED: $(head -1 "$check" | cut -c3-)"
  grep -A 3 'error' "$check.log" | head -30
done
echo "== windows_syntax: $total files, $((total - failed)) passed, $failed failed, $((SECONDS - start)) s"
[ "$failed" -eq 0 ]
