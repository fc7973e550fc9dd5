"""The scaling model's programs end to end: bench_gpt2 --device meta:cuda
--step-trace writes a step trace (every parameter once, ready times in
order and inside backward, a matrix's rows, the tied embedding last), and
bench_ddp --no-ddp --trace one from a measured CPU step; nb_scale reads
both and prints its projection: labelled as one, world 1 with no
communication at exactly the trace's forward + backward + optimizer, and
the step never shorter at a larger world on one link; a malformed trace is
refused naming its line.
"""
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import fail, run_bin as run  # noqa: E402

SMALL = ["--layers", "2", "--heads", "2", "--width", "32", "--seq-len", "32", "--vocab", "128",
         "--batch", "4"]


def read_trace(path):
    lines = open(path).read().splitlines()
    if lines[0] != "nabla-step-trace 1":
        fail("%s: first line %r" % (path, lines[0]))
    phases, params = {}, []
    for ln in lines[1:]:
        f = ln.split()
        if f[0] in ("forward_s", "backward_s", "optimizer_s"):
            phases[f[0]] = float(f[1])
        elif f[0] == "param":
            params.append((f[1], f[2], int(f[3]), float(f[4]), int(f[5])))
    return phases, params


def check_projection(trace, phases):
    out = run("nb_scale", [trace, "--max-world", "64", "--inter", "eth10"]).stdout
    if not out.startswith("PROJECTION (a model, not a measurement)"):
        fail("nb_scale does not label its output a projection:\n" + out)
    rows = re.findall(r"^\s*(\d+)\s+(\d+) x (\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%", out, re.M)
    if [int(r[0]) for r in rows] != [1, 2, 4, 8, 16, 32, 64]:
        fail("world sizes in the table: %s\n%s" % ([r[0] for r in rows], out))
    step1 = float(rows[0][4])
    want = 1e3 * (phases["forward_s"] + phases["backward_s"] + phases["optimizer_s"])
    if abs(step1 - want) > 1e-3 * want + 2e-3 or float(rows[0][5]) != 0 or float(rows[0][7]) != 100.0:
        fail("world 1: step %s ms, comm %s, efficiency %s%%; want %.3f ms, 0, 100%%\n%s"
             % (step1, rows[0][5], rows[0][7], want, out))
    steps = [float(r[4]) for r in rows]
    if any(b < a - 1e-9 for a, b in zip(steps, steps[1:])):
        fail("the projected step shrinks as the world grows on one link: %s" % steps)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        gpt = os.path.join(tmp, "gpt.trace")
        run("bench_gpt2", ["--device", "meta:cuda", "--gpu", "h100", "--bf16", "--step-trace", gpt] + SMALL)
        phases, params = read_trace(gpt)
        names = [p[0] for p in params]
        # 2 layers x 12 tensors, wte, wpe, ln_f weight and bias (the head is tied to wte)
        if len(names) != 28 or len(set(names)) != 28:
            fail("%d parameters (%d distinct) in the meta trace, want 28" % (len(names), len(set(names))))
        ready = [p[3] for p in params]
        if ready != sorted(ready) or ready[-1] > phases["backward_s"] * (1 + 1e-9) or ready[0] < 0:
            fail("ready times out of order or outside backward (%g s): %s" % (phases["backward_s"], ready))
        wte = [p for p in params if p[0] == "transformer.wte.weight"][0]
        if wte[2] != 128 * 32 or wte[4] != 128:
            fail("wte: numel %d rows %d, want 4096 and 128" % (wte[2], wte[4]))
        if min(phases.values()) <= 0:
            fail("a phase of the projected step is not positive: %s" % phases)
        check_projection(gpt, phases)

        cnn = os.path.join(tmp, "cnn.trace")
        run("bench_ddp", ["--no-ddp", "--model", "cnn", "--steps", "3", "--trace", cnn, "--device", "cpu"])
        phases, params = read_trace(cnn)
        if not params or [p[3] for p in params] != sorted(p[3] for p in params):
            fail("bench_ddp's trace: no parameters, or ready times out of order")
        check_projection(cnn, phases)

        bad = os.path.join(tmp, "bad.trace")
        with open(bad, "w") as f:
            f.write("nabla-step-trace 1\nforward_s 1\nbackward_s 1\noptimizer_s 1\nparam w f32 6 0.5 4\n")
        p = run("nb_scale", [bad], code=1)
        if "bad.trace:5: parameter w" not in p.stderr:
            fail("a trace whose rows do not divide numel: %r" % p.stderr)
    print("ok")


if __name__ == "__main__":
    main()
