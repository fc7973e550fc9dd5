"""Helpers for the tests that run the training programs (not a test: ctest
skips files whose name starts with an underscore)."""
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time

BUILD = os.environ.get("NABLA_BINARY_DIR", "build")
BIN = os.path.abspath(os.environ.get("NABLA_BIN_DIR") or os.path.join(BUILD, "bin"))
SOURCE = os.environ.get("NABLA_SOURCE_DIR",
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Time limits stretch by this factor in a sanitized build (NABLA_TEST_TIME_SCALE,
# set by cmake/NablaTests.cmake): they bound hangs, not the sanitizers' cost.
TIME_SCALE = float(os.environ.get("NABLA_TEST_TIME_SCALE", "1"))


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)



def driver(name):
    """The path of a test driver (tests/programs/NAME.c, built into BIN);
    fails, naming it, when the build lacks it."""
    path = os.path.join(BIN, name)
    if not os.access(path, os.X_OK):
        fail("%s is not built (tests/programs/%s.c)" % (path, name))
    return path


class Node:
    """A running process (p, a Popen with text pipes) whose stdout and
    stderr lines are collected as they come, by two threads, so that a test
    can wait for a line while it runs (nbrun on one node)."""

    def __init__(self, p):
        self.p = p
        self.out = []
        self.ended = None  # for the caller: when it was seen to end
        self.threads = [threading.Thread(target=self._read, args=(f,), daemon=True) for f in (p.stdout, p.stderr)]
        for t in self.threads:
            t.start()

    def _read(self, f):
        for line in f:
            self.out.append(line)

    def text(self):
        return "".join(self.out)

    def wait_for(self, pattern, timeout, what, others=()):
        """Fails (with this output and the others') unless pattern shows
        within timeout seconds, before the process ends."""
        timeout *= TIME_SCALE
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text(), re.M):
            if self.p.poll() is not None or time.monotonic() > deadline:
                fail("%s: no %r within %d s (exit %s):\n%s%s" % (what, pattern, timeout, self.p.poll(),
                                                                  self.text()[-4000:],
                                                                  "".join("\n--- other\n" + o.text()[-3000:]
                                                                          for o in others)))
            time.sleep(0.05)

def run_bin(name, args, code=0):
    """Runs BIN/name with args (no launcher) and returns the finished
    process; fails, with its output, when it is not built or does not exit
    with `code`."""
    path = os.path.join(BIN, name)
    if not os.access(path, os.X_OK):
        fail("%s is not built" % path)
    p = subprocess.run([path] + args, capture_output=True, text=True, timeout=120 * TIME_SCALE)
    if p.returncode != code:
        fail("%s %s exited %d, not %d\n%s%s" % (name, " ".join(args), p.returncode, code, p.stdout,
                                                 p.stderr))
    return p


def skip(reason):
    """Ends the test as skipped (exit 77, CTest's SKIP_RETURN_CODE) because
    something it needs is missing; under CI=true (as CI runs it, after
    `make test` installed every test dependency) that is a failure."""
    if os.environ.get("CI") == "true":
        fail("a dependency is missing, and under CI=true that fails instead of skipping: " + reason)
    print("skipped: " + reason)
    sys.exit(77)


def import_torch():
    """Returns the torch module. Debian's python3-torch lives under the
    system interpreter, which may not be the python3 first on PATH: re-runs
    the test under /usr/bin/python3 once before skip() (make test-deps
    installs it)."""
    try:
        import torch
        return torch
    except ImportError:
        system = "/usr/bin/python3"
        if os.path.exists(system) and os.path.realpath(sys.executable) != os.path.realpath(system) \
                and not os.environ.get("NABLA_TORCH_REEXEC"):
            os.environ["NABLA_TORCH_REEXEC"] = "1"
            os.execv(system, [system] + sys.argv)
        skip("torch does not import (install python3-torch: make test-deps)")


def compare_with_torch(torch, got, want, dtype, rtol, atol, what):
    """nabla's values want (a flat list) as a torch tensor of got's shape and
    of dtype, returned; fails, naming `what`, the largest difference and the
    first values, unless torch.allclose(got, it, rtol, atol)."""
    w = torch.tensor(want, dtype=dtype).reshape(got.shape)
    if not torch.allclose(got, w, rtol=rtol, atol=atol):
        worst = (got - w).abs().max().item()
        fail("%s: differs from torch by up to %g (torch %s, nabla %s)"
             % (what, worst, got.flatten().tolist()[:6], w.flatten().tolist()[:6]))
    return w


def run(args, nproc=1, expect_rc=0, timeout=240, env=None, cwd=None):
    """Runs build/bin/args[0] with the rest of args, under nbrun with nproc
    processes when nproc > 1, in cwd (None: this one). Returns (stdout,
    stderr); fails the test when the exit status is not expect_rc."""
    cmd = [os.path.join(BIN, args[0])] + list(args[1:])
    if nproc > 1:
        cmd = [os.path.join(BIN, "nbrun"), "--nproc-per-node", str(nproc), "--master-port", "0"] + cmd
    e = dict(os.environ)
    e.setdefault("NABLA_PG_TIMEOUT", "60")
    e.setdefault("OPENBLAS_NUM_THREADS", "1")
    if env:
        e.update(env)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * TIME_SCALE, env=e,
                       cwd=cwd)
    if p.returncode != expect_rc:
        fail("%s exited with %d, expected %d\n--- stdout\n%s\n--- stderr\n%s"
             % (" ".join(cmd), p.returncode, expect_rc, p.stdout[-3000:], p.stderr[-3000:]))
    return p.stdout, p.stderr


def small_text(tmp):
    """Writes tmp/t.txt, the first 2000 bytes of the shipped austen.txt (a
    corpus a few train_gpt steps go through), and returns its path."""
    path = os.path.join(tmp, "t.txt")
    with open(os.path.join(SOURCE, "examples", "datasets", "austen.txt"), "rb") as f, open(path, "wb") as out:
        out.write(f.read()[:2000])
    return path


def run_in_scratch(name, *tests):
    """A test's main: calls each of tests with one scratch folder
    (/tmp/nb_test_<name>_*, removed afterwards), in turn, then prints ok."""
    with tempfile.TemporaryDirectory(prefix="nb_test_%s_" % name) as tmp:
        for test in tests:
            test(tmp)
    print("ok")


def read_safetensors(path):
    """(header without metadata, metadata, data section bytes)"""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    return header, meta, raw[8 + n:]


def same_training_state(a, b):
    """Checkpoints a and b hold the same tensors bit for bit and the same
    metadata except the wall-clock time. Returns a reason or None."""
    ha, ma, da = read_safetensors(a)
    hb, mb, db = read_safetensors(b)
    if ha != hb:
        return "the tensor lists differ"
    for name, e in ha.items():
        begin, end = e["data_offsets"]
        if da[begin:end] != db[begin:end]:
            return "tensor %s differs" % name
    ma.pop("elapsed_s", None)
    mb.pop("elapsed_s", None)
    if ma != mb:
        return "metadata differ: %r vs %r" % (ma, mb)
    return None


def assert_same_training_state(a, b, what):
    """Fails with `what` and the reason unless checkpoints a and b hold the
    same training state (same_training_state)."""
    why = same_training_state(a, b)
    if why:
        fail("%s: %s" % (what, why))


def sample_records(path, ranks):
    """{rank: [(step, epoch, [indices])]} from a program's --log-samples files."""
    out = {}
    for r in range(ranks):
        rows = []
        for line in open("%s.%d" % (path, r)):
            head, idx = line.split(":")
            _, step, _, epoch = head.split()
            rows.append((int(step), int(epoch), [int(i) for i in idx.split()]))
        out[r] = rows
    return out


def read_metrics(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def logged_losses(path):
    """(step, value) of every loss and val_loss record in a metrics log."""
    return [(r["step"], r[k]) for r in read_metrics(path) for k in ("loss", "val_loss") if k in r]


def check_svg(path, min_polylines=1):
    import xml.etree.ElementTree as ET
    root = ET.parse(path).getroot()
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    if len(lines) < min_polylines:
        fail("%s has %d polylines, expected at least %d" % (path, len(lines), min_polylines))


def state_bytes(out):
    """The state_bytes= figure of a training program's last lines."""
    m = re.search(r"state_bytes=(\d+)", out)
    if not m:
        fail("no state_bytes= on the memory line:\n" + out)
    return int(m.group(1))


def optimizer_state(out):
    """(bytes, sharded) from a training program's "optimizer state per process:" line:
    the bytes one process holds, and whether the line names ZeRO-1."""
    for line in out.splitlines():
        if "optimizer state per process: " in line:
            return int(line.split("optimizer state per process: ")[1].split()[0]), "(ZeRO-1)" in line
    fail("no optimizer-state line in:\n" + out)


def same_losses(a, b, label, min_records, where=""):
    """The (step, loss) records of the metrics logs a (a plain run) and b (the run label names, as
    "--zero 2"), after checking they hold the same steps, at least min_records of them, and losses
    within 1e-5 relative; where (as "3 processes") starts each message."""
    la, lb = logged_losses(a), logged_losses(b)
    if len(la) < min_records or [s for s, _ in la] != [s for s, _ in lb]:
        fail("%sthe metrics logs differ in their records: %s vs %s" % (where + ": " if where else "", la, lb))
    for (s, x), (_, y) in zip(la, lb):
        if abs(x - y) > 1e-5 * abs(x):
            fail("%sstep %d: loss %.8g (plain) vs %.8g (%s)" % (where + ", " if where else "", s, x, y, label))
    return la, lb
