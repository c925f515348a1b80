#!/usr/bin/env python3
"""GPU time per kernel over one training step, from Nsight Compute's CSV.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \\
        PROGRAM ... > run.csv
    scripts/ncu_step.py run.csv MARKER [TOP]

A step is the kernels between the last two launches of a kernel whose name
matches the regular expression MARKER (one that runs once per step, such as
the loss's); prints the step's kernel count and GPU time, then the TOP
kernels (default 30) by their time in it.
"""
import collections
import csv
import re
import sys


def launches(path):
    lines = open(path, errors="replace").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    header = rows[0]
    name, time = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    unit = rows[1][time]
    scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}[unit]
    out = []
    for row in rows[2:]:
        try:
            out.append((row[name], float(row[time].replace(",", "")) * scale))
        except (IndexError, ValueError):
            continue
    return out


def main():
    path, marker = sys.argv[1], sys.argv[2]
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    all_launches = launches(path)
    hits = [i for i, (k, _) in enumerate(all_launches) if re.search(marker, k)]
    if len(hits) < 2:
        sys.exit(f"{path}: {len(hits)} launches match {marker!r}; a step needs two")
    step = all_launches[hits[-2]:hits[-1]]
    total = sum(t for _, t in step)
    print(f"{path}: one step, {len(step)} kernels, {total:.2f} ms of GPU time")
    per = collections.defaultdict(lambda: [0, 0.0])
    for kernel, t in step:
        short = re.sub(r"\(.*", "", kernel)[:90]
        per[short][0] += 1
        per[short][1] += t
    for kernel, (count, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{t:9.3f} ms {100 * t / total:5.1f}% {count:5d}  {kernel}")


if __name__ == "__main__":
    main()
