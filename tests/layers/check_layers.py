#!/usr/bin/env python3
"""The layering rules of torchddp, checked over every #include line of the tree.

    check_layers.py SOURCE_DIR        exit 0 and "layers: ok (N includes in M files)", or
                                      exit 1 listing each include that breaks a rule

The parts, bottom to top (CMakeLists.txt builds each as an OBJECT library whose include path
already enforces rule 1; this script states every rule once and catches what a path cannot, such
as a test reaching into a part's src/):

    ddp/internal   private to the library: compat/ (LibTorch version shims, optimizer state's
                   tensors), diagnostics/ (error text, message lists, debug level), numbers/
    ddp/floor      process groups, collectives, desync, heartbeat, launch environment, metrics
    ddp/engine     DistributedDataParallel (reducer/, hooks/, join/, observe/), ZeRO, FSDP
    sampler, checkpoint, amp, nn   on the floor (checkpoint also on the sampler: TrainingState)

Rules:
  1. A part includes public headers only of itself and of the parts it may use (USES below).
  2. A private header (a part's src/, or ddp/internal) is included only by its own part (its unit
     tests and micro-benchmarks beside the sources, ddp/**/*_test.cpp, included); the engine may
     include the floor's; every part may include ddp/internal.
  3. Installed headers (<part>/include, include/) never include a private header.
  4. launch/ (ddprun: no LibTorch) includes no library header at all.
  5. A private header is named by its path from the repository root ("ddp/floor/src/backends.h",
     not "backends.h"), so the include line says which part it belongs to.
"""
import os
import re
import sys

PARTS = {  # part -> folder
    "internal": "ddp/internal",
    "floor": "ddp/floor",
    "engine": "ddp/engine",
    "sampler": "sampler",
    "checkpoint": "checkpoint",
    "amp": "amp",
    "nn": "nn",
}
USES = {  # the public headers a part may include besides its own
    "internal": set(),
    "floor": set(),
    "engine": {"floor"},
    "sampler": {"floor"},
    "checkpoint": {"floor", "sampler"},
    "amp": {"floor"},
    "nn": {"floor"},
}
SEES_PRIVATE = {"engine": {"floor"}}  # besides its own src/ and ddp/internal
SKIP_DIRS = {".git", "build", "build-fuzz", "build-sanitize", ".ccache", "corpus"}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def part_of(path):
    for part, folder in PARTS.items():
        if path == folder or path.startswith(folder + "/"):
            return part
    return None


def index_headers(root):
    """public: 'ddp/x.h' -> part; private: repo path ('ddp/floor/src/x.h') -> part."""
    public, private = {}, {}
    for part, folder in PARTS.items():
        base = os.path.join(root, folder)
        for dirpath, _, files in os.walk(base):
            for name in files:
                if not name.endswith(".h"):
                    continue
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, base)
                if rel.startswith("include" + os.sep):
                    public[os.path.relpath(full, os.path.join(base, "include"))] = part
                else:
                    private[os.path.relpath(full, root)] = part
    return public, private


def bare_private(root, path, name, private):
    """The private header a quoted include names other than by its repo path, or None: the name
    relative to the including file's folder, or a part's src/ or ddp/internal as the old include
    paths had it."""
    bases = [os.path.dirname(path)] + [os.path.join(folder, "src") for folder in PARTS.values()] + ["ddp/internal"]
    for base in bases:
        candidate = os.path.normpath(os.path.join(base, name))
        if candidate in private:
            return candidate
    return None


def sources(root):
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(("build", "."))]
        for name in files:
            if name.endswith((".h", ".cpp", ".cc", ".hpp")):
                yield os.path.relpath(os.path.join(dirpath, name), root)


def check(root):
    public, private = index_headers(root)
    problems, count, files = [], 0, 0
    for path in sources(root):
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            text = f.read()
        part = part_of(path)
        installed = "/include/" in "/" + path
        files += 1
        for kind, name in INCLUDE.findall(text):
            count += 1
            owner = public.get(name)
            if owner is not None:  # a public header of the library
                if path.startswith("launch/"):
                    problems.append(f"{path}: includes <{name}> ({owner}): ddprun includes no library header (rule 4)")
                elif part is not None and owner != part and owner not in USES[part]:
                    problems.append(f"{path}: includes <{name}>, a header of {owner}, which {part} may not use "
                                    f"(rule 1: {part} uses {sorted(USES[part]) or 'nothing'})")
                continue
            # A private header: named by its repo path, which says whose it is.
            owner = private.get(name)
            if owner is None:
                if kind == '"' and (part is not None or path.startswith(("tests/", "benchmarks/"))):
                    named = bare_private(root, path, name, private)
                    if named is not None:
                        problems.append(f'{path}: includes "{name}": name a private header by its path from the '
                                        f'repository root, "{named}" (rule 5)')
                continue  # a system, LibTorch or test-local header
            if part == owner:
                continue  # its own
            allowed = part is not None and (owner == "internal" or owner in SEES_PRIVATE.get(part, set()))
            if installed:
                problems.append(f"{path}: an installed header includes the private header {name} of {owner} (rule 3)")
            elif not allowed:
                where = f"part {part}" if part else "outside the library"
                problems.append(f"{path}: includes the private header {name} of {owner} from {where} (rule 2)")
    return problems, count, files


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    problems, count, files = check(root)
    if problems:
        print(f"layers: {len(problems)} include(s) break the layering:")
        for problem in problems:
            print("  " + problem)
        return 1
    print(f"layers: ok ({count} includes in {files} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
