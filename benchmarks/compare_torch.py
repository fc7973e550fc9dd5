#!/usr/bin/env python3
"""Side-by-side training-step time of nabla and PyTorch eager on the CPU.

For the bundled MLP classifier, the CNN and the character-level GPT (the
shapes of models/*.c as bench_ddp --model builds them; "gpt6", a larger GPT
of 6 layers, width 256, 128 tokens, batch 8, on request with --models), times N training
steps (forward, loss, backward, AdamW step, zero_grad) of our C program
(build/bin/bench_ddp --no-ddp --device cpu --model M --machine) and of the PyTorch
equivalent, and prints medians with their spread and our time over theirs
(below 1: we are faster), with the same in words beside it ("nabla 1.32x
faster", "nabla 1.30x slower").

Thread settings (--threads, default "default,1"): every row is measured at
each setting, in its own table: "default" sets no thread variable on either
side (what a user gets: nabla's choice, PyTorch's), a count N sets the four
thread variables to N on both sides and torch.set_num_threads(N). The
PyTorch GPT computes attention with F.scaled_dot_product_attention (causal),
as PyTorch 2 users write it (PyTorch 1.x, without it, the explicit masked
softmax). --quick is a first look in under 3 minutes: 5 steps, 2 rounds, no
bf16 and no torch.compile rows.

bf16 rows (--bf16-models, default cnn,gpt; "" for none): ours with --bf16
(the step context's compute dtype: bf16 products, f32 accumulation and
master weights) beside PyTorch eager f32 and PyTorch eager under
torch.autocast("cpu", dtype=torch.bfloat16), run as interleaved triples.

DDP rows (--ddp N, default off; Note [DDP rows]): for each of --models,
bench_ddp under nbrun on N CPU ranks over Gloo (--device cpu --machine)
against N fresh PyTorch processes (this script with --torch-ddp-worker), each
in torch.distributed's "gloo" group around the same model in
DistributedDataParallel with its default buckets (--ddp-bucket-mb MB caps
both sides' buckets alike; --nabla-bucket-step makes nabla step the
optimizer per bucket, which torch's DDP has no option for); each rank trains its own
batch of the single-process size (weak scaling, as bench_ddp), every rank of
both sides with the four thread variables at 1 (nbrun's default per rank) and
torch.set_num_threads(1). A row gives rank 0's step times, nabla's "hidden"
(the share of its all-reduce time that ran before backward ended, from
bench_ddp's line), the ratio of the medians and the per-pair ratios. A rank
that fails, or any run over --timeout seconds, stops the script with exit 1.

Fairness (Note [A fair comparison]): each side runs in a fresh process of its
own, started with the same thread variables (OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS, MKL_NUM_THREADS, NABLA_NUM_THREADS) so that OpenMP and
OpenBLAS size their pools before they start; the PyTorch process also calls
torch.set_num_threads / set_num_interop_threads first. This process never
imports torch. The runs alternate nabla, torch, nabla, torch ... and the
thread settings actually in force on each side are read back and printed;
when one did not take, the script says so and exits 1.

Against several PyTorch installations and modes (Note [Which PyTorch]):
--torch-python PY[,PY...] runs the PyTorch side under each interpreter (the
current release in a virtual environment, Debian's 1.13 in /usr/bin/python3),
and --compile adds torch.compile rows (PyTorch 2.x) beside eager ones; every
PyTorch variant is one more run in each interleaved round.

    make bench-torch                  (a virtual environment with PyPI's torch, made on first use)
    /usr/bin/python3 benchmarks/compare_torch.py [--steps 20] [--repeats 5] [--threads default,1] [--quick]
    python3 benchmarks/compare_torch.py --torch-python build/venv-torch/bin/python,/usr/bin/python3 --compile
    /usr/bin/python3 benchmarks/compare_torch.py --models gpt --bf16-models "" --ddp 2
    /usr/bin/python3 benchmarks/compare_torch.py --models gpt --bf16-models "" --ddp 2 \
        --ddp-bucket-mb 0.25 --nabla-bucket-step

nabla's side alone (Note [nabla's environment]): --nabla-env VAR=VALUE (repeatable)
sets a variable for every nabla run and for the --info report printed first,
e.g. OPENBLAS_CORETYPE=Prescott to measure what a CPU that OpenBLAS does not
know gets (issue 35's targets); --batch MODEL=N[,...] sets the batch of the
single-process rows on both sides (bench_ddp --batch; e.g. cnn=64,mlp=64).

    /usr/bin/python3 benchmarks/compare_torch.py --models gpt6,cnn,mlp --batch cnn=64,mlp=64 \
        --nabla-env OPENBLAS_CORETYPE=Prescott --torch-python PY

The PyTorch side runs under the first of this interpreter and /usr/bin/python3
(Debian's python3-torch) that has torch; with none, the script exits 0 with a
message.
"""
# Note [A fair comparison]
# Before, PyTorch ran inside this script's process: torch.set_num_threads(1)
# fixes only ATen's OpenMP pool, while the OpenBLAS that torch calls for its
# GEMMs had already started with as many threads as cores (the variable was
# set only in nabla's environment), so "--threads 1" measured 1 nabla thread
# against 2 PyTorch BLAS threads, and at "--threads 2" PyTorch's 2 OpenMP and
# 2 OpenBLAS threads competed for 2 cores. Thread variables are read once, when
# a library starts, so the only reliable way to set them is in the environment
# of a process that has not loaded the library yet: hence a subprocess per run
# for both sides, and a read-back (torch.get_num_threads, OpenBLAS's
# openblas_get_num_threads, the kernel's thread count of the process) so that a
# setting that did not take is seen in the output rather than assumed.
# Each run gives the median of its timed steps; a row reports the median over
# runs with the min-max range, and the median and range of the per-pair ratios
# (nabla run i over torch run i, adjacent in time, so slow drift of a shared
# machine cancels more in a pair than across the whole row).
# Note [DDP rows]
# The PyTorch ranks are fresh processes started with their environment (thread
# variables) already set, for the reason in the note above: torch.multiprocessing's
# fork of a process that has imported torch would inherit thread pools sized
# before the variables were read. They are started by nbrun, as nabla's are
# (nbrun exports torchrun's RANK and WORLD_SIZE; PyTorch's store takes a port
# of its own), so one rule binds both sides' ranks to CPUs (--ddp-cpu-bind,
# default nbrun's auto, Note [CPU binding] in distributed/cpu_bind.c), where
# torchrun binds nothing. One thread per rank on both sides is nbrun's default
# when ranks share a node (as torchrun's); the ranks' kernel thread counts,
# Gloo's own threads included,
# are read back as for the other rows. Both sides time from forward to
# zero_grad on rank 0. "hidden" exists for nabla only: bench_ddp takes the
# median of nb_ddp_last_stats' hidden_fraction over its timed steps (per step: the part
# of each bucket's all-reduce, from its start to its finish, that lies before
# the end of backward, over the buckets' summed all-reduce time), and "all
# ranks" / "peer wait" are its hidden_all / peer_wait_ms, the same over every
# rank's steps without the time a bucket waited for a later rank
# (nb_ddp_overlap_across_ranks); PyTorch's reducer does not report the
# equivalent without its profiler.
# Note [Which PyTorch]
# Debian's python3-torch is 1.13; users run 2.x. A virtual environment with
# PyPI's current torch (make bench-torch makes build/venv-torch on first use)
# gives the 2.x figures; PyPI serves only its CUDA build of torch for Linux
# (the CPU-only wheels live on PyTorch's own index), which runs on the CPU
# like any other and is what a user who types "pip install torch" gets. Each
# variant (interpreter x eager/compile) runs in its own fresh process per
# run, in the same interleaved rounds as nabla, so that load falls on all of
# them alike. torch.compile's first steps compile (the 3 warm-up steps absorb
# that; Inductor's cache makes later runs start faster), and its compile
# workers are limited to one thread (TORCHINDUCTOR_COMPILE_THREADS=1) so that
# they do not compete with the timed steps.
# Note [nabla's environment]
# --nabla-env exists to force on nabla's side what a user's machine would
# give it: OpenBLAS reads OPENBLAS_CORETYPE when it loads, so a CPU that it
# does not know can only be imitated in the environment of a fresh process,
# and only nabla's (PyTorch from PyPI brings its own libraries; Debian's torch
# would get the generic core too, which is not the comparison asked for). The
# variables go into every nabla process this script starts (single-process
# and DDP rows, and the --info report printed at the top, which shows the
# core OpenBLAS then runs), never into PyTorch's; a thread variable is
# refused there, since --threads sets those on both sides.
import argparse
import ctypes
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

SYSTEM_PYTHON = "/usr/bin/python3"
HERE = os.path.dirname(os.path.abspath(__file__))
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NABLA_NUM_THREADS")

# Must match bench_ddp.c (and through it models/*.c and the training programs).
# GPT shapes: (sequence, layers, heads, width); "gpt6" is bench_ddp's larger GPT.
GPT_VOCAB = 79
GPT_SHAPES = {"gpt": (64, 4, 4, 128), "gpt6": (128, 6, 4, 256)}
BATCH = {"mlp": 8, "cnn": 32, "gpt": 16, "gpt6": 8}


def torch_models():
    """The models in PyTorch. Imports torch: called only in the PyTorch process."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def mlp():
        return nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))

    class CNN(nn.Module):
        """conv3x3 (no bias) - BatchNorm2d - ReLU blocks 16, 32, 64; 2x2 max pool
        after each block but the last; global average pool; Linear head."""

        def __init__(self, channels=(16, 32, 64), classes=10):
            super().__init__()
            blocks, c_in = [], 1
            for c in channels:
                blocks.append(nn.Sequential(nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()))
                c_in = c
            self.blocks = nn.ModuleList(blocks)
            self.head = nn.Linear(c_in, classes)

        def forward(self, x):
            for i, b in enumerate(self.blocks):
                x = b(x)
                if i + 1 < len(self.blocks) and x.shape[-1] >= 2 and x.shape[-2] >= 2:
                    x = F.max_pool2d(x, 2, 2)
            return self.head(x.mean(dim=(2, 3)))

    class Block(nn.Module):
        def __init__(self, c, n_head):
            super().__init__()
            self.n_head = n_head
            self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
            self.c_attn, self.attn_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
            self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

        def attn(self, x):
            n, t, c = x.shape
            q, k, v = self.c_attn(x).split(c, dim=2)
            q, k, v = (z.view(n, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
            if hasattr(F, "scaled_dot_product_attention"):  # PyTorch 2: as its users write attention
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.attn_proj(y.transpose(1, 2).reshape(n, t, c))
            att = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.n_head) ** 0.5)
            mask = torch.ones(t, t, dtype=torch.bool).tril()
            att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            return self.attn_proj((att @ v).transpose(1, 2).reshape(n, t, c))

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, shape):
            super().__init__()
            t, layers, heads, width = shape
            self.wte, self.wpe = nn.Embedding(GPT_VOCAB, width), nn.Embedding(t, width)
            self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.h:
                x = b(x)
            return self.ln_f(x) @ self.wte.weight.t()  # tied head

    return torch, F, {"mlp": mlp, "cnn": CNN, "gpt": lambda: GPT(GPT_SHAPES["gpt"]),
                      "gpt6": lambda: GPT(GPT_SHAPES["gpt6"])}


def proc_threads(pid="self"):
    """The kernel's count of threads in process `pid` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"^Threads:\s+(\d+)", f.read(), re.M).group(1))
    except (OSError, AttributeError):
        return None


def openblas_lib():
    """The OpenBLAS this process loaded (ctypes), or None."""
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "openblas" in line and ".so" in line})
    for lib in libs:
        try:
            dll = ctypes.CDLL(lib)
            dll.openblas_get_num_threads
            return dll
        except (OSError, AttributeError):
            continue
    return None


def openblas_threads():
    """openblas_get_num_threads() of the OpenBLAS this process loaded, or None."""
    lib = openblas_lib()
    return lib.openblas_get_num_threads() if lib else None


def openblas_core():
    """openblas_get_corename() of the OpenBLAS this process loaded ("Prescott", "Zen"), or None."""
    lib = openblas_lib()
    if not lib or not hasattr(lib, "openblas_get_corename"):
        return None
    lib.openblas_get_corename.restype = ctypes.c_char_p
    return lib.openblas_get_corename().decode()


def torch_batch(torch, model_name):
    """One batch of random inputs and labels, of bench_ddp's per-rank batch size."""
    b = BATCH[model_name]
    if model_name == "mlp":
        return torch.randn(b, 30), torch.arange(b) % 2
    if model_name == "cnn":
        return torch.randn(b, 1, 8, 8), torch.arange(b) % 10
    t = GPT_SHAPES[model_name][0]
    return torch.randint(0, GPT_VOCAB, (b, t)), torch.randint(0, GPT_VOCAB, (b, t))


def torch_train(torch, F, model, x, y, steps, autocast=False):
    """3 warm-up and `steps` timed training steps with AdamW: (step times in s, most threads)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    times, most = [], 0
    for s in range(steps + 3):  # 3 warm-up steps, as bench_ddp
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s >= 3:
            times.append(time.perf_counter() - t0)
            most = max(most, proc_threads())
    return times, most


def torch_worker(model_name, steps, intra_op, autocast=False, compile=False):
    """Runs in its own process (started by run_torch): one timed run, one JSON line."""
    torch, F, models = torch_models()
    if intra_op:  # 0: PyTorch's own defaults, as a user gets them
        torch.set_num_threads(intra_op)
        torch.set_num_interop_threads(1)
    torch.manual_seed(1)
    model = models[model_name]()
    if compile:
        if not hasattr(torch, "compile"):
            raise SystemExit(f"compare_torch: torch {torch.__version__} has no torch.compile (2.0 and later)")
        model = torch.compile(model)
    x, y = torch_batch(torch, model_name)
    times, most = torch_train(torch, F, model, x, y, steps, autocast)
    print(json.dumps({"ms": 1e3 * statistics.median(times), "params": sum(p.numel() for p in model.parameters()),
                      "python": sys.executable,
                      "version": torch.__version__, "intra_op": torch.get_num_threads(),
                      "inter_op": torch.get_num_interop_threads(), "blas": openblas_threads(),
                      "blas_core": openblas_core(), "threads": most}))
    return 0


def torch_ddp_worker(rank, world, port, model_name, steps, timeout):
    """One rank of PyTorch DDP over Gloo, in its own process (started by nbrun for run_torch_ddp,
    with the thread variables in its environment; PyTorch's store on `port`, not nbrun's); rank 0
    prints one JSON line. The model starts from the same seed on every rank (DDP broadcasts rank 0's
    anyway); each rank draws its own batch, as bench_ddp's ranks do."""
    import datetime
    torch, F, models = torch_models()
    import torch.distributed as dist
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
    torch.manual_seed(1)
    model = models[model_name]()
    torch.manual_seed(100 + rank)
    x, y = torch_batch(torch, model_name)
    cap = os.environ.get("COMPARE_TORCH_BUCKET_MB")  # --ddp-bucket-mb; else the default 25 MiB
    ddp = (torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=float(cap)) if cap
           else torch.nn.parallel.DistributedDataParallel(model))  # the first bucket is 1 MiB either way
    times, most = torch_train(torch, F, ddp, x, y, steps)
    if rank == 0:
        print(json.dumps({"ms": 1e3 * statistics.median(times),
                          "params": sum(p.numel() for p in model.parameters()), "version": torch.__version__,
                          "intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads(),
                          "blas": openblas_threads(), "threads": most, "backend": dist.get_backend(),
                          "world": dist.get_world_size()}), flush=True)
    dist.destroy_process_group()
    return 0


def child_pids(pid):
    """The processes whose parent is `pid` (a scan of /proc)."""
    kids = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return kids


class ThreadWatch:
    """Samples a child's kernel thread count while it runs; keeps the largest. With `children`
    (a launcher such as nbrun with that many ranks), the largest count of any one of its child
    processes instead: /proc is scanned until they have all started, then only they are read."""

    def __init__(self, proc, children=0):
        self.proc, self.children, self.most = proc, children, 0
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        kids = []
        while self.proc.poll() is None:
            if len(kids) < self.children:
                kids = child_pids(self.proc.pid)
            for n in [proc_threads(k) for k in kids] if self.children else [proc_threads(self.proc.pid)]:
                if n:
                    self.most = max(self.most, n)
            time.sleep(0.01)

    def stop(self):
        self.t.join()
        return self.most


def stop(p, grace=5):
    """SIGTERM, then SIGKILL after `grace` seconds (nbrun passes SIGTERM on to its ranks)."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_child(cmd, env, timeout=600, children=0):
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = ThreadWatch(p, children)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(p)
        out, err = p.communicate()
        sys.stderr.write(err)
        raise SystemExit(f"compare_torch: {' '.join(cmd)} did not finish in {timeout} s; stopped")
    most = watch.stop()
    if p.returncode != 0:
        sys.stderr.write(err)
        raise SystemExit(f"compare_torch: {' '.join(cmd)} exited with status {p.returncode}")
    return out, most


def run_nabla(binary, model_name, steps, env, bf16=False, timeout=600):
    cmd = [binary, "--no-ddp", "--device", "cpu", "--model", model_name, "--machine", "--steps", str(steps),
           "--batch", str(BATCH[model_name])] + (["--bf16"] if bf16 else [])
    out, most = run_child(cmd, env, timeout)
    f = dict(re.findall(r"(\w+)=(\S+)", out))
    if int(f["batch"]) != BATCH[model_name]:
        raise SystemExit(f"compare_torch: {' '.join(cmd)} ran batch {f['batch']}, not {BATCH[model_name]}")
    return {"ms": float(f["ms"]), "fwd": float(f["fwd"]), "bwd": float(f["bwd"]), "opt": float(f["opt"]),
            "params": int(f["params"]), "threads": most}


def run_nabla_ddp(nbrun, binary, model_name, steps, world, env, timeout, extra=(), cpu_bind="auto"):
    """bench_ddp under nbrun on `world` CPU ranks (with `extra` arguments, nbrun's --cpu-bind
    cpu_bind); rank 0's --machine line. "threads": the most kernel threads of any one rank."""
    cmd = [nbrun, "--nproc-per-node", str(world), "--master-port", "0", "--cpu-bind", cpu_bind, binary,
           "--model", model_name, "--device", "cpu", "--machine", "--steps", str(steps), *extra]
    out, most = run_child(cmd, env, timeout, children=world)
    line = [x for x in out.splitlines() if x.startswith("[rank 0] ") and "model=" in x]
    if not line:
        raise SystemExit(f"compare_torch: {' '.join(cmd)} printed no '[rank 0] model=...' line:\n{out}")
    f = dict(re.findall(r"(\w+)=(\S+)", line[-1]))
    if int(f["world"]) != world:
        raise SystemExit(f"compare_torch: bench_ddp ran on world={f['world']}, not {world}")
    return {"ms": float(f["ms"]), "hidden": float(f["hidden"]), "hidden_all": float(f.get("hidden_all", "nan")),
            "peer_wait_ms": float(f.get("peer_wait_ms", "nan")), "params": int(f["params"]),
            "batch": int(f["batch"]), "threads": most}


def free_port():
    """A TCP port free on 127.0.0.1 now (rank 0's store binds it a moment later)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch_ddp(nbrun, python, model_name, steps, world, env, timeout, cpu_bind="auto"):
    """`world` PyTorch processes started by nbrun as it starts nabla's ranks (the same
    --cpu-bind, so both sides' ranks get the same CPUs by one rule, Note [CPU binding] in
    distributed/cpu_bind.c); rank 0's JSON line. nbrun stops every rank when one fails."""
    cmd = [nbrun, "--nproc-per-node", str(world), "--master-port", "0", "--cpu-bind", cpu_bind, python,
           os.path.abspath(__file__), "--torch-ddp-worker", "-", "-", str(free_port()), model_name,
           "--steps", str(steps), "--timeout", str(timeout)]
    out, most = run_child(cmd, env, timeout, children=world)
    rows = [x[len("[rank 0] "):] for x in out.splitlines() if x.startswith("[rank 0] {")]
    if not rows:
        raise SystemExit(f"compare_torch: PyTorch DDP rank 0 ({model_name}) printed no JSON line:\n{out}")
    r = json.loads(rows[-1])
    r["threads_seen"] = most
    return r


def run_torch(python, model_name, steps, intra_op, env, autocast=False, timeout=600, compile=False):
    out, most = run_child([python, os.path.abspath(__file__), "--torch-worker", model_name, "--steps", str(steps),
                           "--batch", f"{model_name}={BATCH[model_name]}", "--torch-intra-op-worker", str(intra_op)] + (["--torch-autocast"] if autocast else [])
                          + (["--torch-compile"] if compile else []),
                          dict(env, TORCHINDUCTOR_COMPILE_THREADS="1") if compile else env, timeout)
    r = json.loads(out.strip().splitlines()[-1])
    r["threads_seen"] = most
    return r


def torch_version(python):
    """torch.__version__ under `python` (in a child process), or None without torch."""
    p = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else None


def torch_python():
    """An interpreter that can import torch (without importing it here), or None."""
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    if os.path.exists(SYSTEM_PYTHON) and os.path.realpath(SYSTEM_PYTHON) != os.path.realpath(sys.executable):
        ok = subprocess.run([SYSTEM_PYTHON, "-c", "import importlib.util, sys; "
                             "sys.exit(importlib.util.find_spec('torch') is None)"]).returncode == 0
        if ok:
            return SYSTEM_PYTHON
    return None


def spread(xs, fmt):
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def verdict(ratio):
    """nabla's time over torch's in words: "nabla 1.32x faster", "nabla 1.30x slower", or "even"
    within half a percent."""
    if not ratio > 0:
        return "?"
    if abs(ratio - 1) < 0.005:
        return "even"
    return f"nabla {1 / ratio:.2f}x faster" if ratio < 1 else f"nabla {ratio:.2f}x slower"


def ratio_cell(ours, theirs):
    """The ratio of the medians and its verdict, for a table cell."""
    r = statistics.median(ours) / statistics.median(theirs)
    return f"{r:6.3f} {verdict(r):>19}"


# OpenBLAS's cores older than AVX2 (its generic kernels on a CPU it does not know)
OLD_BLAS_CORES = {"katmai", "coppermine", "northwood", "prescott", "banias", "atom", "core2", "penryn",
                  "dunnington", "nehalem", "athlon", "opteron", "opteron_sse3", "barcelona", "nano", "bobcat",
                  "sandybridge", "bulldozer", "piledriver", "steamroller"}


def old_torch_line(versions):
    """One line on why torch 1.x is slower than torch 2.x when both were measured: `versions` holds
    (torch version, the OpenBLAS core its process ran, or None) per interpreter. None when there
    is not one of each."""
    old = [(v, c) for v, c in versions if v.split(".")[0] == "1"]
    new = [v for v, _ in versions if v.split(".")[0] != "1"]
    if not old or not new:
        return None
    v, core = old[0]
    generic = bool(core) and core.lower() in OLD_BLAS_CORES
    blas = "the system's OpenBLAS" + (f" (core {core}" + (": generic SSE kernels, it does not know this CPU)"
                                                          if generic else ")") if core else "")
    why = ("most of the gap is those generic kernels" if generic else
           "the gap is the libraries' kernels and 2.x's fused attention, not the thread settings")
    return (f"torch {v} against {new[0]}: Debian's torch {v} computes its products with {blas}, PyPI's torch "
            f"{new[0]} with the oneDNN and MKL it bundles, which pick their kernels by instruction set when they "
            f"run; {why}.")


COMPILE_THREADS_NOTE = (
    "torch.compile rows hold more threads than asked: Inductor starts a pool of compile workers (and the "
    "threads that feed and watch them) during the warm-up steps and keeps them, idle, while the timed steps "
    "run the compiled code on get_num_threads() OpenMP threads; 'timed' counts them all.")


def thread_settings(text):
    """--threads: a comma-separated list of 'default' (no thread variable set on either side, each
    library's own choice) and counts (every thread variable at that count on both sides)."""
    out = []
    for x in text.split(","):
        x = x.strip()
        if x == "default":
            out.append(None)
        elif x.isdigit() and int(x) >= 1:
            out.append(int(x))
        else:
            raise argparse.ArgumentTypeError(f"--threads: '{x}' is neither 'default' nor a count of 1 or more")
    if not out:
        raise argparse.ArgumentTypeError("--threads: no setting")
    return out


def batch_settings(text):
    """--batch: MODEL=N[,MODEL=N...], each a model of BATCH and a batch of 1 or more."""
    out = {}
    for x in text.split(","):
        m, _, n = x.strip().partition("=")
        if m not in BATCH or not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"--batch: '{x}' is not MODEL=N with MODEL one of "
                                             f"{', '.join(BATCH)} and N a batch of 1 or more")
        out[m] = int(n)
    return out


def env_setting(text):
    """--nabla-env: VAR=VALUE, not a thread variable (--threads sets those on both sides)."""
    k, eq, v = text.partition("=")
    if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
        raise argparse.ArgumentTypeError(f"--nabla-env: '{text}' is not VAR=VALUE")
    if k in THREAD_VARS:
        raise argparse.ArgumentTypeError(f"--nabla-env: {k} is a thread variable; --threads sets it on both sides")
    return k, v


def parse_args(argv=None):
    """The command line, with --quick's defaults filled in (steps, repeats, bf16 models, no compile)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run, after 3 warm-up steps "
                    "(default 20; 5 with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved (nabla, torch) rounds per model "
                    "(default 5; 2 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="a first look in under 3 minutes: 5 steps, 2 rounds, no bf16 rows, no torch.compile rows")
    ap.add_argument("--threads", type=thread_settings, default=thread_settings("default,1"),
                    metavar="default|N[,...]",
                    help="thread settings, each a set of rows: 'default' sets no thread variable (each side "
                         "as a user gets it), N sets OMP/OPENBLAS/MKL/NABLA_NUM_THREADS to N on both sides "
                         "(default: default,1)")
    ap.add_argument("--torch-intra-op", type=int, default=None,
                    help="PyTorch's OMP_NUM_THREADS and set_num_threads in the counted settings, when it should "
                         "differ from the count (e.g. 1 with --threads 2: BLAS on 2 threads, ATen's own kernels on 1)")
    ap.add_argument("--models", default="mlp,cnn,gpt")
    ap.add_argument("--batch", type=batch_settings, default={}, metavar="MODEL=N[,...]",
                    help="batch of the single-process rows for these models, on both sides (bench_ddp --batch); "
                         f"default {','.join(f'{m}={b}' for m, b in BATCH.items())}; not with --ddp")
    ap.add_argument("--nabla-env", type=env_setting, action="append", default=[], metavar="VAR=VALUE",
                    help="a variable set for nabla's runs only (repeatable), e.g. OPENBLAS_CORETYPE=Prescott "
                         "to measure a CPU that OpenBLAS does not know; not a thread variable")
    ap.add_argument("--bf16-models", default=None,
                    help="models with bf16 rows: nabla --bf16 against torch f32 and torch CPU autocast bf16 "
                         "(default cnn,gpt; none with --quick)")
    ap.add_argument("--ddp", type=int, default=0, metavar="N",
                    help="also DDP rows for --models: bench_ddp under nbrun on N ranks against PyTorch "
                         "DistributedDataParallel over Gloo in N processes, 1 thread per rank")
    ap.add_argument("--ddp-cpu-bind", choices=("auto", "cores", "none"), default="auto",
                    help="DDP rows: nbrun --cpu-bind for the ranks of both sides (nbrun starts PyTorch's "
                         "too; default auto, nbrun's default)")
    ap.add_argument("--ddp-bucket-mb", type=float, default=None, metavar="MB",
                    help="DDP rows: bucket cap on both sides (nabla: bench_ddp --bucket-mb, which also sets "
                         "its first bucket; torch: bucket_cap_mb, its first bucket stays 1 MiB); default: "
                         "each side's defaults (1 MiB first, then 25 MiB)")
    ap.add_argument("--nabla-bucket-step", action="store_true",
                    help="DDP rows: nabla steps the optimizer per bucket as its all-reduce ends "
                         "(bench_ddp --bucket-step, nb_ddp_set_optimizer); torch's DDP has no such option")
    ap.add_argument("--torch-python", default=None, metavar="PY[,PY...]",
                    help="interpreters for the PyTorch side, each a set of rows (default: this one if it has "
                         "torch, else /usr/bin/python3)")
    ap.add_argument("--compile", action="store_true",
                    help="also torch.compile rows, under every --torch-python whose torch has it (not with --quick)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds one run may take before it is stopped")
    ap.add_argument("--bin", default=os.environ.get("NABLA_BIN", os.path.join(HERE, "..", "build", "bin")))
    ap.add_argument("--torch-worker", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--torch-intra-op-worker", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--torch-autocast", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--torch-compile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--torch-ddp-worker", nargs=4, metavar=("RANK", "WORLD", "PORT", "MODEL"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.batch and a.ddp:
        ap.error("--batch sets the single-process rows' batch; the DDP rows keep bench_ddp's per-rank batch")
    BATCH.update(a.batch)
    if a.steps is None:
        a.steps = 5 if a.quick else 20
    if a.repeats is None:
        a.repeats = 2 if a.quick else 5
    if a.bf16_models is None:
        a.bf16_models = "" if a.quick else "cnn,gpt"
    if a.quick:
        a.compile = False
    return a


def setting_envs(base, setting, torch_intra_op):
    """(nabla's environment, torch's, torch's set_num_threads or 0 for its default) for a thread
    setting (None: default)."""
    if setting is None:
        return dict(base), dict(base), 0
    t = str(setting)
    intra = torch_intra_op or setting
    env_nabla = dict(base, **{k: t for k in THREAD_VARS})
    return env_nabla, dict(env_nabla, OMP_NUM_THREADS=str(intra)), intra


def setting_name(setting):
    return "default threads (no thread variable set)" if setting is None else f"{setting} thread" + (
        "s" if setting > 1 else "")


def main():
    a = parse_args()
    if a.torch_worker:
        return torch_worker(a.torch_worker, a.steps, a.torch_intra_op_worker, a.torch_autocast, a.torch_compile)
    if a.torch_ddp_worker:
        r, w, port, m = a.torch_ddp_worker
        # "-": the rank and world size nbrun gives each process (RANK, WORLD_SIZE)
        r = os.environ["RANK"] if r == "-" else r
        w = os.environ["WORLD_SIZE"] if w == "-" else w
        return torch_ddp_worker(int(r), int(w), int(port), m, a.steps, a.timeout)
    binary = os.path.join(a.bin, "bench_ddp")
    if not os.access(binary, os.X_OK):
        print(f"compare_torch: {binary} not found; build first (make build)", file=sys.stderr)
        return 1
    nbrun = os.path.join(a.bin, "nbrun")
    if a.ddp and (a.ddp < 2 or not os.access(nbrun, os.X_OK)):
        print(f"compare_torch: --ddp needs 2 or more ranks and {nbrun} (make build)", file=sys.stderr)
        return 1
    if a.torch_python:
        pythons = [p for p in a.torch_python.split(",") if p]
        missing = [p for p in pythons if torch_version(p) is None]
        if missing:
            print(f"compare_torch: torch does not import under {', '.join(missing)}", file=sys.stderr)
            return 1
    else:
        pythons = [p for p in [torch_python()] if p]
    if not pythons:
        print("compare_torch: torch is not importable (make bench-torch sets up a virtual environment "
              "with it); skipped")
        return 0
    python = pythons[0]  # the DDP rows' PyTorch
    variants = []  # (label, interpreter, compile)
    for p in pythons:
        v = torch_version(p)
        variants.append((f"torch {v} eager", p, False))
        if a.compile and int(v.split(".")[0]) >= 2:
            variants.append((f"torch {v} compile", p, True))
    for label, p, _ in variants:
        print(f"  {label}: {p}")
    base = {k: v for k, v in os.environ.items() if k not in THREAD_VARS and k not in ("GOMP_CPU_AFFINITY",
                                                                                        "OMP_PROC_BIND")}
    nabla_env = dict(a.nabla_env)
    if nabla_env:
        print("  nabla's runs only: " + " ".join(f"{k}={v}" for k, v in nabla_env.items()))
    info = subprocess.run([binary, "--info"], env=dict(base, **nabla_env), capture_output=True, text=True).stdout
    print("  nabla --info (default threads):\n" + "".join(f"    {x}\n" for x in info.splitlines()), end="")
    order = ", ".join(["nabla"] + [label for label, _, _ in variants])
    print(f"{a.steps} steps per run (median of each run), {a.repeats} interleaved rounds per model "
          f"({order}, then again); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("value [min-max] over runs; ratio = nabla / torch (below 1: nabla faster), of the medians, in words "
          "beside it; pair ratios: the same per interleaved pair")
    seen, wrong = [], []
    bf16_models = [m for m in a.bf16_models.split(",") if m]
    for setting in a.threads:
        env_nabla, env_torch, intra = setting_envs(base, setting, a.torch_intra_op)
        env_nabla.update(nabla_env)
        print(f"== {setting_name(setting)}")
        if setting is not None:
            print("  nabla env: " + " ".join(f"{k}={env_nabla[k]}" for k in THREAD_VARS))
            print("  torch env: " + " ".join(f"{k}={env_torch[k]}" for k in THREAD_VARS)
                  + f"; torch.set_num_threads({intra}), set_num_interop_threads(1)")
        print(f"{'model':6} {'batch':>6} {'nabla ms':>27} {'(fwd':>7} {'bwd':>7} {'opt)':>7} {'torch':>24} "
              f"{'torch ms':>27} {'ratio':>26} {'pair ratios':>19}")
        for m in a.models.split(","):
            ours, theirs = [], {label: [] for label, _, _ in variants}
            for _ in range(a.repeats):  # one round: nabla, then every PyTorch variant
                ours.append(run_nabla(binary, m, a.steps, env_nabla, timeout=a.timeout))
                for label, p, comp in variants:
                    theirs[label].append(run_torch(p, m, a.steps, intra, env_torch, timeout=a.timeout,
                                                   compile=comp))
                    if theirs[label][-1]["params"] != ours[-1]["params"]:
                        print(f"compare_torch: {m}: {ours[-1]['params']} parameters in nabla's model, "
                              f"{theirs[label][-1]['params']} in {label}'s: the models differ", file=sys.stderr)
                        return 1
            o = [r["ms"] for r in ours]
            fb = [statistics.median(r[k] for r in ours) for k in ("fwd", "bwd", "opt")]
            b = f"{BATCH[m]}x{GPT_SHAPES[m][0]}" if m in GPT_SHAPES else str(BATCH[m])
            for i, (label, _, _) in enumerate(variants):
                th = [r["ms"] for r in theirs[label]]
                pairs = [x / y for x, y in zip(o, th)]
                mine = f"{spread(o, '{:.3f}'):>27} {fb[0]:7.3f} {fb[1]:7.3f} {fb[2]:7.3f}" if i == 0 else " " * 51
                print(f"{m if i == 0 else '':6} {b if i == 0 else '':>6} {mine} {label:>24} "
                      f"{spread(th, '{:.3f}'):>27} {ratio_cell(o, th)} {spread(pairs, '{:.3f}'):>19}", flush=True)
                seen.append((setting, f"{m} ({label})", ours, theirs[label]))
        if bf16_models:
            print("bf16: nabla --bf16 (bf16 products, f32 accumulation and weights) against torch eager f32 and "
                  "torch eager under autocast(cpu, bfloat16) (or compiled, per row); interleaved rounds (nabla, "
                  "then each variant in f32 and under autocast)")
            print(f"{'model':6} {'batch':>6} {'nabla bf16 ms':>27} {'torch':>24} {'torch f32 ms':>27} "
                  f"{'ratio':>26} {'torch autocast ms':>27} {'ratio':>26} {'pair ratios (autocast)':>22}")
        for m in bf16_models:
            ours = []
            t32, tac = ({label: [] for label, _, _ in variants} for _ in range(2))
            for _ in range(a.repeats):  # one round: nabla, then every variant in f32 and under autocast
                ours.append(run_nabla(binary, m, a.steps, env_nabla, bf16=True, timeout=a.timeout))
                for label, p, comp in variants:
                    t32[label].append(run_torch(p, m, a.steps, intra, env_torch, timeout=a.timeout, compile=comp))
                    tac[label].append(run_torch(p, m, a.steps, intra, env_torch, autocast=True,
                                                timeout=a.timeout, compile=comp))
            o = [r["ms"] for r in ours]
            b = f"{BATCH[m]}x{GPT_SHAPES[m][0]}" if m in GPT_SHAPES else str(BATCH[m])
            for i, (label, _, _) in enumerate(variants):
                f, c = [r["ms"] for r in t32[label]], [r["ms"] for r in tac[label]]
                pairs = [x / y for x, y in zip(o, c)]
                mine = f"{spread(o, '{:.3f}'):>27}" if i == 0 else " " * 27
                print(f"{m if i == 0 else '':6} {b if i == 0 else '':>6} {mine} {label:>24} "
                      f"{spread(f, '{:.3f}'):>27} {ratio_cell(o, f)} {spread(c, '{:.3f}'):>27} "
                      f"{ratio_cell(o, c)} {spread(pairs, '{:.3f}'):>22}", flush=True)
                seen.append((setting, f"{m}-bf16 ({label})", ours, t32[label] + tac[label]))
        if setting is None:
            continue
        # nabla at N threads: the main thread, OpenBLAS's N - 1 workers, its own pool's N - 1
        # and, where oneDNN runs on N threads, OpenMP's N - 1 (docs/threads.md), one op at a time
        most = 3 * setting - 2
        wrong += [f"{m}: nabla ran {r['threads']} threads (at most {most} expected)"
                  for st, m, ours, _ in seen if st == setting for r in ours if r["threads"] > most]
        wrong += [f"{m}: torch.get_num_threads() = {r['intra_op']}, not {intra}"
                  for st, m, _, theirs in seen if st == setting for r in theirs if r["intra_op"] != intra]
        wrong += [f"{m}: PyTorch's openblas_get_num_threads() = {r['blas']}, not {setting}"
                  for st, m, _, theirs in seen if st == setting for r in theirs
                  if r["blas"] is not None and r["blas"] != setting]
    seen_ddp, env_ddp = [], dict(base, **{k: "1" for k in THREAD_VARS})
    extra = []
    if a.ddp_bucket_mb is not None:
        extra += ["--bucket-mb", str(a.ddp_bucket_mb)]
    if a.nabla_bucket_step:
        extra.append("--bucket-step")
    env_torch_ddp = dict(env_ddp)
    if a.ddp_bucket_mb is not None:
        env_torch_ddp["COMPARE_TORCH_BUCKET_MB"] = str(a.ddp_bucket_mb)
    if a.ddp:
        buckets = ("default buckets" if a.ddp_bucket_mb is None else
                   f"buckets capped at {a.ddp_bucket_mb:g} MiB on both sides (nabla's first too, torch's "
                   "first 1 MiB)")
        print(f"DDP on {a.ddp} processes (weak scaling: each rank its own batch of the size below): "
              f"bench_ddp under nbrun (Gloo) against torch DistributedDataParallel over Gloo, {buckets}"
              + ("; nabla steps the optimizer per bucket (--bucket-step)" if a.nabla_bucket_step else "")
              + "; pairs interleaved")
        print("  env of every rank, both sides: " + " ".join(f"{k}={env_ddp[k]}" for k in THREAD_VARS)
              + "; torch.set_num_threads(1), set_num_interop_threads(1)")
        print(f"  CPU binding, both sides: nbrun --cpu-bind {a.ddp_cpu_bind} (PyTorch's ranks are started by "
              "nbrun too)")
        print("  hidden: share of nabla's all-reduce time that ran before backward ended "
              "(nb_ddp_last_stats), median over the timed steps of rank 0")
        print("  all ranks: the same over every rank's timed steps on one clock, without the time a bucket "
              "waited for a rank that launched it later (peer wait, ms per rank and step), hidden behind "
              "the last rank's backward (nb_ddp_overlap_across_ranks)")
        print(f"{'model':6} {'batch':>6} {'nabla ms':>27} {'hidden':>18} {'all ranks':>18} {'peer wait':>18} "
              f"{'torch ms':>27} {'ratio':>26} {'pair ratios':>19}")
    for m in a.models.split(",") if a.ddp else []:
        ours, theirs = [], []
        for _ in range(a.repeats):
            ours.append(run_nabla_ddp(nbrun, binary, m, a.steps, a.ddp, dict(env_ddp, **nabla_env), a.timeout,
                                      extra, a.ddp_cpu_bind))
            theirs.append(run_torch_ddp(nbrun, python, m, a.steps, a.ddp, env_torch_ddp, a.timeout,
                                        a.ddp_cpu_bind))
            if theirs[-1]["params"] != ours[-1]["params"] or ours[-1]["batch"] != BATCH[m]:
                print(f"compare_torch: {m} DDP: {ours[-1]['params']} parameters and batch "
                      f"{ours[-1]['batch']} in nabla's, {theirs[-1]['params']} and {BATCH[m]} in torch's: "
                      "the runs differ",
                      file=sys.stderr)
                return 1
        o, th, hid = [r["ms"] for r in ours], [r["ms"] for r in theirs], [r["hidden"] for r in ours]
        hall, pw = [r["hidden_all"] for r in ours], [r["peer_wait_ms"] for r in ours]
        pairs = [x / y for x, y in zip(o, th)]
        b = f"{BATCH[m]}x{GPT_SHAPES[m][0]}" if m in GPT_SHAPES else str(BATCH[m])
        print(f"{m:6} {b:>6} {spread(o, '{:.3f}'):>27} {spread(hid, '{:.2f}'):>18} "
              f"{spread(hall, '{:.2f}'):>18} {spread(pw, '{:.1f}'):>18} "
              f"{spread(th, '{:.3f}'):>27} {ratio_cell(o, th)} "
              f"{spread(pairs, '{:.3f}'):>19}", flush=True)
        seen_ddp.append((f"{m}-ddp{a.ddp}", ours, theirs))
    print("threads in force, read back: 'process' = most kernel threads the parent saw in the process "
          "(start and exit included); 'timed' = most the PyTorch process counted in itself after each timed step")
    for setting, m, ours, theirs in seen:
        r = theirs[0]
        print(f"  [{'default' if setting is None else setting}] {m:4} nabla: process "
              f"{sorted({x['threads'] for x in ours})}; "
              f"torch {r['version']}: get_num_threads {sorted({x['intra_op'] for x in theirs})}, "
              f"get_num_interop_threads {sorted({x['inter_op'] for x in theirs})}, "
              f"openblas_get_num_threads {sorted({x['blas'] for x in theirs}, key=str)}, "
              f"timed {sorted({x['threads'] for x in theirs})}, process {sorted({x['threads_seen'] for x in theirs})}")
    if any(comp for _, _, comp in variants):
        print("  " + COMPILE_THREADS_NOTE)
    if seen_ddp:
        print("  DDP rows, per rank ('process': the most of any one rank, Gloo's threads included; "
              "'timed': rank 0's):")

    def seen_of(rs, k):
        return sorted({x[k] for x in rs}, key=str)

    for m, ours, theirs in seen_ddp:
        r = theirs[0]
        print(f"  {m} nabla: process {seen_of(ours, 'threads')}; torch {r['version']} ({r['backend']}, world "
              f"{r['world']}): get_num_threads {seen_of(theirs, 'intra_op')}, get_num_interop_threads "
              f"{seen_of(theirs, 'inter_op')}, openblas_get_num_threads {seen_of(theirs, 'blas')}, "
              f"timed {seen_of(theirs, 'threads')}, process {seen_of(theirs, 'threads_seen')}")
    versions = {}
    for _, _, _, theirs in seen:
        for r in theirs:
            versions.setdefault(r["version"], r.get("blas_core"))
    line = old_torch_line(sorted(versions.items()))
    if line:
        print(line)
    wrong += [f"{m}: torch rank 0's get_num_threads() = {r['intra_op']}, openblas_get_num_threads() = "
              f"{r['blas']}, not 1" for m, _, theirs in seen_ddp for r in theirs if r["intra_op"] != 1
              or r["blas"] not in (None, 1)]
    if wrong:
        print("compare_torch: the thread settings did not take, the figures above are not comparable: "
              + "; ".join(sorted(set(wrong))), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
