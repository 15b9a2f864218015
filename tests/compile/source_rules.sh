#!/usr/bin/env bash
# Rules about our C++ sources that no compiler here can check, each with the reason it exists.
#   source_rules.sh <repository root>
# Exit 0 when every rule holds, else 1 with each offending line and what to use instead.
set -uo pipefail
root=$1
status=0
sources() { find "$root" \( -name 'build*' -o -name '.*' \) -prune -o \( -name '*.cpp' -o -name '*.h' \) -print; }

# 1. No std::filesystem::remove_all. PyPI's torch 2.11 (cu130) exports its own copy of it from
#    libtorch.so; a program linked to torch calls that copy instead of libstdc++'s, and it jumps to
#    address 0 (seen on the lent H200, 2026-11-28: every multi-process test crashed cleaning up its
#    temp folder; the other std::filesystem calls we use work there). Remove the entries one by one
#    (std::remove over a directory_iterator, or nftw with FTW_DEPTH | FTW_PHYS).
if hits=$(sources | xargs grep -n -E '(filesystem|fs)::remove_all\b' /dev/null | grep -v -E '^[^:]+:[0-9]+:\s*//'); then
  echo "std::filesystem::remove_all is used (torch 2.11's libtorch.so exports a copy of it that crashes):"
  echo "$hits"
  status=1
fi
exit $status
