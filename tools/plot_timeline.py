#!/usr/bin/env python3
"""Draws a few steps of a TORCHDDP_TIMELINE trace as a PNG (gnuplot), for the README.

    python3 tools/plot_timeline.py /tmp/trace.rank0.json timeline.png [--first 5] [--steps 3]

One row per trace row (training, bucket fill, communication, program), one box per span, over
the steps --first .. --first + --steps - 1 (the first steps rebuild and warm up). The trace itself
opens in https://ui.perfetto.dev or chrome://tracing; this is the picture for people who look
instead of read. Needs python3 and gnuplot (scripts/setup.sh installs gnuplot-nox).
"""
import argparse
import json
import os
import subprocess
import tempfile

ROWS = {1: "training", 2: "bucket fill", 3: "communication", 4: "program"}
COLOURS = {"forward": "#4e79a7", "backward": "#59a14f", "wait for reductions": "#e15759"}


def colour(name):
    if name in COLOURS:
        return COLOURS[name]
    if name.startswith("reduce"):
        return "#f28e2b"
    if name.startswith("bucket"):
        return "#76b7b2"
    return "#b07aa1"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("png")
    parser.add_argument("--first", type=int, default=5, help="first step drawn (0-based)")
    parser.add_argument("--steps", type=int, default=3, help="steps drawn")
    args = parser.parse_args()

    with open(args.trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    forwards = sorted(e["ts"] for e in events if e["name"] == "forward")
    if len(forwards) < args.first + args.steps:
        raise SystemExit(f"{args.trace} has {len(forwards)} steps; need {args.first + args.steps}")
    begin = forwards[args.first]
    end = forwards[args.first + args.steps] if len(forwards) > args.first + args.steps else float("inf")
    shown = [e for e in events if begin <= e["ts"] < end]
    end = max(e["ts"] + e["dur"] for e in shown)

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "spans.dat")
        with open(data, "w") as out:
            for e in shown:
                x0 = (e["ts"] - begin) / 1000.0
                x1 = (e["ts"] + e["dur"] - begin) / 1000.0
                y = 5 - e["tid"]  # training on top
                rgb = int(colour(e["name"])[1:], 16)
                out.write(f"{(x0 + x1) / 2} {y} {x0} {x1} {y - 0.35} {y + 0.35} {rgb}\n")
        tics = ", ".join(f'"{name}" {5 - tid}' for tid, name in ROWS.items())
        script = f"""
set terminal pngcairo size 1100,360 font ",10" noenhanced
set output "{args.png}"
set title "TORCHDDP_TIMELINE, rank 0, steps {args.first}-{args.first + args.steps - 1} (boxes: forward blue, backward green, \\
wait red, bucket fill teal, allreduce orange, program purple)"
set xlabel "ms"
set ytics ({tics})
set yrange [0.4:4.6]
set xrange [0:{(end - begin) / 1000.0}]
set grid xtics
unset key
plot "{data}" using 1:2:3:4:5:6:7 with boxxyerror fill solid 0.8 noborder lc rgb variable
"""
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    print(f"wrote {args.png} ({len(shown)} spans)")


if __name__ == "__main__":
    main()
