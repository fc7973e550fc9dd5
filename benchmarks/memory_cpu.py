#!/usr/bin/env python3
"""Peak memory of one GPT training step, nabla against PyTorch, on the CPU.

One step (forward, cross-entropy, backward, AdamW step) of the same GPT
(by default 2 layers, width 256, 4 heads, sequence 1024, batch 4,
vocabulary 8192, f32: the shape of the memory issue's figures), each side in
a fresh process of its own, with the same thread variables:

  nabla:   build/bin/bench_gpt2 --device cpu --steps 1 --warmup 0 --machine
           (its peak RSS, and its baseline: the resident set after one small
           product has started the libraries, before the model exists);
           with --recompute a second nabla row recomputes each block;
  PyTorch: this script with --torch-worker: the GPT of compare_torch.py
           (manual attention, as 1.13 has no fused one) at the same shape;
           its baseline is the resident set after `import torch` and one
           small product, its peak the process's VmHWM.

Each row gives the peak RSS above the process's own baseline (medians over
--repeats interleaved runs, with min..max), and nabla's over PyTorch's; the
figure the memory target speaks of is that ratio (target: at most 0.6).
nabla's line also gives its step context's peak beside the floor computed
from the shapes (nb_gpt_memory_floor). This process never imports torch.
"""
import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def torch_worker(a):
    """Runs in the PyTorch process: prints baseline and peak in GiB."""
    sys.path.insert(0, HERE)
    import compare_torch as ct

    ct.GPT_VOCAB = a.vocab
    ct.GPT_SHAPES["gpt"] = (a.seq_len, a.layers, a.heads, a.width)
    torch, F, models = ct.torch_models()
    torch.set_num_threads(a.threads)
    torch.ones(64, 64).matmul(torch.ones(64, 64)).sum().item()
    base = rss_kib("VmRSS")
    torch.manual_seed(1337)
    model = models["gpt"]()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(99)
    x = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=g)
    y = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=g)
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, a.vocab), y.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print("torch=%s baseline_gib=%.4f peak_gib=%.4f loss=%.4f" %
          (torch.__version__, base / 2**20, rss_kib("VmHWM") / 2**20, loss.item()))


def parse(line):
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)


def env_for(threads):
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NABLA_NUM_THREADS"):
        env[k] = str(threads)
    return env


def run(cmd, env, timeout):
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.exit("memory_cpu: %s failed (exit %d):\n%s%s" % (cmd[0], p.returncode, p.stdout, p.stderr))
    return parse(p.stdout.strip().splitlines()[-1])


def fmt(xs):
    return "%7.1f (%.1f..%.1f)" % (statistics.median(xs), min(xs), max(xs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, v in (("layers", 2), ("width", 256), ("heads", 4), ("seq-len", 1024), ("batch", 4),
                    ("vocab", 8192), ("repeats", 3), ("threads", 2)):
        ap.add_argument("--" + name, type=int, default=v)
    ap.add_argument("--recompute", action="store_true", help="also nabla with every block recomputed")
    ap.add_argument("--torch-python", default=sys.executable, help="the Python that has torch")
    ap.add_argument("--bin", default=os.environ.get("NABLA_BIN", os.path.join(HERE, "..", "build", "bin")))
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        return torch_worker(a)
    shape = ["--layers", str(a.layers), "--width", str(a.width), "--heads", str(a.heads),
             "--seq-len", str(a.seq_len), "--batch", str(a.batch), "--vocab", str(a.vocab)]
    nabla = [os.path.join(a.bin, "bench_gpt2"), "--device", "cpu", "--steps", "1", "--warmup", "0",
             "--machine"] + shape
    torch = [a.torch_python, os.path.abspath(__file__), "--torch-worker", "--threads", str(a.threads)]
    torch += shape
    sides = [("nabla", nabla)] + ([("nabla --recompute", nabla + ["--recompute"])] if a.recompute else [])
    sides.append(("pytorch", torch))
    env = env_for(a.threads)
    above = {name: [] for name, _ in sides}
    last = {}
    for _ in range(a.repeats):
        for name, cmd in sides:
            r = run(cmd, env, a.timeout)
            base = float(r.get("start_rss_gib", r.get("baseline_gib")))
            peak = float(r.get("peak_rss_gib", r.get("peak_gib")))
            above[name].append(1024 * (peak - base))
            last[name] = r
    print("GPT %d layers, width %d, %d heads, sequence %d, batch %d, vocabulary %d, f32, AdamW, "
          "%d threads; %d interleaved runs" % (a.layers, a.width, a.heads, a.seq_len, a.batch, a.vocab,
                                               a.threads, a.repeats))
    print("%-20s %26s %12s" % ("", "peak RSS above baseline MiB", "vs pytorch"))
    t = statistics.median(above["pytorch"])
    for name, _ in sides:
        m = statistics.median(above[name])
        print("%-20s %26s %12.2f" % (name, fmt(above[name]), m / t))
    n = last["nabla"]
    print("nabla step context peak %.1f MiB, floor (saved + logits) %.1f MiB; baseline %.0f MiB; "
          "pytorch %s baseline %.0f MiB" % (1024 * float(n["step_ctx_gib"]), 1024 * float(n["floor_step_gib"]),
                                            1024 * float(n["start_rss_gib"]), last["pytorch"]["torch"],
                                            1024 * float(last["pytorch"]["baseline_gib"])))


if __name__ == "__main__":
    main()
