#!/usr/bin/env python3
"""GPT-2-small training steps on one GPU: nabla bf16 against PyTorch.

nabla: build/bin/bench_gpt2 --bf16 --machine (compute dtype bf16: matrix
products in bf16 with f32 accumulation, everything else f32). PyTorch: the
same model (12 layers, 12 heads, width 768, sequence 1024, vocabulary 50304,
tied head, no dropout), the same batch, AdamW (lr 6e-4, betas 0.9/0.95,
weight decay 0.1), clipping at 1.0, random tokens on the device, bf16
autocast; eager, then torch.compile. Every step ends with loss.item() on
both sides. Prints tokens/s, the median step, MFU = 6 * parameters *
tokens/s / peak (the peak is printed: 989 TFLOP/s dense bf16 for the H100
and H200 SXM), and nabla over each PyTorch variant with the targets: at
least 1.3x eager, no slower than torch.compile.

Attention: --attention manual (default) computes it as nabla does
(scores, causal mask, softmax, times V); --attention sdpa uses PyTorch's
fused scaled_dot_product_attention (flash attention), a different
algorithm from ours, for reference.

    benchmarks/gpt2_gpu.py [--bin build/bin] [--batch 8] [--steps 20] [--no-compile]

Exits 0 with a message when torch or a GPU is missing.
"""
import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("gpt2_gpu: torch is not importable; skipped")
    sys.exit(0)


class Block(nn.Module):
    def __init__(self, c, n_head, sdpa):
        super().__init__()
        self.n_head, self.sdpa = n_head, sdpa
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.attn_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def attn(self, x):
        n, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(n, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.n_head))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            y = att @ v
        return self.attn_proj(y.transpose(1, 2).reshape(n, t, c))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, block, layers, heads, width, sdpa):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.h = nn.ModuleList(Block(width, heads, sdpa) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        # nabla's GPT-2 initialisation (models/gpt.c), so that the loss columns
        # compare: weights N(0, 0.02), the two residual projections N(0, 0.02 /
        # sqrt(2 layers)), biases 0, layer norms 1 and 0
        for name, p in self.named_parameters():
            if ".ln_" in name or name.startswith("ln_f"):
                continue
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith(("attn_proj.weight", "mlp_proj.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()  # tied head


def torch_run(a, dev, compiled):
    torch.manual_seed(1337)
    model = GPT(a.vocab, a.seq_len, a.layers, a.heads, a.width, a.attention == "sdpa").to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    fwd = torch.compile(model) if compiled else model
    g = torch.Generator(device=dev).manual_seed(99)
    batches = [torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), device=dev, generator=g) for _ in range(4)]
    times, losses = [], []
    for s in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        tok = batches[s % 4]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(tok[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), tok[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    peak_gib = torch.cuda.max_memory_allocated(dev) / 2 ** 30
    del model, opt, fwd, batches
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    return ms, n_params, losses[0], losses[-1], peak_gib


def nabla_run(a):
    binary = os.path.join(a.bin, "bench_gpt2")
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"gpt2_gpu: {binary} not found; build first")
    cmd = [binary, "--bf16", "--machine", "--layers", str(a.layers), "--heads", str(a.heads), "--width",
           str(a.width), "--seq-len", str(a.seq_len), "--vocab", str(a.vocab), "--batch", str(a.batch),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--peak-tflops", str(a.peak_tflops)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode == 77:
        return None
    if p.returncode != 0:
        raise SystemExit(f"gpt2_gpu: {' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    return dict(re.findall(r"(\w+)=(\S+)", p.stdout))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("NABLA_BIN", os.path.join(HERE, "..", "build", "bin")))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--attention", choices=("manual", "sdpa"), default="manual")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile run")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpt2_gpu: torch sees no GPU; skipped")
        return 0
    dev = torch.device("cuda", 0)
    tokens = a.batch * a.seq_len
    mfu = lambda ms, n: 6.0 * n * (tokens / (ms / 1e3)) / (a.peak_tflops * 1e12)
    print(f"GPT {a.layers} layers, {a.heads} heads, width {a.width}, sequence {a.seq_len}, vocabulary "
          f"{a.vocab}, batch {a.batch} ({tokens} tokens/step), bf16; {a.steps} steps after {a.warmup} "
          f"warm-up, medians; MFU = 6 N tokens/s / {a.peak_tflops:g} TFLOP/s (dense bf16 peak)")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(dev)}; torch attention: {a.attention}\n")
    rows = []
    ours = nabla_run(a)
    if ours is None:
        print("gpt2_gpu: bench_gpt2 found no GPU for nabla (exit 77); torch only")
    else:
        rows.append(("nabla bf16", float(ours["ms"]), int(ours["params"]), float(ours["first_loss"]),
                     float(ours["loss"]), float(ours["step_ctx_gib"]) + float(ours["params_ctx_gib"])))
    variants = [("torch eager autocast", False)] + ([] if a.no_compile else [("torch.compile autocast", True)])
    for name, compiled in variants:
        ms, n, l0, l1, gib = torch_run(a, dev, compiled)
        rows.append((name, ms, n, l0, l1, gib))
    print(f"{'implementation':24} {'ms/step':>9} {'tokens/s':>10} {'MFU':>6} {'params':>11} {'loss first->last':>17} "
          f"{'GiB':>6}")
    for name, ms, n, l0, l1, gib in rows:
        print(f"{name:24} {ms:9.2f} {tokens / (ms / 1e3):10.0f} {100 * mfu(ms, n):5.1f}% {n:11d} "
              f"{l0:8.3f}->{l1:7.3f} {gib:6.1f}")
    if ours is not None:
        ms_ours, n_ours = rows[0][1], rows[0][2]
        print()
        for name, ms, n, *_ in rows[1:]:
            if n != n_ours:
                print(f"gpt2_gpu: {n_ours} parameters in nabla's model, {n} in {name}'s: the models differ",
                      file=sys.stderr)
                return 1
            target = 1.3 if "eager" in name else 1.0
            r = ms / ms_ours
            print(f"nabla / {name}: {r:.2f}x tokens/s (target >= {target}x: {'met' if r >= target else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
