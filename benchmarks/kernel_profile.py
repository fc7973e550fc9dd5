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

--events: per-entry totals timed with CUDA events around the backend's
entries (the file `bench_gpt2 --profile-events FILE` writes, Note [Events
profile] in tensor/cuda/profile.cu), one line each, `entry calls us` (tab
or space separated, `#` comments), the entries named as the meta device
names them ("matmul", "binary.add", "copy.f32>bf16"); each is set beside the meta
table's row of that name: calls, projected and measured microseconds, their
ratio, and `!` where they differ by more than 30% (issue 34's bound), with
the entries only one side has listed after.

    python3 benchmarks/kernel_profile.py --ncu ncu.csv --meta meta.log
    python3 benchmarks/kernel_profile.py --events events.txt --meta meta.log
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


def read_events(path):
    """{entry: [calls, us]} from an events profile."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 3:
                raise ValueError("%s: not `entry calls us`: %r" % (path, line))
            e = out.setdefault(parts[0], [0, 0.0])
            e[0] += int(parts[1])
            e[1] += float(parts[2])
    return out


def meta_table_rows(text):
    """The rows of bench_gpt2 --device meta:cuda's per-entry table, split, its total row last."""
    inside = False
    for line in text.splitlines():
        if line.startswith("entry "):
            inside = True
            continue
        parts = line.split()
        if not inside or not parts:
            if inside:
                return
            continue
        yield parts
        if parts[0] == "total":
            return


def read_meta_table(text):
    """{entry: (calls, projected us)} from the per-entry table."""
    rows = {}
    for parts in meta_table_rows(text):
        if parts[0] == "total":
            break
        try:
            rows[parts[0]] = (int(parts[1]), float(parts[6]))
        except (IndexError, ValueError):
            break
    return rows


def meta_launches(text):
    """The projected launches of a step: the `launches=` of bench_gpt2's --machine line, or
    the launches column of its per-entry table's total row; None when the text has neither."""
    m = re.search(r"\blaunches=(\d+)", text)
    if m:
        return int(m.group(1))
    for parts in meta_table_rows(text):
        if parts[0] == "total":
            try:
                return int(parts[2])
            except (IndexError, ValueError):
                return None
    return None


def join_events(events, meta_rows):
    """The per-entry table of measured against projected times; the count of entries off by more than 30%."""
    names = sorted(set(events) & set(meta_rows), key=lambda n: -events[n][1])
    total_m = sum(v[1] for v in events.values())
    total_p = sum(v[1] for v in meta_rows.values())
    print("measured (CUDA events around the backend's entries, one step) against projected (meta:cuda):")
    print("%-28s %7s %7s %12s %12s %7s" % ("entry", "calls", "proj.", "measured us", "proj. us", "ratio"))
    off = 0
    for n in names:
        (c, us), (pc, pus) = events[n], meta_rows[n]
        ratio = us / pus if pus else float("inf")
        flag = "" if 1 / 1.3 <= ratio <= 1.3 else " !"
        off += bool(flag)
        print("%-28s %7d %7d %12.1f %12.1f %6.2fx%s" % (n, c, pc, us, pus, ratio, flag))
    for n in sorted(set(events) - set(meta_rows)):
        print("%-28s %7d %7s %12.1f %12s  (measured only)" % (n, events[n][0], "-", events[n][1], "-"))
    for n in sorted(set(meta_rows) - set(events)):
        print("%-28s %7s %7d %12s %12.1f  (projected only)" % (n, "-", meta_rows[n][0], "-", meta_rows[n][1]))
    print("step: measured %.3f ms, projected %.3f ms (%.2fx); %d of %d entries off by more than 30%%"
          % (total_m / 1e3, total_p / 1e3, total_m / total_p if total_p else float("inf"), off, len(names)))
    return off


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ncu")
    ap.add_argument("--meta")
    ap.add_argument("--events")
    a = ap.parse_args()
    launches = None
    if a.events:
        meta = open(a.meta).read() if a.meta else ""
        try:
            events = read_events(a.events)
        except (OSError, ValueError) as e:
            print("events: %s" % e)
            return 1
        join_events(events, read_meta_table(meta))
        return 0
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
    projected = meta_launches(meta)
    if projected is not None:
        print("projected (bench_gpt2 --device meta:cuda, the same step):")
        sys.stdout.write(meta)
        if launches is not None:
            print("\nlaunches: measured %d, projected %d (%.2fx)" % (launches, projected,
                                                               launches / max(1, projected)))
    else:
        print("projected: the meta device gave no table (bench_gpt2 --device meta:cuda is not in "
              "this build, or failed):")
        sys.stdout.write("".join(meta.splitlines(True)[-5:]))


if __name__ == "__main__":
    sys.exit(main())
