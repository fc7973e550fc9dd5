"""train_gpt --zero --ckpt-sharded: sharded checkpoints that resume at another world size.

A 2000-byte text gives 56 training windows; batch 2 per process, --stop-at 4
(test_resize.py has the arithmetic). --log-samples records every
micro-batch's dataset indices per rank.

1. 3 ranks write a sharded checkpoint at step 4: an index (ckpt.safetensors,
   no tensors) and a folder with one shard per rank; `nb_ckpt consolidate`
   turns it into the checkpoint the same run writes without --ckpt-sharded,
   tensors and metadata bit for bit.
2. 3 -> 2 (--keep-batch global): the resumed ranks take the uninterrupted
   epoch's remaining 30 windows in PyTorch's layout, each once (with the 24
   before: the whole epoch); the run ends with the state (consolidated) that
   the single-file checkpoint resumed the same way ends with, bit for bit, and
   the uninterrupted run's val loss to 1e-3.
3. 2 -> 3 (--keep-batch rank): no window of the epoch twice; the 40 left
   after step 4 are all taken but the 40 % 6 = 4 short of a global batch at
   the epoch's end (dropped as every epoch's tail is); the end state is the
   single-file path's, bit for bit.
4. ZeRO-3 (--zero 3, parameters sharded too): a checkpoint sharded at 3
   ranks consolidates into the single file, resumes at 2 with the epoch's
   remaining 30 windows each once, and ends as the single file resumed.
5. Kept checkpoints and --resume auto treat index and shards as one unit:
   --keep-checkpoints 2 leaves two indexes and their two shard folders; a
   truncated shard of the newest makes --resume auto pass over it, naming
   the shard, and take the older; with a shard of that one gone too it
   refuses to start, naming both.
"""
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import assert_same_training_state, fail, read_safetensors, run, sample_records, small_text  # noqa: E402
import test_resize  # noqa: E402  (its small train_gpt command line)


def args(tmp, extra):
    return test_resize.args(tmp, ["--zero"] + extra)


def epoch0(rec):
    return [i for rows in rec.values() for _, e, idx in rows if e == 0 for i in idx]


def shard_dirs(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".shards"))


def consolidated(tmp, d, name):
    out = os.path.join(tmp, name + ".safetensors")
    run(["nb_ckpt", "consolidate", os.path.join(d, "ckpt.safetensors"), out])
    return out


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_3_to_2(tmp):
    ref = os.path.join(tmp, "ref")
    out_ref, _ = run(args(tmp, ["--ckpt-dir", ref, "--log-samples", ref + ".log"]), 3)
    rec = sample_records(ref + ".log", 3)
    per_rank = {r: [i for _, e, idx in rec[r] if e == 0 for i in idx] for r in range(3)}
    L = [per_rank[p % 3][p // 3] for p in range(54)]

    sh = os.path.join(tmp, "sh3")
    run(args(tmp, ["--ckpt-sharded", "--ckpt-dir", sh, "--stop-at", "4", "--log-samples", sh + ".log"]), 3)
    one = os.path.join(tmp, "one3")
    run(args(tmp, ["--ckpt-dir", one, "--stop-at", "4"]), 3)
    header, meta, data = read_safetensors(os.path.join(sh, "ckpt.safetensors"))
    dirs = shard_dirs(sh)
    if header or data or len(dirs) != 1 or meta.get("shard_dir") != dirs[0] or meta.get("epoch_samples") != "24":
        fail("the sharded checkpoint's index: %d tensors, folders %s, metadata %s" % (len(header), dirs, meta))
    shards = sorted(os.listdir(os.path.join(sh, dirs[0])))
    if shards != ["rank%d-of-3.safetensors" % r for r in range(3)]:
        fail("the shards of 3 ranks: %s" % shards)
    out, _ = run(["nb_ckpt", "check", os.path.join(sh, "ckpt.safetensors")])
    if "sharded over 3 files" not in out or "every tensor reads" not in out:
        fail("nb_ckpt check: " + out)
    assert_same_training_state(os.path.join(one, "ckpt.safetensors"), consolidated(tmp, sh, "c3"),
                               "the consolidated sharded checkpoint is not the single file")
    print("3 ranks: index + 3 shards; consolidated, the single-file checkpoint bit for bit")

    g = copy(sh, os.path.join(tmp, "sh3to2"))
    out, _ = run(args(tmp, ["--ckpt-sharded", "--ckpt-dir", g, "--resume", "--keep-batch", "global",
                            "--log-samples", g + ".log"]), 2)
    if "steps 5..14 of 14 (resumed)" not in out or "(ZeRO-1)" not in out:
        fail("the 2-rank resume of the sharded checkpoint:\n" + out)
    after = sample_records(g + ".log", 2)
    for r in range(2):
        got = [i for _, e, idx in after[r] if e == 0 for i in idx]
        exp = [L[24 + r + 2 * j] for j in range(15)]
        if got != exp:
            fail("3 -> 2, rank %d, epoch 0: %s, expected L[24 + %d + 2j] = %s" % (r, got, r, exp))
    whole = epoch0(sample_records(sh + ".log", 3)) + epoch0(after)
    if sorted(whole) != sorted(L) or len(set(whole)) != 54:
        fail("3 -> 2: epoch 0 took %d windows (%d distinct), not the uninterrupted epoch's 54 once"
             % (len(whole), len(set(whole))))
    o = copy(one, os.path.join(tmp, "one3to2"))
    run(args(tmp, ["--ckpt-dir", o, "--resume", "--keep-batch", "global"]), 2)
    assert_same_training_state(os.path.join(o, "ckpt.safetensors"), consolidated(tmp, g, "c3to2"),
                               "3 -> 2: the sharded resume ends unlike the single-file resume")
    a, b = test_resize.val_loss(out_ref), test_resize.val_loss(out)
    if abs(a - b) > 1e-3:
        fail("3 -> 2: val loss %.5f after 14 steps, the uninterrupted run's %.5f" % (b, a))
    print("3 -> 2: the epoch's remaining 30 windows once; the single-file resume's state bit for bit; val loss "
          "%.5f vs %.5f uninterrupted" % (b, a))
    return L


def test_zero3(tmp, L):
    z = os.path.join(tmp, "z3")
    run(args(tmp, ["3", "--ckpt-sharded", "--ckpt-dir", z, "--stop-at", "4", "--log-samples", z + ".log"]), 3)
    one = os.path.join(tmp, "z3one")
    run(args(tmp, ["3", "--ckpt-dir", one, "--stop-at", "4"]), 3)
    if len(shard_dirs(z)) != 1 or len(os.listdir(os.path.join(z, shard_dirs(z)[0]))) != 3:
        fail("--zero 3 --ckpt-sharded at 3 ranks: %s" % os.listdir(z))
    assert_same_training_state(os.path.join(one, "ckpt.safetensors"), consolidated(tmp, z, "z3c"),
                               "--zero 3: the consolidated sharded checkpoint is not the single file")
    g = copy(z, os.path.join(tmp, "z3to2"))
    out, _ = run(args(tmp, ["3", "--ckpt-sharded", "--ckpt-dir", g, "--resume", "--keep-batch", "global",
                            "--log-samples", g + ".log"]), 2)
    if "steps 5..14 of 14 (resumed)" not in out or "ZeRO-3" not in out:
        fail("--zero 3: the 2-rank resume of the sharded checkpoint:\n" + out)
    after = sample_records(g + ".log", 2)
    for r in range(2):
        got = [i for _, e, idx in after[r] if e == 0 for i in idx]
        if got != [L[24 + r + 2 * j] for j in range(15)]:
            fail("--zero 3, 3 -> 2, rank %d, epoch 0: %s, expected L[24 + %d + 2j]" % (r, got, r))
    whole = epoch0(sample_records(z + ".log", 3)) + epoch0(after)
    if sorted(whole) != sorted(L) or len(set(whole)) != 54:
        fail("--zero 3, 3 -> 2: epoch 0 took %d windows (%d distinct), not the epoch's 54 once"
             % (len(whole), len(set(whole))))
    o = copy(one, os.path.join(tmp, "z3oneto2"))
    run(args(tmp, ["3", "--ckpt-dir", o, "--resume", "--keep-batch", "global"]), 2)
    assert_same_training_state(os.path.join(o, "ckpt.safetensors"), consolidated(tmp, g, "z3to2c"),
                               "--zero 3, 3 -> 2: the sharded resume ends unlike the single-file resume")
    print("--zero 3: a checkpoint sharded at 3 ranks (consolidated: the single file) resumes at 2, the epoch's "
          "remaining 30 windows once, the single-file resume's state bit for bit")


def test_2_to_3(tmp):
    sh = os.path.join(tmp, "sh2")
    run(args(tmp, ["--ckpt-sharded", "--ckpt-dir", sh, "--stop-at", "4", "--log-samples", sh + ".log"]), 2)
    one = os.path.join(tmp, "one2")
    run(args(tmp, ["--ckpt-dir", one, "--stop-at", "4"]), 2)
    before = epoch0(sample_records(sh + ".log", 2))
    g = copy(sh, os.path.join(tmp, "sh2to3"))
    run(args(tmp, ["--ckpt-sharded", "--ckpt-dir", g, "--resume", "--keep-batch", "rank",
                   "--log-samples", g + ".log"]), 3)
    after = epoch0(sample_records(g + ".log", 3))
    whole = before + after
    if len(before) != 16 or len(whole) != len(set(whole)) or len(after) != 36 or len(set(range(56)) - set(whole)) != 4:
        fail("2 -> 3: %d windows before, %d after, %d distinct of 56 (expected 16 + 36, none twice, the 4 short "
             "of a global batch of 6 left)" % (len(before), len(after), len(set(whole))))
    o = copy(one, os.path.join(tmp, "one2to3"))
    run(args(tmp, ["--ckpt-dir", o, "--resume", "--keep-batch", "rank"]), 3)
    assert_same_training_state(os.path.join(o, "ckpt.safetensors"), consolidated(tmp, g, "c2to3"),
                               "2 -> 3: the sharded resume ends unlike the single-file resume")
    print("2 -> 3: 16 + 36 windows of epoch 0, none twice; the single-file resume's state bit for bit")


def test_kept_and_auto(tmp):
    d = os.path.join(tmp, "kept")
    run(args(tmp, ["--ckpt-sharded", "--ckpt-dir", d, "--ckpt-interval", "2", "--stop-at", "6",
                   "--keep-checkpoints", "2"]), 3)
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    dirs = shard_dirs(d)
    if files != ["ckpt.safetensors", "ckpt.step000000004.safetensors"] or len(dirs) != 2 or \
            not dirs[0].startswith("ckpt.step000000004-") or not dirs[1].startswith("ckpt.step000000006-"):
        fail("--keep-checkpoints 2 leaves %s and %s" % (files, dirs))
    newest = os.path.join(d, dirs[1], "rank1-of-3.safetensors")
    raw = open(newest, "rb").read()
    open(newest, "wb").write(raw[:-64])
    out, err = run(args(tmp, ["--ckpt-sharded", "--ckpt-dir", d, "--resume", "auto", "--keep-batch", "global",
                              "--stop-at", "7"]), 2)
    said = "--resume auto passes over %s: %s: %d bytes, but the index" % (os.path.join(d, "ckpt.safetensors"), newest,
                                                                           len(raw) - 64)
    if said not in out + err or "steps 5..7 of 14 (resumed)" not in out:
        fail("--resume auto with a truncated shard of the newest checkpoint:\n" + out + err)
    print("--resume auto passes over the newest checkpoint, naming its truncated shard, and takes step 4")

    d2 = os.path.join(tmp, "none")
    run(args(tmp, ["--ckpt-sharded", "--ckpt-dir", d2, "--ckpt-interval", "2", "--stop-at", "4",
                   "--keep-checkpoints", "2"]), 3)
    for s in shard_dirs(d2):
        os.unlink(os.path.join(d2, s, "rank0-of-3.safetensors"))
    out, err = run(args(tmp, ["--ckpt-sharded", "--ckpt-dir", d2, "--resume", "auto"]), 2, expect_rc=1)
    if "none can be resumed from" not in out + err or (out + err).count("the shard of rank 0 of 3 is missing") < 2:
        fail("--resume auto with a shard of every checkpoint gone:\n" + out + err)
    print("--resume auto refuses when every checkpoint lacks a shard, naming each")


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_train_gpt_shard_") as tmp:
        small_text(tmp)
        L = test_3_to_2(tmp)
        test_2_to_3(tmp)
        test_zero3(tmp, L)
        test_kept_and_auto(tmp)
    print("ok")


if __name__ == "__main__":
    main()
