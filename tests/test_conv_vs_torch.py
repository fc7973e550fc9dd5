"""nabla's grouped and depthwise nb_conv2d against PyTorch's.

Runs build/bin/nb_conv_trace, which prints fixed inputs and nabla's
forward output and input, weight and bias gradients (of sum(y * gy)) for
ungrouped, grouped, depthwise and depthwise-with-multiplier convolutions
with stride, padding and dilation, and replays each case with
torch.nn.functional.conv2d and autograd. float64 must agree to ~1e-12,
float32 to ~1e-5 relative (summation orders differ). Skipped (exit 77) when
torch does not import; a failure under CI=true.
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import compare_with_torch, driver, fail, import_torch  # noqa: E402

torch = import_torch()


def compare(got, want, dtype, what):
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    compare_with_torch(torch, got, want, dtype, tol, tol, what)


def main():
    torch.set_num_threads(1)
    out = subprocess.run([driver("nb_conv_trace")], stdout=subprocess.PIPE,
                         check=True).stdout
    cases = json.loads(out.decode())["cases"]
    if len(cases) < 12:
        fail("nb_conv_trace printed %d cases, expected 12" % len(cases))
    for k, c in enumerate(cases):
        dtype = getattr(torch, c["dtype"])
        x = torch.tensor(c["x"], dtype=dtype).reshape(c["x_shape"]).requires_grad_()
        w = torch.tensor(c["w"], dtype=dtype).reshape(c["w_shape"]).requires_grad_()
        b = torch.tensor(c["b"], dtype=dtype).requires_grad_() if c["bias"] else None
        y = torch.nn.functional.conv2d(x, w, b, stride=c["stride"], padding=c["padding"],
                                       dilation=c["dilation"], groups=c["groups"])
        gy = torch.tensor(c["gy"], dtype=dtype).reshape(y.shape)
        (y * gy).sum().backward()
        what = "case %d (%s, groups %d, x %s, w %s)" % (k, c["dtype"], c["groups"], c["x_shape"],
                                                        c["w_shape"])
        compare(y.detach(), c["y"], dtype, what + " output")
        compare(x.grad, c["dx"], dtype, what + " input gradient")
        compare(w.grad, c["dw"], dtype, what + " weight gradient")
        if b is not None:
            compare(b.grad, c["db"], dtype, what + " bias gradient")
        print("%s agrees with torch.nn.functional.conv2d" % what)
    print("ok")


if __name__ == "__main__":
    main()
