"""benchmarks/gpu_check.sh --phase perf on a machine without a GPU (or with
every GPU hidden by CUDA_VISIBLE_DEVICES=-1): it ends cleanly within a
minute, says so, and leaves at most 8 files under $OUT. Beside it, the
pieces the phase runs that work without a GPU: kernel_profile.py's grouping
of an ncu CSV (a small one written here, totals worked by hand), and
bench_attention on the CPU, which must report the fused path there and the
composed one with --composed."""
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import BIN, SOURCE, TIME_SCALE, fail  # noqa: E402

NCU_CSV = '''==PROF== Connected to process 1 (bench_gpt2)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","bench_gpt2","h","void layer_norm_kernel<__nv_bfloat16, 4>(float *, const float *, long)","1","7","(256, 1, 1)","(96, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","1,500"
"1","1","bench_gpt2","h","sm90_xmma_gemm_bf16bf16_bf16f32","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","7000"
"2","1","bench_gpt2","h","void layer_norm_kernel<float, 4>(float *, const float *, long)","1","7","(256, 1, 1)","(96, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","1500"
'''


def perf_without_gpu():
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OUT=out, CUDA_VISIBLE_DEVICES="-1")
        t0 = time.monotonic()
        p = subprocess.run(["bash", os.path.join(SOURCE, "benchmarks", "gpu_check.sh"), "--phase", "perf"],
                           capture_output=True, text=True, env=env, timeout=120 * TIME_SCALE)
        took = time.monotonic() - t0
        text = p.stdout + p.stderr
        if p.returncode != 0:
            fail("gpu_check.sh --phase perf without a GPU: exit %d\n%s" % (p.returncode, text))
        if took >= 60 * TIME_SCALE:
            fail("gpu_check.sh --phase perf without a GPU took %.1f s (at most 60)" % took)
        if "no GPU here" not in text:
            fail("gpu_check.sh --phase perf without a GPU does not say so:\n%s" % text)
        files = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs]
        if len(files) > 8:
            fail("gpu_check.sh --phase perf left %d files under $OUT (at most 8): %s" % (len(files), files))
        if not any("no GPU here" in open(f).read() for f in files):
            fail("the summary under $OUT does not say there was no GPU: %s" % files)
        print("perf without a GPU: exit 0 in %.1f s, %d file(s)" % (took, len(files)))


def profile_table():
    with tempfile.TemporaryDirectory() as d:
        csv_path = os.path.join(d, "ncu.csv")
        with open(csv_path, "w") as f:
            f.write(NCU_CSV)
        meta = os.path.join(d, "meta.log")
        with open(meta, "w") as f:
            f.write("model=gpt2 launches=2 bytes_moved=1\n")
        p = subprocess.run([sys.executable, os.path.join(SOURCE, "benchmarks", "kernel_profile.py"),
                            "--ncu", csv_path, "--meta", meta], capture_output=True, text=True, timeout=60)
        text = p.stdout + p.stderr
        if p.returncode != 0:
            fail("kernel_profile.py: exit %d\n%s" % (p.returncode, text))
        # two layer_norm_kernel launches of 1.5 us make one row of 3.0 us; 10 us in all
        want = ["3 kernels, 0.010 ms", "launches: measured 3, projected 2 (1.50x)"]
        rows = [l.split() for l in text.splitlines()]
        ln = [r for r in rows if r and r[0] == "layer_norm_kernel"]
        if not ln or ln[0][1:4] != ["2", "3.0", "1.50"] or ln[0][4] != "30.0%":
            fail("kernel_profile.py: layer_norm_kernel should be 2 launches, 3.0 us, 30%%:\n%s" % text)
        for w in want:
            if w not in text:
                fail("kernel_profile.py: %r missing:\n%s" % (w, text))
        print("kernel_profile.py: grouped and totalled")


def profile_beside_meta():
    """kernel_profile.py --ncu beside the meta device's output as gpu_check.sh's perf phase
    makes it (bench_gpt2 --device meta:cuda --gpu h100 --bf16 --batch 8 --steps 1
    --warmup 0, without --machine; a small GPT here): the table is recognised, shown, and its
    total row's launches set beside the measured ones."""
    exe = os.path.join(BIN, "bench_gpt2")
    if not os.access(exe, os.X_OK):
        fail("%s is not built (benchmarks/bench_gpt2.c)" % exe)
    m = subprocess.run([exe, "--device", "meta:cuda", "--gpu", "h100", "--bf16", "--batch", "8", "--steps", "1",
                        "--warmup", "0", "--layers", "2", "--heads", "2", "--width", "64", "--seq-len", "32",
                        "--vocab", "128"], capture_output=True, text=True, timeout=120 * TIME_SCALE)
    if m.returncode != 0:
        fail("bench_gpt2 --device meta:cuda: exit %d\n%s%s" % (m.returncode, m.stdout, m.stderr))
    total = [l.split() for l in m.stdout.splitlines() if l.startswith("total ")]
    if len(total) != 1:
        fail("bench_gpt2 --device meta:cuda printed no total row:\n%s" % m.stdout)
    want = "launches: measured 3, projected %s (%.2fx)" % (total[0][2], 3 / int(total[0][2]))
    with tempfile.TemporaryDirectory() as d:
        csv_path, meta = os.path.join(d, "ncu.csv"), os.path.join(d, "meta.log")
        with open(csv_path, "w") as f:
            f.write(NCU_CSV)
        with open(meta, "w") as f:
            f.write(m.stdout)
        p = subprocess.run([sys.executable, os.path.join(SOURCE, "benchmarks", "kernel_profile.py"),
                            "--ncu", csv_path, "--meta", meta], capture_output=True, text=True, timeout=60)
        text = p.stdout + p.stderr
        if p.returncode != 0 or "projected (bench_gpt2 --device meta:cuda" not in text or want not in text:
            fail("kernel_profile.py beside bench_gpt2 --device meta:cuda's table: exit %d, expected the "
                 "table and %r:\n%s" % (p.returncode, want, text))
    print("kernel_profile.py: the meta device's table as the perf phase makes it")


META_TABLE = """entry (one steady step)            calls launches   GB moved      GFLOP  GEMM GFLOP    proj. us  share
matmul                               147      147     11.845      3.095     6073.62     13192.9  58.4%
adam                                   1        1      3.485      1.494        0.00      1300.5   5.8%
binary.add                           149      149      2.340      0.348        0.00      1068.6   4.7%
embedding                              2        2      0.057      0.000        0.00        21.2   0.1%
total                                299      299     17.727      4.937     6073.62     15583.2 100.0%
"""

EVENTS = """# nabla CUDA events profile (NABLA_CUDA_PROFILE=events), devices 0x1: per backend entry, ...
# entry calls us
matmul 147 14000.0
adam\t1\t2000.0
binary.add 149 1000.0
memset 1 180.0
# total 298 17180.000
"""


def events_table():
    """--events (the fallback without ncu) joined with the meta table by entry; the
    ratios worked by hand: 14000 / 13192.9 = 1.06, 2000 / 1300.5 = 1.54 (more than
    30% off), 1000 / 1068.6 = 0.94; the step 17.180 ms against 15.583 ms."""
    with tempfile.TemporaryDirectory() as d:
        ev, meta = os.path.join(d, "events.txt"), os.path.join(d, "meta.log")
        with open(ev, "w") as f:
            f.write(EVENTS)
        with open(meta, "w") as f:
            f.write("bench_gpt2: ...\n" + META_TABLE + "peak 5.29 GiB\n")
        p = subprocess.run([sys.executable, os.path.join(SOURCE, "benchmarks", "kernel_profile.py"),
                            "--events", ev, "--meta", meta], capture_output=True, text=True, timeout=60)
        text = p.stdout + p.stderr
        if p.returncode != 0:
            fail("kernel_profile.py --events: exit %d\n%s" % (p.returncode, text))
        rows = {l.split()[0]: l.split() for l in text.splitlines() if l.split()}
        want = {"matmul": ["147", "147", "14000.0", "13192.9", "1.06x"],
                "adam": ["1", "1", "2000.0", "1300.5", "1.54x", "!"],
                "binary.add": ["149", "149", "1000.0", "1068.6", "0.94x"]}
        for name, cols in want.items():
            if rows.get(name, [])[1:] != cols:
                fail("kernel_profile.py --events: row %s should be %s:\n%s" % (name, cols, text))
        for w in ["memset", "(measured only)", "(projected only)",
                  "step: measured 17.180 ms, projected 15.583 ms (1.10x); 1 of 3 entries off by more than 30%"]:
            if w not in text:
                fail("kernel_profile.py --events: %r missing:\n%s" % (w, text))
        with open(ev, "w") as f:
            f.write("matmul 147\n")
        p = subprocess.run([sys.executable, os.path.join(SOURCE, "benchmarks", "kernel_profile.py"),
                            "--events", ev, "--meta", meta], capture_output=True, text=True, timeout=60)
        if p.returncode == 0 or "not `entry calls us`" not in p.stdout:
            fail("kernel_profile.py --events: a malformed line must fail, naming it:\n%s" % p.stdout)
        print("kernel_profile.py --events: joined with the meta table")


def attention_on_cpu():
    exe = os.path.join(BIN, "bench_attention")
    if not os.access(exe, os.X_OK):
        fail("%s is not built (benchmarks/bench_attention.c)" % exe)
    for extra, path in (([], "fused"), (["--composed"], "composed")):
        p = subprocess.run([exe, "--cpu", "--calls", "1", "--machine"] + extra, capture_output=True,
                           text=True, timeout=120 * TIME_SCALE)
        if p.returncode != 0 or " path=%s " % path not in p.stdout:
            fail("bench_attention --cpu %s: exit %d, expected path=%s:\n%s%s" % (
                " ".join(extra), p.returncode, path, p.stdout, p.stderr))
    print("bench_attention --cpu: fused, and composed when asked")


if __name__ == "__main__":
    perf_without_gpu()
    profile_table()
    profile_beside_meta()
    events_table()
    attention_on_cpu()
    print("ok")
