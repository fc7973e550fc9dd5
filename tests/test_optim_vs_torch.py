"""nabla's optimizers and gradient clipping against PyTorch's.

Runs build/bin/nb_optim_trace, which prints fixed inputs and nabla's
results (SGD with momentum, dampening, Nesterov and weight decay; Adam with
L2 decay; AdamW; Adam and AdamW with amsgrad; two parameter groups; a
parameter without gradient), and
replays each run with torch.optim and torch.nn.utils.clip_grad_norm_.
float64 runs must agree to ~1e-12 relative, float32 runs to a few ulps
(the order of floating-point operations differs between PyTorch versions).
Skipped (exit 77) when torch does not import; a failure under CI=true.
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import compare_with_torch, driver, fail, import_torch  # noqa: E402

torch = import_torch()

SHAPES = [(3, 4), (4,), (2,)]


def compare(got, want, dtype, what):
    """got: torch tensor; want: list of nabla's values. Returns bitwise-equal count."""
    rtol, atol = (1e-12, 1e-14) if dtype == torch.float64 else (4e-6, 1e-7)
    w = compare_with_torch(torch, got, want, dtype, rtol, atol, what)
    return int((got == w).sum())


def make_optimizer(run, params):
    groups = [{"params": [params[0]], "weight_decay": run["weight_decay"]},
              {"params": [params[1], params[2]], "weight_decay": 0.0}]
    if run["kind"] == "sgd":
        return torch.optim.SGD(groups, lr=run["lr"], momentum=run["momentum"],
                               dampening=run["dampening"], nesterov=run["nesterov"])
    cls = torch.optim.Adam if run["kind"] == "adam" else torch.optim.AdamW
    return cls(groups, lr=run["lr"], betas=(run["beta1"], run["beta2"]), eps=run["eps"],
               amsgrad=run["amsgrad"])


def max_matters(opt, params):
    """Elements whose max_exp_avg_sq exceeds their exp_avg_sq in torch's state."""
    n = 0
    for p in params:
        st = opt.state.get(p, {})
        if "max_exp_avg_sq" in st:
            n += int((st["max_exp_avg_sq"] > st["exp_avg_sq"]).sum())
    return n


def main():
    torch.set_num_threads(1)
    tool = driver("nb_optim_trace")
    out = subprocess.run([tool], stdout=subprocess.PIPE, check=True).stdout
    data = json.loads(out.decode())
    total = same = 0
    for run in data["runs"]:
        dtype = getattr(torch, run["dtype"])
        params = [torch.tensor(v, dtype=dtype).reshape(s).requires_grad_()
                  for v, s in zip(run["init"], SHAPES)]
        opt = make_optimizer(run, params)
        for k, step in enumerate(run["steps"]):
            params[0].grad = torch.tensor(step["grads"][0], dtype=dtype).reshape(SHAPES[0])
            params[1].grad = torch.tensor(step["grads"][1], dtype=dtype).reshape(SHAPES[1])
            opt.step()
            for i, (p, want) in enumerate(zip(params, step["after"])):
                what = "%s %s step %d param %d" % (run["label"], run["dtype"], k + 1, i)
                same += compare(p.detach(), want, dtype, what)
                total += p.numel()
        if run.get("amsgrad"):
            below = max_matters(opt, params)
            if below == 0:
                fail("%s: exp_avg_sq never fell below its maximum; the case tests nothing"
                     % run["label"])
            print("%-30s %-8s AMSGrad's maximum active for %d elements at the end"
                  % (run["label"], run["dtype"], below))
        print("%-30s %-8s agrees with torch.optim over %d steps"
              % (run["label"], run["dtype"], len(run["steps"])))
    for c in data["clips"]:
        norm_type = float("inf") if c["norm_type"] == "inf" else c["norm_type"]
        grads = [torch.tensor(c["before"][0], dtype=torch.float64),
                 torch.tensor(c["before"][1], dtype=torch.float64)]
        params = [torch.zeros_like(g, requires_grad=True) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        norm = float(torch.nn.utils.clip_grad_norm_(params, c["max_norm"], norm_type))
        if abs(norm - c["norm"]) > 1e-13 * abs(norm):
            fail("clip norm %r: torch %.17g nabla %.17g" % (c["norm_type"], norm, c["norm"]))
        compare(params[0].grad.float(), c["after"][0], torch.float32, "clipped f32 grad")
        compare(params[1].grad, c["after"][1], torch.float64, "clipped f64 grad")
        print("clip_grad_norm_ (norm %s, max %g) agrees: norm %.6g"
              % (c["norm_type"], c["max_norm"], norm))
    print("torch %s: %d of %d parameter values bit-identical" % (torch.__version__, same, total))
    print("ok")


if __name__ == "__main__":
    main()
