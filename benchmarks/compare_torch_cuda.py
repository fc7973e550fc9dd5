#!/usr/bin/env python3
"""bench_cuda's cases in PyTorch on the same GPU, side by side with ours.

Runs build/bin/bench_cuda --json (or reads its output from --ours FILE),
then times the same cases with PyTorch on the same device and the same
method (3 warm-up calls, 5 rounds each closed by torch.cuda.synchronize,
the median round; the same input sets rotated where one set would fit in
L2): torch.matmul (bf16; f32 with and without TF32; f32 under autocast
bf16), F.layer_norm forward and forward + backward (fresh leaves, a given
output gradient), torch.softmax on the last axis, F.cross_entropy
forward and forward + backward (a fresh leaf each call), and an add of two
1-element tensors. Prints ours / theirs as throughput ratios (above 1:
nabla faster) with the targets: GEMM within 5% of torch.matmul (ratio >=
0.95); memory-bound ops at >= 80% of our own copy bandwidth.

    benchmarks/compare_torch_cuda.py [--bin build/bin] [--out results.json]

Exits 0 with a message when torch or a GPU is missing, or when bench_cuda
exits 77 (no GPU for nabla).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROUNDS, MAX_SETS, ROTATE_BYTES, LAUNCH_CALLS = 5, 8, 256 << 20, 10000

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("compare_torch_cuda: torch is not importable; skipped")
    sys.exit(0)


def sync():
    torch.cuda.synchronize()


def time_op(fn, budget, calls=0):
    """Median seconds per call, as bench_cuda's time_op."""
    for i in range(3):
        fn(i)
    sync()
    if calls <= 0:
        t0 = time.perf_counter()
        fn(0)
        sync()
        one = max(time.perf_counter() - t0, 1e-7)
        calls = min(max(int(budget / ROUNDS / one), 2), 100000)
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i % MAX_SETS)
        sync()
        rounds.append((time.perf_counter() - t0) / calls)
    return statistics.median(rounds)


def sets_for(nbytes):
    return max(1, min(MAX_SETS, -(-ROTATE_BYTES // nbytes)))


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def torch_gemm(case, dev, budget):
    s, kind = case["m"], case["dtype"]
    dt = torch.bfloat16 if kind == "bf16" else torch.float32
    g = torch.Generator(device=dev).manual_seed(7)
    a = torch.randn(s, s, device=dev, dtype=dt, generator=g)
    b = torch.randn(s, s, device=dev, dtype=dt, generator=g)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
    try:
        if kind == "bf16-compute":
            def fn(i):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    torch.matmul(a, b)
        else:
            def fn(i):
                torch.matmul(a, b)
        with torch.no_grad():
            t = time_op(fn, budget)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return 2.0 * s ** 3 / t * 1e-12, t


def torch_bandwidth(case, dev, budget):
    rows, cols, dt = case["m"], case["n"], DTYPES[case["dtype"]]
    name = case["name"]
    ce = "cross_entropy" in name
    es = torch.finfo(dt).bits // 8
    nsets = 1 if ce else sets_for(rows * cols * es)
    g = torch.Generator(device=dev).manual_seed(3)
    xs = [torch.randn(rows, cols, device=dev, dtype=dt, generator=g) for _ in range(nsets)]
    if "layer_norm" in name and "fwd+bwd" in name:
        w = 1 + 0.1 * torch.randn(cols, device=dev, dtype=dt, generator=g)
        b = 0.1 * torch.randn(cols, device=dev, dtype=dt, generator=g)
        gys = [torch.randn(rows, cols, device=dev, dtype=dt, generator=g) for _ in range(nsets)]

        def fn(i):
            leaf = xs[i % nsets].detach().requires_grad_()
            wl, bl = w.detach().requires_grad_(), b.detach().requires_grad_()
            F.layer_norm(leaf, (cols,), wl, bl, 1e-5).backward(gys[i % nsets])
    elif "layer_norm" in name:
        w = 1 + 0.1 * torch.randn(cols, device=dev, dtype=dt, generator=g)
        b = 0.1 * torch.randn(cols, device=dev, dtype=dt, generator=g)
        fn = lambda i: F.layer_norm(xs[i % nsets], (cols,), w, b, 1e-5)
    elif "softmax" in name:
        fn = lambda i: torch.softmax(xs[i % nsets], -1)
    elif "fwd+bwd" in name:
        tg = torch.randint(0, cols, (rows,), device=dev, generator=g)

        def fn(i):
            leaf = xs[i % nsets].detach().requires_grad_()
            F.cross_entropy(leaf, tg).backward()
    else:
        tg = torch.randint(0, cols, (rows,), device=dev, generator=g)
        fn = lambda i: F.cross_entropy(xs[i % nsets], tg)
    if "fwd+bwd" in name:
        t = time_op(fn, budget)
    else:
        with torch.no_grad():
            t = time_op(fn, budget)
    return case["bytes"] / t * 1e-9, t


def torch_launch(case, dev, budget):
    x = torch.full((1,), 1.5, device=dev)
    y = torch.full((1,), 2.5, device=dev)
    with torch.no_grad():
        if "synchronised" in case["name"]:
            def fn(i):
                torch.add(x, y)
                sync()
            return time_op(fn, budget, 2000)
        return time_op(lambda i: torch.add(x, y), budget, LAUNCH_CALLS)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("NABLA_BIN", os.path.join(HERE, "..", "build", "bin")))
    ap.add_argument("--ours", help="bench_cuda --json output to read instead of running bench_cuda")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds per case (over all rounds)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--out", help="write both sides' figures here as JSON")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("compare_torch_cuda: torch sees no GPU; skipped")
        return 0
    if a.ours:
        ours = json.load(open(a.ours))
    else:
        binary = os.path.join(a.bin, "bench_cuda")
        if not os.access(binary, os.X_OK):
            print(f"compare_torch_cuda: {binary} not found; build first", file=sys.stderr)
            return 1
        p = subprocess.run([binary, "--json", "--device", str(a.device), "--budget", str(a.budget)],
                           capture_output=True, text=True)
        if p.returncode == 77:
            print("compare_torch_cuda: bench_cuda found no GPU (" + p.stderr.strip() + "); skipped")
            return 0
        if p.returncode != 0:
            print(p.stdout + p.stderr, file=sys.stderr)
            print(f"compare_torch_cuda: bench_cuda exited {p.returncode}", file=sys.stderr)
            return 1
        ours = json.loads(p.stdout)
    if ours.get("cpu"):
        print("compare_torch_cuda: bench_cuda ran with --cpu; nothing to compare")
        return 0
    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(dev)}; nabla on {ours['device']}"
          f"{' (--quick sizes)' if ours.get('quick') else ''}")
    print("ratio = nabla / torch throughput (above 1: nabla faster); medians of 5 rounds each side\n")
    rows = []
    print(f"{'case':36} {'shape':22} {'nabla':>10} {'torch':>10} {'ratio':>6}  target")
    for c in ours["cases"]:
        if c["group"] == "gemm":
            theirs, t = torch_gemm(c, dev, a.budget)
            ok = c["tflops"] >= 0.95 * theirs
            print(f"{c['name']:36} {str(c['m']) + '^3':22} {c['tflops']:10.1f} {theirs:10.1f} "
                  f"{c['tflops'] / theirs:6.2f}  TFLOP/s, >= 0.95: {'met' if ok else 'MISSED'}")
            rows.append(dict(c, torch_tflops=theirs, torch_seconds=t))
        elif c["group"] == "bandwidth":
            theirs, t = torch_bandwidth(c, dev, a.budget)
            pct = 100 * c["gbps"] / c["copy_gbps"]
            shape = f"{c['dtype']} ({c['m']}, {c['n']})"
            print(f"{c['name']:36} {shape:22} {c['gbps']:10.1f} {theirs:10.1f} {c['gbps'] / theirs:6.2f}  "
                  f"GB/s, {pct:.0f}% of our copy, >= 80%: {'met' if pct >= 80 else 'MISSED'}")
            rows.append(dict(c, torch_gbps=theirs, torch_seconds=t))
        elif c["group"] == "launch":
            t = torch_launch(c, dev, a.budget)
            print(f"{c['name'][:36]:36} {'1':22} {c['seconds'] * 1e6:8.2f}us {t * 1e6:8.2f}us "
                  f"{t / c['seconds']:6.2f}  time per call")
            rows.append(dict(c, torch_seconds=t))
        sys.stdout.flush()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"nabla_device": ours["device"], "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(dev), "cases": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
