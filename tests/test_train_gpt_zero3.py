"""train_gpt and train_classifier --zero 3 (ZeRO-3 / FSDP: parameters, gradients and optimizer state sharded) end to end.

1. On one, two and three processes, 20 steps (dropout, gradient accumulation,
   clipping on): --zero 3 and the plain run log the same losses, relative
   difference at most 1e-5 (the reduce-scatter adds the ranks in another
   order than the all-reduce, and a recomputed block is bitwise the first).
   The banner says ZeRO-3.
2. On four processes, state_bytes= of --zero 3 is at most 0.3x the plain
   run's (1/4 of the parameters, gradients and AdamW's moments, plus each
   unit's padding).
3. train_classifier --zero 3 (MLP, Adam) on two processes: the plain run's
   test loss within 1e-5 relative after 2 epochs, and less state.
4. --zero 3 with --ckpt-dir is refused (exit 2), saying why.
"""
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import fail, logged_losses, run, state_bytes  # noqa: E402

SMALL = ["--layers", "2", "--heads", "2", "--width", "32", "--seq-len", "32", "--batch-size", "4",
         "--dropout", "0.1", "--grad-accum", "2", "--warmup", "4", "--eval-interval", "8",
         "--eval-windows", "16", "--metrics-interval", "2", "--sample-len", "0", "--progress", "plain",
         "--clip", "0.5"]


def train(tmp, name, extra, nproc, steps=20):
    d = os.path.join(tmp, name)
    os.makedirs(d, exist_ok=True)
    out, _ = run(["train_gpt"] + SMALL + ["--steps", str(steps), "--metrics", d + "/m.jsonl"] + extra, nproc)
    return d, out


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_train_gpt_zero3_") as tmp:
        for nproc in (1, 2, 3):
            a, _ = train(tmp, "plain_%d" % nproc, [], nproc)
            b, out = train(tmp, "zero3_%d" % nproc, ["--zero", "3"], nproc)
            if "(ZeRO-3)" not in out:
                fail("--zero 3: the banner does not say ZeRO-3:\n" + out)
            la, lb = logged_losses(a + "/m.jsonl"), logged_losses(b + "/m.jsonl")
            if len(la) < 10 or [s for s, _ in la] != [s for s, _ in lb]:
                fail("%d processes: the metrics logs differ in their records: %s vs %s" % (nproc, la, lb))
            for (s, x), (_, y) in zip(la, lb):
                if abs(x - y) > 1e-5 * abs(x):
                    fail("%d processes, step %d: loss %.8g (plain) vs %.8g (--zero 3)" % (nproc, s, x, y))
            print("--zero 3 on %d process%s: the plain run's losses (%d records, last %.8g vs %.8g)"
                  % (nproc, "es" if nproc > 1 else "", len(la), la[-1][1], lb[-1][1]))

        _, out_p = train(tmp, "bytes_plain", [], 4, 2)
        _, out_3 = train(tmp, "bytes_zero3", ["--zero", "3"], 4, 2)
        sp, s3 = state_bytes(out_p), state_bytes(out_3)
        if not s3 <= 0.3 * sp:
            fail("4 processes: --zero 3 state_bytes=%d, more than 0.3 x the plain run's %d" % (s3, sp))
        print("state_bytes per process at 4 processes: plain %d, --zero 3 %d (%.3fx)" % (sp, s3, s3 / sp))

        res = []
        for name, extra in (("plain", []), ("zero3", ["--zero", "3"])):
            out, _ = run(["train_classifier", "--model", "mlp", "--epochs", "2", "--progress", "plain",
                          "--optim", "adam"] + extra, 2)
            m = re.search(r"test loss ([0-9.]+); state_bytes=(\d+)", out)
            if not m:
                fail("train_classifier %s: no test loss line:\n%s" % (name, out))
            res.append((float(m.group(1)), int(m.group(2)), out))
        (lp, bp, _), (l3, b3, out3) = res
        if "(ZeRO-3)" not in out3:
            fail("train_classifier --zero 3: the banner does not say ZeRO-3:\n" + out3)
        if abs(lp - l3) > 1e-5 * lp or not b3 < bp:
            fail("train_classifier: test loss %.6g plain, %.6g --zero 3; state_bytes %d, %d" % (lp, l3, bp, b3))
        print("train_classifier --zero 3 on 2 processes: test loss %.6g (plain %.6g), state_bytes %d (plain %d)"
              % (l3, lp, b3, bp))

        _, err = run(["train_gpt", "--zero", "3", "--ckpt-dir", os.path.join(tmp, "c")], 1, expect_rc=2)
        if "--zero 3 writes and reads no checkpoints yet" not in err:
            fail("--zero 3 --ckpt-dir: the refusal does not say why:\n" + err)
    print("ok")


if __name__ == "__main__":
    main()
