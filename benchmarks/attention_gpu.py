#!/usr/bin/env python3
"""Causal attention on one GPU: nabla's paths against PyTorch's
scaled_dot_product_attention(is_causal=True), at (N, H, T, D) = (8, 12,
1024, 64) in bf16 unless --shape says otherwise.

Runs bench_attention once per path: `composed` (the products and causal
softmax nn/attention.c composes, bench_attention --composed), and each fused
path asked for through NABLA_CUDA_ATTENTION (`own`, `cudnn`). A path the
library does not have shows as missing: the program exits with an error, or
reports that it ran the composed form. Then PyTorch on the same qkv layout
(one (N, T, 3C) tensor split into heads), forward and forward + backward,
median of 5 rounds each closed by a synchronisation. Prints one table; with
--out, the rows as JSON too.

    python3 benchmarks/attention_gpu.py --bin build-gpu/bin [--shape 8 12 1024 64]
"""
import argparse
import json
import os
import subprocess
import sys

PATHS = ("composed", "own", "cudnn")


def ours(binary, path, shape, timeout):
    env = dict(os.environ, NABLA_CUDA_ATTENTION=path)
    cmd = [binary, "--machine", "--shape"] + [str(s) for s in shape]
    if path == "composed":
        cmd.append("--composed")
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"path": path, "status": "timed out after %d s" % timeout}
    err = (p.stderr.strip().splitlines() or [""])[-1]
    line = next((l for l in p.stdout.splitlines() if l.startswith("attention ")), None)
    if p.returncode != 0 or line is None:
        return {"path": path, "status": "missing or failed (exit %d): %s" % (p.returncode, err)}
    kv = dict(f.split("=", 1) for f in line.split()[1:])
    row = {"path": path, "ran": kv["path"], "fwd_ms": float(kv["fwd_ms"]),
           "fwd_bwd_ms": float(kv["fwd_bwd_ms"]), "peak_step_gib": float(kv["peak_step_gib"])}
    if path != "composed" and kv["path"] != "fused":
        row["status"] = "missing: the library ran the composed form"
    else:
        row["status"] = "ok"
    if err:
        row["stderr"] = err
    return row


def torch_sdpa(shape):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        return {"path": "torch sdpa", "status": "no PyTorch: %s" % e}
    if not torch.cuda.is_available():
        return {"path": "torch sdpa", "status": "PyTorch sees no GPU"}
    n, h, t, d = shape
    c = h * d
    g = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randn(n, t, 3 * c, device="cuda", dtype=torch.bfloat16, generator=g)
    gy = torch.randn(n, t, c, device="cuda", dtype=torch.bfloat16, generator=g)

    def call(backward):
        qkv = base.detach().clone().requires_grad_(backward)
        q, k, v = (x.view(n, t, h, d).transpose(1, 2) for x in qkv.split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(n, t, c)
        if backward:
            y.backward(gy)

    def timed(backward, calls=10):
        import time
        for _ in range(3):
            call(backward)
        torch.cuda.synchronize()
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                call(backward)
            torch.cuda.synchronize()
            rounds.append((time.perf_counter() - t0) / calls)
        return sorted(rounds)[2]

    torch.cuda.reset_peak_memory_stats()
    fwd, both = timed(False), timed(True)
    return {"path": "torch sdpa", "ran": "sdpa %s" % torch.__version__, "status": "ok",
            "fwd_ms": 1e3 * fwd, "fwd_bwd_ms": 1e3 * both,
            "peak_step_gib": torch.cuda.max_memory_allocated() / 2**30}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="build-gpu/bin")
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 12, 1024, 64], metavar=("N", "H", "T", "D"))
    ap.add_argument("--timeout", type=int, default=90)
    ap.add_argument("--out")
    a = ap.parse_args()
    binary = os.path.join(a.bin, "bench_attention")
    if not os.access(binary, os.X_OK):
        sys.exit("attention_gpu: %s not found (build first)" % binary)
    rows = [ours(binary, p, a.shape, a.timeout) for p in PATHS] + [torch_sdpa(a.shape)]
    n, h, t, d = a.shape
    flop = 2 * 2 * n * h * d * t * (t + 1) / 2
    ref = rows[-1].get("fwd_bwd_ms")
    print("causal attention (N, H, T, D) = (%d, %d, %d, %d), bf16; forward + backward TFLOP/s "
          "count 3.5x the forward's causal products" % (n, h, t, d))
    print("%-11s %-10s %10s %10s %12s %10s %8s  %s" % ("path", "ran", "fwd ms", "fwd TF/s",
                                                      "fwd+bwd ms", "f+b TF/s", "x torch", "status"))
    for r in rows:
        if "fwd_ms" not in r:
            print("%-11s %-10s %10s %10s %12s %10s %8s  %s" % (r["path"], "-", "-", "-", "-", "-", "-",
                                                              r["status"]))
            continue
        vs = "%.2f" % (ref / r["fwd_bwd_ms"]) if ref else "-"
        print("%-11s %-10s %10.3f %10.1f %12.3f %10.1f %8s  %s%s" % (
            r["path"], r["ran"].split()[0], r["fwd_ms"], flop / r["fwd_ms"] / 1e9, r["fwd_bwd_ms"],
            3.5 * flop / r["fwd_bwd_ms"] / 1e9, vs, r["status"],
            " (%s)" % r["stderr"] if r.get("stderr") else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
