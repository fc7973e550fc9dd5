#!/usr/bin/env python3
"""Side-by-side training-step time of nabla and PyTorch eager on the CPU.

For the bundled MLP classifier, the CNN and the character-level GPT (the
shapes of models/*.c as bench_ddp --model builds them), times N training
steps (forward, loss, backward, AdamW step, zero_grad) of our C program
(build/bin/bench_ddp --no-ddp --model M --machine) and of the PyTorch
equivalent in this process, both single process with the same thread count,
in interleaved repeats, and prints the medians and our time over theirs
(below 1: we are faster).

    make bench-torch                  (installs python3-torch when missing)
    /usr/bin/python3 benchmarks/compare_torch.py [--steps 30] [--repeats 5] [--threads 1]

It re-executes itself with /usr/bin/python3 (Debian's python3-torch) when
the interpreter running it cannot import torch, and exits 0 with a message
when no interpreter can.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

SYSTEM_PYTHON = "/usr/bin/python3"

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    if os.path.realpath(sys.executable) != os.path.realpath(SYSTEM_PYTHON) and os.path.exists(SYSTEM_PYTHON) \
            and not os.environ.get("NABLA_COMPARE_REEXEC"):
        os.environ["NABLA_COMPARE_REEXEC"] = "1"
        os.execv(SYSTEM_PYTHON, [SYSTEM_PYTHON] + sys.argv)
    print("compare_torch: torch is not importable (install python3-torch: make bench-torch); skipped")
    sys.exit(0)

HERE = os.path.dirname(os.path.abspath(__file__))

# Must match bench_ddp.c (and through it models/*.c and the training programs).
GPT_VOCAB, GPT_T, GPT_LAYERS, GPT_HEADS, GPT_WIDTH = 79, 64, 4, 4, 128
BATCH = {"mlp": 8, "cnn": 32, "gpt": 16}


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
        att = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.n_head) ** 0.5)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        return self.attn_proj((att @ v).transpose(1, 2).reshape(n, t, c))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(GPT_VOCAB, GPT_WIDTH), nn.Embedding(GPT_T, GPT_WIDTH)
        self.h = nn.ModuleList(Block(GPT_WIDTH, GPT_HEADS) for _ in range(GPT_LAYERS))
        self.ln_f = nn.LayerNorm(GPT_WIDTH)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()  # tied head


def torch_case(model_name, steps):
    """(median ms per step over `steps` steps after 3 warm-up steps, like
    bench_ddp; number of parameters)."""
    torch.manual_seed(1)
    b = BATCH[model_name]
    if model_name == "mlp":
        model, x, y = mlp(), torch.randn(b, 30), torch.arange(b) % 2
    elif model_name == "cnn":
        model, x, y = CNN(), torch.randn(b, 1, 8, 8), torch.arange(b) % 10
    else:
        model = GPT()
        x = torch.randint(0, GPT_VOCAB, (b, GPT_T))
        y = torch.randint(0, GPT_VOCAB, (b, GPT_T))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    times = []
    for s in range(steps + 3):
        t0 = time.perf_counter()
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s >= 3:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), sum(p.numel() for p in model.parameters())


def nabla_case(binary, model_name, steps, env):
    out = subprocess.run([binary, "--no-ddp", "--model", model_name, "--machine", "--steps", str(steps)],
                         env=env, check=True, capture_output=True, text=True).stdout
    f = dict(re.findall(r"(\w+)=(\S+)", out))
    return float(f["ms"]), float(f["fwd"]), float(f["bwd"]), float(f["opt"]), int(f["params"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OPENBLAS_NUM_THREADS", "1")))
    ap.add_argument("--models", default="mlp,cnn,gpt")
    ap.add_argument("--bin", default=os.environ.get("NABLA_BIN", os.path.join(HERE, "..", "build", "bin")))
    a = ap.parse_args()
    binary = os.path.join(a.bin, "bench_ddp")
    if not os.access(binary, os.X_OK):
        print(f"compare_torch: {binary} not found; build first (make build)", file=sys.stderr)
        return 1
    torch.set_num_threads(a.threads)
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads))
    print(f"torch {torch.__version__}, {a.threads} thread(s), {a.steps} steps x {a.repeats} interleaved repeats, "
          f"medians; ratio = nabla / torch (below 1: nabla faster)")
    print(f"{'model':6} {'batch':>6} {'nabla ms':>9} {'(fwd':>7} {'bwd':>7} {'opt)':>7} {'torch ms':>9} {'ratio':>6}")
    for m in a.models.split(","):
        ours, theirs, parts = [], [], []
        for _ in range(a.repeats):
            r = nabla_case(binary, m, a.steps, env)
            ours.append(r[0])
            parts.append(r[1:4])
            ms, n_params = torch_case(m, a.steps)
            theirs.append(ms)
            if n_params != r[4]:
                print(f"compare_torch: {m}: {r[4]} parameters in nabla's model, {n_params} in torch's: "
                      "the models differ", file=sys.stderr)
                return 1
        o, t = statistics.median(ours), statistics.median(theirs)
        fb = [statistics.median(p[i] for p in parts) for i in range(3)]
        b = f"{BATCH[m]}x{GPT_T}" if m == "gpt" else str(BATCH[m])
        print(f"{m:6} {b:>6} {o:9.3f} {fb[0]:7.3f} {fb[1]:7.3f} {fb[2]:7.3f} {t:9.3f} {o / t:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
