"""The meta device's programs: bench_gpt2 says what a step costs before it
starts (a meta pass), prints no MFU on a CPU, and prints peak_bytes the same
way on the CPU and on meta:cpu (equal within 2%); bench_gpt2 --device
meta:cuda prints the per-entry table and the --machine keys; gpu_fit (the
example) answers whether a GPT fits on a GPU.
"""
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import fail, run_bin as run  # noqa: E402

SMALL = ["--layers", "2", "--heads", "2", "--width", "32", "--seq-len", "32", "--vocab", "128",
         "--batch", "4"]


def keys(text):
    return dict(re.findall(r"(\w+)=(\S+)", text))


def main():
    p = run("bench_gpt2", ["--device", "cpu", "--steps", "2", "--warmup", "0"] + SMALL)
    if "a step at these shapes (meta device, meta:cpu): peak" not in p.stderr:
        fail("no cost line before the first step:\n" + p.stderr)
    if "step 1/2 took" in p.stderr:
        fail("a progress line for a step under 2 s:\n" + p.stderr)
    p = run("bench_gpt2", ["--device", "cpu", "--steps", "2", "--warmup", "1", "--progress-after", "0"]
            + SMALL)
    if not re.search(r"step 1/3 took [0-9.]+ s \(loss [0-9.]+\); about [0-9]+ s left\n.*step 3/3 took",
                     p.stderr, re.S):
        fail("no progress line per step with --progress-after 0:\n" + p.stderr)
    if "MFU" in p.stdout:
        fail("an MFU on a CPU, whose peak is unknown:\n" + p.stdout)
    if "peak_bytes" not in p.stdout:
        fail("no peak_bytes:\n" + p.stdout)
    cpu = keys(run("bench_gpt2", ["--device", "cpu", "--steps", "2", "--warmup", "0", "--machine"]
                   + SMALL).stdout)
    if "mfu" in cpu:
        fail("mfu= on a CPU: %s" % cpu)
    meta = keys(run("bench_gpt2", ["--device", "meta:cpu", "--machine"] + SMALL).stdout)
    a, b = int(cpu["peak_bytes"]), int(meta["peak_bytes"])
    if abs(a - b) > 0.02 * a:
        fail("peak_bytes: cpu %d, meta:cpu %d" % (a, b))

    p = run("bench_gpt2", ["--device", "meta:cuda", "--gpu", "a100", "--bf16"] + SMALL)
    for want in ("counted, not run", "NVIDIA A100", "matmul", "total", "projected step",
                 "roofline bound"):
        if want not in p.stdout:
            fail("meta:cuda table lacks %r:\n%s" % (want, p.stdout))
    m = keys(run("bench_gpt2", ["--device", "meta:cuda", "--gpu", "h100", "--bf16", "--machine"]
                 + SMALL).stdout)
    for k in ("peak_bytes", "bytes_moved", "gemm_flops", "launches", "params", "tokens", "mfu"):
        if k not in m:
            fail("meta:cuda --machine lacks %s=: %s" % (k, m))
    if int(m["tokens"]) != 4 * 32 or int(m["launches"]) <= 0 or float(m["gemm_flops"]) <= 0:
        fail("meta:cuda --machine figures: %s" % m)
    run("bench_gpt2", ["--device", "meta:cuda", "--gpu", "v100"] + SMALL, code=2)
    with tempfile.TemporaryDirectory(prefix="nb_test_meta_") as d:
        path = os.path.join(d, "trace")
        run("bench_gpt2", ["--device", "meta:cuda", "--bf16", "--machine", "--trace", path] + SMALL)
        lines = open(path).read().splitlines()
        if len(lines) != int(m["calls"]) or not any(
                re.match(r"matmul w\(4, 32, 96\)b?f(16|32) r\(4, 32, 32\)bf16 r\(96, 32\)bf16 .*launches=1$", x)
                for x in lines):
            fail("trace: %d lines for %s calls:\n%s" % (len(lines), m["calls"], "\n".join(lines[:20])))

    p = run("gpu_fit", ["--gpu", "h100"] + SMALL)
    if not re.search(r"batch +4: peak .* fits", p.stdout):
        fail("gpu_fit:\n" + p.stdout)
    p = run("gpu_fit", ["--gpu", "a100", "--batch", "4096"], code=1)
    if "DOES NOT FIT" not in p.stdout:
        fail("gpu_fit at batch 4096:\n" + p.stdout)
    print("ok")


if __name__ == "__main__":
    main()
