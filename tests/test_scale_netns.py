"""The scaling model against a shaped link: benchmarks/run_netns.sh runs
the CNN's DDP on two nodes (two network namespaces joined by a veth pair
that tc's tbf limits to 10 Mbit/s, where the gradients' all-reduce is most
of the step) and prints beside the measured step nb_scale's projection
from that run's own step trace. The projection must be within a factor of
2 of the measured step, a bound that a wrong unit or formula (bits for
bytes, a missing factor of the ring) breaks and the noise of a loaded
machine does not; the 15% figures are a benchmark (RESULTS.md), not this
test. The veth must carry at least the gradients' bytes each step.

Needs root and the ip and tc tools: where a network namespace cannot be
made the test ends as skipped (77) with the reason, under CI=true too
(a property of the machine, as tests/_netns.py says).
"""
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import BIN, SOURCE, TIME_SCALE, fail  # noqa: E402


def skip(reason):
    print("skipped: " + reason)
    sys.exit(77)


def main():
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            skip("no %s tool (iproute2)" % tool)
    if os.geteuid() != 0:
        skip("not root: network namespaces and tc need CAP_SYS_ADMIN and CAP_NET_ADMIN")
    probe = "nbsp%d" % os.getpid()
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if p.returncode != 0:
        skip("ip netns add: " + p.stderr.strip())
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)

    script = os.path.join(SOURCE, "benchmarks", "run_netns.sh")
    env = dict(os.environ, NABLA_BIN=BIN)
    p = subprocess.run([script, "--rates", "10mbit", "--port", str(29700 + os.getpid() % 200), "--",
                        "--model", "cnn", "--steps", "8"],
                       capture_output=True, text=True, env=env, timeout=240 * TIME_SCALE)
    if p.returncode != 0:
        fail("run_netns.sh exited %d\n%s%s" % (p.returncode, p.stdout, p.stderr))
    grad = re.search(r"(\d+) bytes of gradients per step", p.stdout)
    row = re.search(r"^10mbit\s+([\d.]+)\s+.*?\s(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", p.stdout, re.M)
    if not grad or not row:
        fail("cannot read run_netns.sh's table:\n" + p.stdout)
    measured, sent, proj, ratio = float(row.group(1)), int(row.group(2)), float(row.group(4)), float(row.group(5))
    if sent < int(grad.group(1)):
        fail("the veth carried %d bytes per step, less than the %s bytes of gradients" % (sent, grad.group(1)))
    if not 0.5 <= proj / measured <= 2.0 or abs(ratio - proj / measured) > 0.01:
        fail("projected %.1f ms against %.1f ms measured (ratio printed %.2f): off by more than 2x\n%s"
             % (proj, measured, ratio, p.stdout))
    print("measured %.1f ms, projected %.1f ms (%.2f)" % (measured, proj, ratio))


if __name__ == "__main__":
    main()
