"""--info in the training programs and the benchmarks: each prints
nb_config_string() (include/nabla/config.h) and exits 0 without training,
and all of them report the same libraries for the same kinds of product."""
import subprocess
import sys

sys.path.insert(0, __import__("os").path.dirname(__file__))
from _programs import BIN, fail  # noqa: E402

KINDS = ("f32 matmul", "f32 conv2d", "bf16 matmul", "bf16 conv2d", "f64 matmul", "f32 attention")


def info(program):
    path = "%s/%s" % (BIN, program)
    r = subprocess.run([path, "--info"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        fail("%s --info exited %d: %s" % (program, r.returncode, r.stderr[-500:]))
    lines = dict(l.split(": ", 1) for l in r.stdout.splitlines() if ": " in l)
    for key in ("nabla", "cpu", "openblas", "onednn", "pool") + KINDS:
        if key not in lines:
            fail("%s --info has no \"%s: \" line:\n%s" % (program, key, r.stdout))
    if "step" in r.stdout.lower() or "loss" in r.stdout.lower():
        fail("%s --info trained instead of exiting:\n%s" % (program, r.stdout))
    return {k: lines[k] for k in KINDS}


def main():
    first = None
    for program in ("train_gpt", "train_classifier", "bench_ddp", "bench_dnnl", "bench_ops"):
        got = info(program)
        if first and got != first[1]:
            fail("%s and %s report different libraries:\n%s\n%s" % (first[0], program, first[1], got))
        first = first or (program, got)
    print("ok")


if __name__ == "__main__":
    main()
