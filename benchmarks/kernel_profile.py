#!/usr/bin/env python3
"""One training step kernel by kernel, beside the meta device's projection
(benchmarks/gpu_check.sh --phase perf).

--ncu: the CSV of `ncu --clock-control none --metrics gpu__time_duration.sum
--csv --print-units base` over a bench_gpt2 run of one step; its kernels are
grouped by name (template arguments and parameters cut), with launches, total
and mean time and share of the step's kernel time. --meta: the output of
`bench_gpt2 --device meta:cuda ...`, shown as it is, its per-entry table
being the projection for the same step; its `launches=` figure (the issue's
--machine line) is set against the launches measured.

    python3 benchmarks/kernel_profile.py --ncu ncu.csv --meta meta.log
"""
import argparse
import csv
import re
import sys


def short(name):
    name = re.sub(r"\(.*$", "", name)  # parameters
    depth, out = 0, []
    for ch in name:  # template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    s = "".join(out).replace("void ", "").strip()
    return s[:70]


def read_ncu(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # the CSV rows; ncu's own notes start with ==
    kernels = {}
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            ns = float(row["Metric Value"].replace(",", ""))
        except ValueError:
            continue
        k = kernels.setdefault(short(row["Kernel Name"]), [0, 0.0])
        k[0] += 1
        k[1] += ns / 1e3
    return kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ncu")
    ap.add_argument("--meta")
    a = ap.parse_args()
    launches = None
    if a.ncu:
        try:
            kernels = read_ncu(a.ncu)
        except OSError as e:
            kernels = {}
            print("ncu: %s" % e)
        total = sum(v[1] for v in kernels.values())
        launches = sum(v[0] for v in kernels.values())
        print("measured (ncu --clock-control none, one step at batch 8, the first: plans made "
              "then too): %d kernels, %.3f ms of kernel time" % (launches, total / 1e3))
        print("%-70s %8s %12s %10s %7s" % ("kernel", "launches", "total us", "mean us", "share"))
        for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
            print("%-70s %8d %12.1f %10.2f %6.1f%%" % (name, n, us, us / n, 100 * us / total if total else 0))
    else:
        print("measured: no ncu profile (ncu not found)")
    print()
    meta = ""
    if a.meta:
        try:
            meta = open(a.meta).read()
        except OSError as e:
            meta = "%s\n" % e
    if "launches=" in meta or "bytes_moved" in meta:
        print("projected (bench_gpt2 --device meta:cuda, the same step):")
        sys.stdout.write(meta)
        m = re.search(r"\blaunches=(\d+)", meta)
        if m and launches is not None:
            print("\nlaunches: measured %d, projected %s (%.2fx)" % (launches, m.group(1),
                                                               launches / max(1, int(m.group(1)))))
    else:
        print("projected: the meta device gave no table (bench_gpt2 --device meta:cuda is not in "
              "this build, or failed):")
        sys.stdout.write("".join(meta.splitlines(True)[-5:]))


if __name__ == "__main__":
    main()
