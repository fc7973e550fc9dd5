"""nabla's GPT parameter names map one to one onto GPT-2's.

Runs build/bin/nb_gpt_sample, which saves a small nabla GPT (every
parameter random, LayerNorms and biases included) as safetensors and prints
the logits nabla computes for a batch of tokens. This script builds a GPT-2
in PyTorch the way GPT-2's own code lays it out (Conv1D layers that store
their weight as (in, out), causal-mask buffers named attn.bias, an lm_head
tied to transformer.wte), converts the file with the documented rules
(transpose the four Conv1D weights of each block, tie lm_head.weight to
transformer.wte.weight, keep the model's own mask buffers), loads it with
load_state_dict(strict=True) and compares the logits. The way back is
checked too: GPT-2's state dict, converted with the inverse rules, is the
file's tensors bit for bit.

Skipped (exit 77) when torch does not import; a failure under CI=true.
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import driver, fail, import_torch  # noqa: E402

torch = import_torch()
nn = torch.nn

# The Linear layers that GPT-2's checkpoints store transposed (Conv1D).
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


# ---------------------------------------------------- GPT-2, as GPT-2 has it
class Conv1D(nn.Module):
    """GPT-2's projection: weight (in, out), y = x @ weight + bias."""

    def __init__(self, n_out, n_in):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Attention(nn.Module):
    def __init__(self, c, n_head, block):
        super().__init__()
        self.c, self.n_head = c, n_head
        self.c_attn = Conv1D(3 * c, c)
        self.c_proj = Conv1D(c, c)
        mask = torch.tril(torch.ones(block, block, dtype=torch.bool)).view(1, 1, block, block)
        self.register_buffer("bias", mask)
        self.register_buffer("masked_bias", torch.tensor(-1e4))

    def forward(self, x):
        b, t, c = x.shape
        d = c // self.n_head
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        att = att.masked_fill(~self.bias[:, :, :t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.c_proj(y)


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = Conv1D(4 * c, c)
        self.c_proj = Conv1D(c, 4 * c)

    def forward(self, x):
        return self.c_proj(gelu_new(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c, n_head, block):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c, eps=1e-5)
        self.attn = Attention(c, n_head, block)
        self.ln_2 = nn.LayerNorm(c, eps=1e-5)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c = cfg["n_embd"]
        self.wte = nn.Embedding(cfg["vocab_size"], c)
        self.wpe = nn.Embedding(cfg["block_size"], c)
        self.h = nn.ModuleList(Block(c, cfg["n_head"], cfg["block_size"])
                               for _ in range(cfg["n_layer"]))
        self.ln_f = nn.LayerNorm(c, eps=1e-5)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx):
        return self.lm_head(self.transformer(idx))


# ------------------------------------------------------------ the mapping
def nabla_to_gpt2(tensors, model):
    """nabla's tensors (name -> torch tensor) -> a state dict for GPT-2."""
    sd = {}
    for name, t in tensors.items():
        sd[name] = t.t().contiguous() if name.endswith(CONV1D) else t
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    for name, buf in model.named_buffers():  # the causal masks: GPT-2's own
        sd[name] = buf
    return sd


def gpt2_to_nabla(sd):
    out = {}
    for name, t in sd.items():
        if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        out[name] = t.t().contiguous() if name.endswith(CONV1D) else t
    return out


def read_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    tensors = {}
    for name, e in header.items():
        if e["dtype"] != "F32":
            fail("%s: dtype %s, expected F32" % (name, e["dtype"]))
        begin, end = e["data_offsets"]
        values = struct.unpack("<%df" % ((end - begin) // 4), data[begin:end])
        tensors[name] = torch.tensor(values, dtype=torch.float32).reshape(e["shape"])
    return tensors, meta


def main():
    tool = driver("nb_gpt_sample")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gpt.safetensors")
        run = subprocess.run([tool, path], capture_output=True, text=True)
        if run.returncode != 0:
            fail("nb_gpt_sample exited with %d: %s" % (run.returncode, run.stderr))
        expected = json.loads(run.stdout)
        tensors, meta = read_safetensors(path)
    cfg = expected["config"]
    if {k: int(meta[k]) for k in cfg} != cfg:
        fail("metadata %r does not match the config %r" % (meta, cfg))

    model = GPT2LMHeadModel(cfg)
    gpt2_keys = set(model.state_dict())
    masks = {k for k in gpt2_keys if k.endswith((".attn.bias", ".attn.masked_bias"))}
    want = gpt2_keys - masks - {"lm_head.weight"}
    if set(tensors) != want:
        fail("names differ from GPT-2's: only nabla %s, only GPT-2 %s"
             % (sorted(set(tensors) - want), sorted(want - set(tensors))))

    model.load_state_dict(nabla_to_gpt2(tensors, model), strict=True)
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        fail("lm_head is no longer tied to transformer.wte after loading")
    with torch.no_grad():
        logits = model(torch.tensor(expected["tokens"]))
    ours = torch.tensor(expected["logits"], dtype=torch.float32).reshape(logits.shape)
    err = (logits - ours).abs().max().item()
    scale = ours.abs().max().item()
    if not err <= 1e-5 * max(1.0, scale):
        fail("logits differ: max |torch - nabla| = %g (largest logit %g)" % (err, scale))

    back = gpt2_to_nabla(model.state_dict())
    if set(back) != set(tensors):
        fail("the way back gives other names: %s" % sorted(set(back) ^ set(tensors)))
    for name, t in tensors.items():
        if not torch.equal(back[name], t):
            fail("%s differs after GPT-2 -> nabla" % name)

    print("ok: %d tensors, logits %s agree to %.2g (largest %.3g); lm_head tied; round trip exact"
          % (len(tensors), tuple(logits.shape), err, scale))


if __name__ == "__main__":
    main()
