"""train_gpt --bf16 and train_classifier --bf16, briefly, on whatever device
the build computes on (the CPU in CI: Note [Compute dtype] in
tensor/context.c).

1. train_gpt: a small GPT for 30 steps with --bf16 says so in its banner,
   learns (the held-out loss falls from near ln V), and ends within 3% of
   the same run in f32 (same seed and data).
2. train_classifier: the CNN on the digits (convolutions and the linear
   head in bf16) for 2 epochs says bf16 in its banner and reaches at least
   90% test accuracy; the MLP on the breast-cancer table for 2 epochs too.
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import fail, run, run_in_scratch  # noqa: E402

GPT = ["train_gpt", "--layers", "2", "--heads", "2", "--width", "32", "--seq-len", "32",
       "--batch-size", "4", "--steps", "30", "--warmup", "4", "--eval-interval", "10",
       "--progress", "plain", "--sample-len", "0"]


def val_losses(out):
    return [float(v) for v in re.findall(r"val loss ([0-9.]+)", out)]


def test_gpt(tmp):
    out32, _ = run(GPT + ["--ckpt-dir", os.path.join(tmp, "f32")])
    out16, _ = run(GPT + ["--bf16", "--ckpt-dir", os.path.join(tmp, "bf16")])
    if "bf16 matrix products" not in out16 or "bf16" in out32.split("\n")[0]:
        fail("train_gpt's banner does not tell --bf16 apart:\n" + out16[:500] + "\n" + out32[:500])
    l32, l16 = val_losses(out32), val_losses(out16)
    if len(l16) != 3 or len(l32) != 3:
        fail("expected 3 evaluations each, got f32 %s, bf16 %s:\n%s" % (l32, l16, out16))
    if not l16[-1] < l16[0] - 0.2:
        fail("train_gpt --bf16 did not learn: held-out losses %s" % l16)
    if abs(l16[-1] - l32[-1]) > 0.03 * l32[-1]:
        fail("train_gpt --bf16 ends at held-out loss %.4f, f32 at %.4f (more than 3%% apart)"
             % (l16[-1], l32[-1]))
    print("train_gpt --bf16: held-out loss %s (f32: %s)" % (l16, l32))


def test_classifier(tmp):
    for model, least in (("cnn", 90.0), ("mlp", 90.0)):
        out, _ = run(["train_classifier", "--model", model, "--epochs", "2", "--progress", "plain",
                      "--bf16", "--ckpt-dir", os.path.join(tmp, model)])
        if ", bf16" not in out.split("\n")[0]:
            fail("train_classifier --bf16: the banner does not say bf16:\n" + out[:500])
        m = re.search(r"test accuracy ([0-9.]+)%", out)
        if not m or float(m.group(1)) < least:
            fail("train_classifier --model %s --bf16: test accuracy below %.0f%%:\n%s"
                 % (model, least, out[-1500:]))
        print("train_classifier --model %s --bf16: test accuracy %s%%" % (model, m.group(1)))


def main():
    run_in_scratch("bf16_programs", test_gpt, test_classifier)


if __name__ == "__main__":
    main()
