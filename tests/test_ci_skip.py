"""A test whose dependency is missing skips (exit 77) on a developer's
machine and fails under CI=true, where `make test` has installed every
test dependency (tests/_programs.py's skip(), used by the PyTorch
comparisons and the tutorial's test)."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import fail  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = "import sys; sys.path.insert(0, %r); import _programs; _programs.skip('no frobnicator')" % HERE


def probe(ci):
    env = dict(os.environ)
    env.pop("CI", None)
    if ci is not None:
        env["CI"] = ci
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=60)
    return p.returncode, p.stdout + p.stderr


def main():
    for ci in (None, "false"):
        rc, out = probe(ci)
        if rc != 77 or "skipped: no frobnicator" not in out:
            fail("CI=%s: a missing dependency should skip (77), got %d:\n%s" % (ci, rc, out))
    rc, out = probe("true")
    if rc != 1 or "under CI=true that fails instead of skipping: no frobnicator" not in out:
        fail("CI=true: a missing dependency should fail (1), got %d:\n%s" % (rc, out))
    print("ok")


if __name__ == "__main__":
    main()
