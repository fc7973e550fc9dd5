"""benchmarks/run_scaling.sh on the MLP at world sizes 1 and 2, 5 steps:
- with as many threads per rank as there are cores, 2 ranks exceed the cores
  and the script warns before it starts; with one thread and one rank it
  does not;
- the table gives the median step and the median wait, and the load average
  is printed beside it;
- medians beside medians: each step's wait for the buckets is part of that
  step, so the median wait cannot exceed the median step (a mean wait could,
  and did: 2.16 ms beside a median step of 0.78 ms);
- the plot draws the projected curve (nb_scale on the world-1 trace) and its
  title names the link: here one given by hand (--link 10,1), 100% at world
  size 1 by construction."""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import BIN, SOURCE, TIME_SCALE, fail  # noqa: E402

SCRIPT = os.path.join(SOURCE, "benchmarks", "run_scaling.sh")


def scaling(out_dir, max_world, threads, more=()):
    env = dict(os.environ, NABLA_BIN=BIN, OMP_NUM_THREADS=str(threads), NABLA_NUM_THREADS=str(threads),
               NABLA_PG_TIMEOUT="60")
    p = subprocess.run(["bash", SCRIPT, "--models", "mlp", "--max-world", str(max_world), "--steps", "5",
                        "--out", out_dir] + list(more), capture_output=True, text=True, env=env, timeout=120 * TIME_SCALE)
    if p.returncode != 0:
        fail("run_scaling.sh exited with %d:\n%s\n%s" % (p.returncode, p.stdout[-3000:], p.stderr[-3000:]))
    return p.stdout, p.stderr


def main():
    cores = int(subprocess.run(["env", "-u", "OMP_NUM_THREADS", "-u", "OMP_THREAD_LIMIT", "nproc"],
                               capture_output=True, text=True).stdout)
    with tempfile.TemporaryDirectory(prefix="nb_test_run_scaling_") as tmp:
        out, err = scaling(tmp, 2, cores)
        want = "run_scaling: warning: up to 2 ranks x %d thread(s) = %d on %d core(s)" % (cores, 2 * cores, cores)
        if want not in err:
            fail("2 ranks of %d threads on %d cores: no warning %r:\n%s" % (cores, cores, want, err))
        if not re.search(r"^model +world +throughput/s +efficiency +hidden +ms/step +wait ms$", out, re.M):
            fail("the table lacks the ms/step and wait columns:\n" + out)
        if not re.search(r"^load average \(1, 5, 15 min\): [0-9.]+ [0-9.]+ [0-9.]+ before, "
                         r"[0-9.]+ [0-9.]+ [0-9.]+ after; %d core\(s\)$" % cores, out, re.M):
            fail("no load average beside the table:\n" + out)
        rows = [dict(kv.split("=", 1) for kv in line.split()) for line in out.splitlines()
                if line.startswith("model=mlp ")]
        two = [r for r in rows if r["world"] == "2"]
        if len(rows) != 2 or len(two) != 1:
            fail("expected one --machine line per world size 1, 2:\n" + out)
        step, wait = float(two[0]["ms"]), float(two[0]["wait_ms"])
        if not 0 <= wait <= step:
            fail("2 ranks: median wait %.4f ms beside a median step of %.4f ms: not medians of the same steps"
                 % (wait, step))
        table = re.search(r"^mlp +2 +\d+ +\d+% +\d+% +([0-9.]+) +([0-9.]+)$", out, re.M)
        if not table or abs(float(table.group(1)) - step) > 0.006 or abs(float(table.group(2)) - wait) > 0.006:
            fail("the table's world-2 row does not show the median step %.2f and wait %.2f:\n%s" % (step, wait, out))
        print("2 ranks x %d threads on %d cores: warned; median wait %.3f ms <= median step %.3f ms"
              % (cores, cores, wait, step))
        scaling(tmp, 2, 1, ["--link", "10,1"])
        svg = open(os.path.join(tmp, "scaling.svg")).read()
        if "projected (nb_scale) on link 10,1<" not in svg or ">mlp projected<" not in svg:
            fail("the plot has no projected curve or does not name the link:\n" + svg)
        # the series' polylines in legend order: mlp measured, then mlp projected, whose first point
        # (world 1) lies on the 100% gridline as the measured one's does
        lines = re.findall(r'<polyline [^>]*points="([0-9.]+),([0-9.]+) ', svg)
        if len(lines) != 2 or lines[0][1] != lines[1][1]:
            fail("the projected curve does not start at the measured one's 100%%: %s" % lines)
        _, err = scaling(tmp, 1, 1)
        if "warning" in err:
            fail("one rank of one thread should not warn:\n" + err)
    print("ok")


if __name__ == "__main__":
    main()
