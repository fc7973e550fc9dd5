"""train_gpt resumed on another number of processes: 3 ranks, then 2.

A 2000-byte text gives 56 training windows; batch 2 per process on 3
processes is a global batch of 6, so an epoch is 9 steps of 3 x 18 windows
(2 dropped) and --stop-at 4 stops mid-epoch after 24 windows.
--log-samples records every micro-batch's dataset indices per rank.

1. The reference order: an uninterrupted 3-rank run's record gives the
   epoch's list L (rank r's k-th index is L[r + 3k], PyTorch's layout).
2. --keep-batch global on 2 ranks (3 per process): the resumed ranks take
   L[24 + r' + 2j], in order, until the epoch's end: with the 24 taken before,
   exactly the 54 windows of the uninterrupted epoch, none twice; the next
   epoch starts whole. The losses follow the uninterrupted run's (the same
   windows in every step; sums in another order). Stopped at step 7 instead,
   its checkpoint says batch 7 of epoch 0 (42 windows), counted from the
   epoch's start and not from the resume.
3. --keep-batch rank on 2 ranks (2 per process, 4 per step): the epoch's 32
   remaining windows, all of them, none twice; the run ends once --steps x 6
   windows are consumed (step 19), and every step's learning rate is the
   cosine schedule at the windows consumed (warmup and length x 6), written
   out here from docs/optim.md's formula.
4. ZeRO-1: a 3-rank --zero checkpoint resumed on 2 ranks with --zero (the
   state re-split) and without (the consolidated state whole) ends with the
   same checkpoint bit for bit (--clip 0: with two ranks the reduce-scatter
   and the all-reduce add the same two numbers).
5. Refusals: no --keep-batch (the message offers both), a global batch that
   4 processes cannot share, a checkpoint without its position in samples,
   and train_classifier's checkpoints on another world size (it does not
   reshard: its batches per epoch and schedule depend on the world size).
"""
import json
import math
import os
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import assert_same_training_state, fail, read_metrics, read_safetensors, run, sample_records, small_text  # noqa: E402

STEPS = 14


def args(tmp, extra):
    return ["train_gpt", "--text", os.path.join(tmp, "t.txt"), "--layers", "1", "--heads", "2", "--width",
            "16", "--seq-len", "32", "--batch-size", "2", "--warmup", "2", "--lr", "3e-3", "--eval-interval",
            "0", "--eval-windows", "4", "--sample-len", "0", "--progress", "plain", "--log-interval", "1",
            "--metrics-interval", "1", "--clip", "0", "--steps", str(STEPS)] + extra


def epoch_indices(rows, epoch, steps=None):
    return [i for s, e, idx in rows if e == epoch and (steps is None or s in steps) for i in idx]


def val_loss(out):
    for line in out.splitlines():
        if "val loss" in line:
            v = float(line.rsplit("val loss", 1)[1])
    return v


def test_order(tmp):
    ref = os.path.join(tmp, "ref")
    out_ref, _ = run(args(tmp, ["--ckpt-dir", ref, "--log-samples", ref + ".log"]), 3)
    rec = sample_records(ref + ".log", 3)
    per_rank = {r: epoch_indices(rec[r], 0) for r in range(3)}
    if any(len(v) != 18 for v in per_rank.values()):
        fail("the uninterrupted epoch 0: %s windows per rank, expected 18" % [len(v) for v in per_rank.values()])
    L = [per_rank[p % 3][p // 3] for p in range(54)]
    if len(set(L)) != 54:
        fail("the uninterrupted epoch repeats windows: %s" % L)

    stop = os.path.join(tmp, "stop")
    run(args(tmp, ["--ckpt-dir", stop, "--stop-at", "4", "--log-samples", stop + ".log"]), 3)
    first = sample_records(stop + ".log", 3)
    taken = [i for r in range(3) for i in epoch_indices(first[r], 0)]
    if sorted(taken) != sorted(L[:24]):
        fail("the first 4 steps took %s, not L[:24]" % sorted(taken))
    meta = read_safetensors(os.path.join(stop, "ckpt.safetensors"))[1]
    if meta.get("epoch_samples") != "24" or meta.get("samples") != "24" or meta.get("schedule_batch") != "6":
        fail("the checkpoint's position: %s" % {k: meta.get(k) for k in ("epoch_samples", "samples", "schedule_batch")})

    # 2. the global batch kept
    g = os.path.join(tmp, "global")
    os.makedirs(g)
    for f in os.listdir(stop):
        open(os.path.join(g, f), "wb").write(open(os.path.join(stop, f), "rb").read())
    out, _ = run(args(tmp, ["--ckpt-dir", g, "--resume", "--keep-batch", "global", "--log-samples", g + ".log"]), 2)
    want = ("world size 3 -> 2 since the checkpoint, --keep-batch global: the global batch stays 6 sequences, "
            "now 3 per process (was 2)")
    if want not in out or "steps 5..14 of 14 (resumed)" not in out:
        fail("--keep-batch global does not say what it keeps:\n" + out)
    rec = sample_records(g + ".log", 2)
    for r in range(2):
        got = epoch_indices(rec[r], 0)
        exp = [L[24 + r + 2 * j] for j in range(15)]
        if got != exp:
            fail("--keep-batch global, rank %d of 2, epoch 0: %s, expected L[24 + %d + 2j] = %s" % (r, got, r, exp))
        if any(len(idx) != 3 for _, _, idx in rec[r]):
            fail("--keep-batch global: micro-batches of %s, expected 3" % sorted({len(i) for _, _, i in rec[r]}))
    whole = taken + [i for r in range(2) for i in epoch_indices(rec[r], 0)]
    if sorted(whole) != sorted(L):
        fail("--keep-batch global: epoch 0 took %d windows (%d distinct), not the uninterrupted epoch's 54"
             % (len(whole), len(set(whole))))
    starts = [next(s for s, e, _ in rec[r] if e == 1) for r in range(2)]
    if starts != [10, 10]:
        fail("--keep-batch global: epoch 1 starts at steps %s, expected 10 on both ranks" % starts)
    a, b = val_loss(out_ref), val_loss(out)
    if abs(a - b) > 1e-3:
        fail("--keep-batch global: val loss %.5f after 14 steps, the uninterrupted run's %.5f" % (b, a))
    print("--keep-batch global: 3 -> 2 ranks at step 4 takes L[24:54] in PyTorch's layout, the epoch whole and "
          "once; val loss %.5f vs %.5f uninterrupted" % (b, a))

    # the resumed epoch's position, saved mid-epoch: counted from the epoch's start, not from the resume
    m = os.path.join(tmp, "mid")
    os.makedirs(m)
    for f in os.listdir(stop):
        open(os.path.join(m, f), "wb").write(open(os.path.join(stop, f), "rb").read())
    run(args(tmp, ["--ckpt-dir", m, "--resume", "--keep-batch", "global", "--stop-at", "7"]), 2)
    meta = read_safetensors(os.path.join(m, "ckpt.safetensors"))[1]
    # 24 windows before the resume, 3 steps of 6 after it; 6 per step: batch 42 / 6 = 7 of the epoch
    got = {k: meta.get(k) for k in ("epoch", "data_position", "epoch_samples", "samples")}
    if got != {"epoch": "0", "data_position": "7", "epoch_samples": "42", "samples": "42"}:
        fail("--keep-batch global stopped at step 7 saves the position %s, expected epoch 0, batch 7, 42 windows"
             % got)

    # 3. the per-process batch kept, the schedule in samples
    k = os.path.join(tmp, "rank")
    os.makedirs(k)
    for f in os.listdir(stop):
        open(os.path.join(k, f), "wb").write(open(os.path.join(stop, f), "rb").read())
    out, _ = run(args(tmp, ["--ckpt-dir", k, "--resume", "--keep-batch", "rank", "--log-samples", k + ".log",
                            "--metrics", k + "/m.jsonl"]), 2)
    if "steps 5..19 of 19 (resumed)" not in out or "--keep-batch rank: 2 sequences per process, 4 per step " \
            "(was 6); the learning-rate schedule counts sequences (6 per scheduled step)" not in out:
        fail("--keep-batch rank does not say what it keeps:\n" + out)
    rec = sample_records(k + ".log", 2)
    for r in range(2):
        got = epoch_indices(rec[r], 0)
        if len(got) != 16 or got[:15] != [L[24 + r + 2 * j] for j in range(15)]:
            fail("--keep-batch rank, rank %d: epoch 0 %s, expected L[24 + %d + 2j]" % (r, got, r))
    whole = taken + [i for r in range(2) for i in epoch_indices(rec[r], 0)]
    if sorted(whole) != list(range(56)):
        fail("--keep-batch rank: epoch 0 took %d windows (%d distinct) of 56" % (len(whole), len(set(whole))))
    lr, lo, w, total = 3e-3, 3e-4, 2 * 6, STEPS * 6
    checked = 0
    for rec_ in read_metrics(k + "/m.jsonl"):
        if rec_["kind"] != "train" or rec_["step"] <= 4:
            continue
        checked += 1
        s = 24 + 4 * (rec_["step"] - 5)  # windows consumed before the step
        exp = lr * (s + 1) / w if s < w else \
            lo + 0.5 * (lr - lo) * (1 + math.cos(math.pi * min(1.0, (s - w) / (total - w))))
        if abs(rec_["lr"] - exp) > 1e-12:
            fail("--keep-batch rank: step %d's lr %r, the schedule at %d windows gives %r" % (rec_["step"], rec_["lr"], s, exp))
    if checked != 15:
        fail("--keep-batch rank: %d learning rates in the metrics, expected 15 (steps 5..19)" % checked)
    print("--keep-batch rank: 2 per process, the epoch's remaining 32 windows once, 15 more steps to 84 windows, "
          "the learning rate counted in windows")
    return stop


def test_zero(tmp):
    z = os.path.join(tmp, "zero")
    run(args(tmp, ["--zero", "--ckpt-dir", z, "--stop-at", "4"]), 3)
    ends = []
    for name, extra in (("resharded", ["--zero"]), ("consolidated", [])):
        d = os.path.join(tmp, "zero_" + name)
        os.makedirs(d)
        open(os.path.join(d, "ckpt.safetensors"), "wb").write(open(os.path.join(z, "ckpt.safetensors"), "rb").read())
        out, _ = run(args(tmp, extra + ["--ckpt-dir", d, "--resume", "--keep-batch", "global"]), 2)
        if name == "resharded" and "(ZeRO-1)" not in out:
            fail("the resumed --zero run does not shard:\n" + out)
        ends.append(os.path.join(d, "ckpt.safetensors"))
    assert_same_training_state(*ends, "a 3-rank ZeRO-1 checkpoint resumed on 2 ranks: re-split and whole differ")
    print("ZeRO-1: 3 -> 2 ranks, the state re-split ends like the consolidated state, bit for bit")


def write_without(src, dst, drop):
    header, meta, data = read_safetensors(src)
    for k in drop:
        meta.pop(k)
    header["__metadata__"] = meta
    h = json.dumps(header).encode()
    open(dst, "wb").write(struct.pack("<Q", len(h)) + h + data)


def test_refusals(tmp, stop):
    _, err = run(args(tmp, ["--ckpt-dir", stop, "--resume"]), 2, expect_rc=1)
    want = ("was written with world_size 3, this run has 2: to continue on 2 processes, choose what stays fixed: "
            "--keep-batch global (the global batch of 6 sequences, 3 per process) or --keep-batch rank (2 "
            "sequences per process: 4 per step, the learning-rate schedule counted in sequences)")
    if want not in err:
        fail("resuming on 2 without --keep-batch:\n" + err)
    _, err = run(args(tmp, ["--ckpt-dir", stop, "--resume", "--keep-batch", "global"]), 4, expect_rc=1)
    if "--keep-batch global: the global batch of 6 sequences (3 processes x 2 x 1 micro-steps) cannot be shared " \
            "by 4 processes x 1 micro-steps" not in err:
        fail("--keep-batch global on 4:\n" + err)
    old = os.path.join(tmp, "old")
    os.makedirs(old)
    write_without(os.path.join(stop, "ckpt.safetensors"), os.path.join(old, "ckpt.safetensors"),
                  ["epoch_samples", "samples", "schedule_batch", "schedule"])
    _, err = run(args(tmp, ["--ckpt-dir", old, "--resume", "--keep-batch", "rank"]), 2, expect_rc=1)
    if "lacks its data position in samples (\"epoch_samples\"" not in err or "it resumes only on 3 processes" not in err:
        fail("a checkpoint without epoch_samples on 2 ranks:\n" + err)
    out, _ = run(args(tmp, ["--ckpt-dir", old, "--resume", "--stop-at", "5"]), 3)  # still fine at its own size
    if "steps 5..5 of 14 (resumed)" not in out:
        fail("a checkpoint without epoch_samples on its own 3 ranks:\n" + out)
    tc = os.path.join(tmp, "classifier")
    run(["train_classifier", "--epochs", "2", "--stop-at", "1", "--ckpt-dir", tc, "--progress", "off"])
    _, err = run(["train_classifier", "--epochs", "2", "--ckpt-dir", tc, "--resume", "--progress", "off"], 2,
                 expect_rc=1)
    if "ckpt.safetensors was written with world_size 1, this run has 2: train_classifier resumes only on the " \
            "number of processes of its checkpoint" not in err:
        fail("train_classifier from 1 process to 2:\n" + err)
    print("refusals: no --keep-batch, a global batch 4 cannot share, an older checkpoint on another world size, "
          "train_classifier on another world size")


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_resize_") as tmp:
        small_text(tmp)
        stop = test_order(tmp)
        test_zero(tmp)
        test_refusals(tmp, stop)
    print("ok")


if __name__ == "__main__":
    main()
