"""Divergence stops the training programs (examples/common/divergence.h).

A run resumed from a good checkpoint with a learning rate that blows the
parameters up (1e39: Adam's first update is past f32's range) must
1. stop after --max-skipped-steps consecutive skipped steps (default 10),
   naming the steps and the first parameter whose gradient is not finite,
   with exit status 1, on one process and on two under nbrun;
2. never write its checkpoint over the good one: with --max-skipped-steps 0
   (no limit) the save at the next checkpoint is refused naming the tensor,
   and the file keeps its bytes.
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import fail, run, run_in_scratch  # noqa: E402


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def expect(err, *parts):
    for p in parts:
        if p not in err:
            fail("the output lacks %r:\n%s" % (p, err[-3000:]))


def test_classifier(tmp):
    d = os.path.join(tmp, "cls")
    base = ["train_classifier", "--optim", "adam", "--epochs", "3", "--progress", "off", "--ckpt-dir", d]
    run(base + ["--stop-at", "1"])
    ckpt = os.path.join(d, "ckpt.safetensors")
    good = digest(ckpt)
    # 56 steps per epoch: epoch 2 starts at step 57, whose update overflows;
    # from step 58 on the gradients are NaN
    _, err = run(base + ["--resume", "--lr", "1e39"], expect_rc=1)
    expect(err, "train_classifier (rank 0): stopping: the run diverged: 10 consecutive steps skipped "
           "(steps 58 to 67)", "the first parameter whose gradient is not finite: 0.weight",
           "--max-skipped-steps")
    _, err = run(base + ["--resume", "--lr", "1e39", "--max-skipped-steps", "3"], expect_rc=1)
    expect(err, "3 consecutive steps skipped (steps 58 to 60)")
    if digest(ckpt) != good:
        fail("the checkpoint changed during a run that stopped")
    _, err = run(base + ["--resume", "--lr", "1e39", "--max-skipped-steps", "0"], expect_rc=1)
    expect(err, 'train_classifier (rank 0): checkpoint: epoch 2 not saved: "0.weight" holds a NaN or '
           "an infinity (the run diverged); the checkpoint on disk is left as it was")
    if digest(ckpt) != good:
        fail("a diverged run wrote its checkpoint over the good one")
    # two processes: the gradients are all-reduced, every rank stops at the same step
    d2 = os.path.join(tmp, "cls2")
    base2 = base[:-1] + [d2]
    run(base2 + ["--stop-at", "1"], nproc=2)
    good2 = digest(os.path.join(d2, "ckpt.safetensors"))
    out, err = run(base2 + ["--resume", "--lr", "1e39", "--max-skipped-steps", "2"], nproc=2, expect_rc=1)
    expect(out + err, "stopping: the run diverged: 2 consecutive steps skipped")
    if digest(os.path.join(d2, "ckpt.safetensors")) != good2:
        fail("2 processes: the checkpoint changed during a run that stopped")
    _, err = run(["train_classifier", "--max-skipped-steps", "-1"], expect_rc=2)
    expect(err, "--max-skipped-steps must be >= 0")
    print("train_classifier: stops after the skipped steps, keeps the good checkpoint (1 and 2 processes)")


def test_gpt(tmp):
    d = os.path.join(tmp, "gpt")
    base = ["train_gpt", "--synthetic", "--vocab-size", "64", "--layers", "1", "--heads", "2",
            "--width", "16", "--seq-len", "16", "--batch-size", "4", "--steps", "20", "--warmup", "0",
            "--eval-interval", "0", "--eval-windows", "4", "--sample-len", "0", "--progress", "off",
            "--ckpt-dir", d]
    run(base + ["--stop-at", "5"])
    ckpt = os.path.join(d, "ckpt.safetensors")
    good = digest(ckpt)
    _, err = run(base + ["--resume", "--lr", "1e39"], expect_rc=1)
    expect(err, "train_gpt (rank 0): stopping: the run diverged: 10 consecutive steps skipped (steps 7 "
           "to 16)", "the first parameter whose gradient is not finite: transformer.wte.weight")
    _, err = run(base + ["--resume", "--lr", "1e39", "--max-skipped-steps", "0", "--ckpt-interval", "1"],
                 expect_rc=1)
    expect(err, 'train_gpt (rank 0): checkpoint: step 6 not saved: "transformer.wte.weight" holds a '
           "NaN or an infinity")
    if digest(ckpt) != good:
        fail("train_gpt: a diverged run wrote its checkpoint over the good one")
    print("train_gpt: stops after the skipped steps, keeps the good checkpoint")


def main():
    run_in_scratch("divergence", test_classifier, test_gpt)


if __name__ == "__main__":
    main()
