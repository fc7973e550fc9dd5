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
4. A --zero 3 checkpoint (consolidated on rank 0) written at 3 processes
   and stopped mid-epoch resumes at 2 with --zero 3 (--keep-batch global):
   the resumed ranks take the rest of the uninterrupted epoch's windows in
   its order, with the 24 taken before exactly the epoch, none twice, and
   the validation loss follows the uninterrupted 3-process run's
   (tests/test_resize.py's setting and helpers).
"""
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import fail, run, same_losses, sample_records as records, state_bytes, small_text  # noqa: E402
from test_resize import args as resize_args, epoch_indices, val_loss  # noqa: E402

SMALL = ["--layers", "2", "--heads", "2", "--width", "32", "--seq-len", "32", "--batch-size", "4",
         "--dropout", "0.1", "--grad-accum", "2", "--warmup", "4", "--eval-interval", "8",
         "--eval-windows", "16", "--metrics-interval", "2", "--sample-len", "0", "--progress", "plain",
         "--clip", "0.5"]


def train(tmp, name, extra, nproc, steps=20):
    d = os.path.join(tmp, name)
    os.makedirs(d, exist_ok=True)
    out, _ = run(["train_gpt"] + SMALL + ["--steps", str(steps), "--metrics", d + "/m.jsonl"] + extra, nproc)
    return d, out


def test_resize(tmp):
    small_text(tmp)
    ref = os.path.join(tmp, "z3ref")
    out_ref, _ = run(resize_args(tmp, ["--zero", "3", "--ckpt-dir", ref, "--log-samples", ref + ".log"]), 3)
    rec = records(ref + ".log", 3)
    L = [epoch_indices(rec[p % 3], 0)[p // 3] for p in range(54)]
    stop = os.path.join(tmp, "z3stop")
    run(resize_args(tmp, ["--zero", "3", "--ckpt-dir", stop, "--stop-at", "4", "--log-samples", stop + ".log"]), 3)
    first = records(stop + ".log", 3)
    taken = [i for r in range(3) for i in epoch_indices(first[r], 0)]
    out, _ = run(resize_args(tmp, ["--zero", "3", "--ckpt-dir", stop, "--resume", "--keep-batch", "global",
                                   "--log-samples", stop + ".2.log"]), 2)
    if "(ZeRO-3)" not in out or "steps 5..14 of 14 (resumed)" not in out:
        fail("the resumed --zero 3 run:\n" + out)
    rec = records(stop + ".2.log", 2)
    for r in range(2):
        got, exp = epoch_indices(rec[r], 0), [L[24 + r + 2 * j] for j in range(15)]
        if got != exp:
            fail("--zero 3 resumed on 2, rank %d, epoch 0: %s, expected %s" % (r, got, exp))
    whole = taken + [i for r in range(2) for i in epoch_indices(rec[r], 0)]
    if sorted(whole) != sorted(L):
        fail("--zero 3, 3 -> 2 ranks: epoch 0 took %d windows (%d distinct), not the epoch's 54"
             % (len(whole), len(set(whole))))
    a, b = val_loss(out_ref), val_loss(out)
    if abs(a - b) > 1e-3:
        fail("--zero 3, 3 -> 2 ranks: val loss %.5f after 14 steps, the uninterrupted run's %.5f" % (b, a))
    print("--zero 3 checkpoint of 3 ranks resumed on 2: the epoch's remaining windows once each; val loss %.5f "
          "vs %.5f uninterrupted" % (b, a))


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_train_gpt_zero3_") as tmp:
        for nproc in (1, 2, 3):
            a, _ = train(tmp, "plain_%d" % nproc, [], nproc)
            b, out = train(tmp, "zero3_%d" % nproc, ["--zero", "3"], nproc)
            if "(ZeRO-3)" not in out:
                fail("--zero 3: the banner does not say ZeRO-3:\n" + out)
            la, lb = same_losses(a + "/m.jsonl", b + "/m.jsonl", "--zero 3", 10, "%d processes" % nproc)
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

        test_resize(tmp)
    print("ok")


if __name__ == "__main__":
    main()
