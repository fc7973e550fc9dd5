"""docs/tutorial.md and the program it builds, examples/tutorial_ddp.c.

1. The program trains on one process and on two under nbrun (DDP over
   Gloo), evaluates every test row exactly once, and ends with a plausible
   accuracy; a checkpoint written by rank 0 resumes on both ranks, and one
   written by a run of another world size is refused with a message. With
   --cnn it learns the 8x8 digits with SyncBatchNorm on two processes. A
   table it cannot read is an error that says what --data is. Checkpoint
   folders are made with their parents; one that cannot be made stops both
   programs before they train.
2. The second program, examples/tutorial_zero.c (ZeRO-1, clipping, a
   warm-up and cosine schedule, consolidated checkpoints): on two processes
   a run stopped at step 70 and resumed ends with the same checkpoint, byte
   for byte, as a run of 120 steps; each rank holds half the optimizer
   state of one process; a checkpoint of two processes is refused on one.
   With --zero3 (ZeRO-3) it ends with ZeRO-1's test loss within 1e-5,
   each of two ranks holding half of the parameters, gradients and moments.
   Both follow --resume auto's rule (Note [Resume auto],
   nb_checkpoint_find_latest): a truncated newest checkpoint is passed
   over, named, for an older one that loads; with every file damaged the
   program exits non-zero naming each, and auto-or-fresh starts afresh.
3. The code blocks of docs/tutorial.md tagged "c tutorial_ddp.c" (and
   "c tutorial_zero.c"), put together in the file's order, are the program
   word for word (each block once, nothing of the file left out but blank
   lines between blocks), so the tutorial is the whole program and cannot
   drift from it.
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import BIN, SOURCE, fail, run, skip  # noqa: E402

DATA = os.path.join(SOURCE, "examples", "datasets")
LINE = re.compile(r"epoch (\d+): train loss ([0-9.]+) \| test loss ([0-9.]+), "
                  r"accuracy ([0-9.]+)% \((\d+) rows\)")


def epochs(out, test_rows=114):
    found = [(int(m.group(1)), float(m.group(2)), float(m.group(4)), int(m.group(5)))
             for m in LINE.finditer(out)]
    if not found:
        fail("no epoch lines in the output:\n" + out)
    for e, _, _, rows in found:
        if rows != test_rows:
            fail("epoch %d evaluated %d test rows, expected each of the %d once:\n%s"
                 % (e, rows, test_rows, out))
    return found


def test_program(tmp):
    table = ["--data", os.path.join(DATA, "breast_cancer.csv")]
    for nproc in (1, 2):
        ck = os.path.join(tmp, "ck%d" % nproc, "runs")  # two folders that do not exist yet
        out, _ = run(["tutorial_ddp", "--epochs", "3", "--ckpt-dir", ck] + table, nproc, timeout=60)
        want = "%d process%s (gloo backend" % (nproc, "es" if nproc > 1 else "")
        if want not in out:
            fail("the output lacks %r:\n%s" % (want, out))
        got = epochs(out)
        if [e for e, _, _, _ in got] != [1, 2, 3]:
            fail("epochs %s, expected 1, 2, 3:\n%s" % ([e for e, _, _, _ in got], out))
        if not got[-1][1] < got[0][1] or got[-1][1] > 0.3 or got[-1][2] < 90.0:
            fail("%d process(es): train loss %.4f -> %.4f, accuracy %.2f%%: not learning"
                 % (nproc, got[0][1], got[-1][1], got[-1][2]))
        if not os.path.exists(os.path.join(ck, "ckpt.safetensors")):
            fail("no checkpoint in " + ck)
        out, _ = run(["tutorial_ddp", "--epochs", "4", "--ckpt-dir", ck, "--resume"] + table, nproc, timeout=60)
        if "resumed from %s/ckpt.safetensors at epoch 3" % ck not in out:
            fail("resume on %d process(es):\n%s" % (nproc, out))
        if [e for e, _, _, _ in epochs(out)] != [4]:
            fail("the resumed run should train epoch 4 only:\n" + out)
        print("%d process(es): train loss %.4f -> %.4f, test accuracy %.2f%%, resumed at epoch 3"
              % (nproc, got[0][1], got[-1][1], got[-1][2]))
    _, err = run(["tutorial_ddp", "--epochs", "5", "--ckpt-dir", os.path.join(tmp, "ck1", "runs"), "--resume"]
                 + table, 2, expect_rc=1, timeout=60)
    if "was written by a run of 1 processes, this run has 2" not in err:
        fail("a world-size change was not refused with the message:\n" + err)
    print("a checkpoint of 1 process is refused on 2")


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_resume_auto(tmp, program, args, done):
    """--resume auto: a truncated newest file is passed over for the kept older one; all damaged: refused."""
    ck = os.path.join(tmp, "auto-" + program)
    first = run([program, "--ckpt-dir", ck, "--resume", "auto"] + args[0], 2, timeout=90)[0]
    if "resumed from" in first:
        fail("%s --resume auto with no checkpoint should start afresh:\n%s" % (program, first))
    run([program, "--ckpt-dir", ck, "--resume", "auto"] + args[1], 2, timeout=90)
    kept = [f for f in sorted(os.listdir(ck)) if re.fullmatch(r"ckpt\.step\d+\.safetensors", f)]
    if len(kept) != 1:  # the second run replaced the first run's file once
        fail("%s kept %s of the file its save replaced, where one was due: %s" % (program, kept, os.listdir(ck)))
    older = os.path.join(ck, kept[0])
    newest = os.path.join(ck, "ckpt.safetensors")
    truncate(newest)
    out, err = run([program, "--ckpt-dir", ck, "--resume", "auto"] + args[1], 2, timeout=90)
    if "%s: --resume auto passes over %s: " % (program, newest) not in err or "resumed from %s at %s" % (older, done) \
            not in out:
        fail("%s --resume auto over a truncated newest file:\n%s\n%s" % (program, out, err))
    truncate(newest)  # the run above wrote it again
    truncate(older)
    _, err = run([program, "--ckpt-dir", ck, "--resume", "auto"] + args[1], 2, expect_rc=1, timeout=90)
    if "none can be resumed from" not in err or newest not in err or older not in err:
        fail("%s --resume auto with every checkpoint damaged:\n%s" % (program, err))
    out, _ = run([program, "--ckpt-dir", ck, "--resume", "auto-or-fresh"] + args[1], 2, timeout=90)
    if "resumed from" in out:
        fail("%s --resume auto-or-fresh over damaged files should start afresh:\n%s" % (program, out))
    print("%s --resume auto: passes over a truncated newest file; all damaged: refused, naming both" % program)


def test_unusable_ckpt_dir(tmp):
    """A --ckpt-dir that cannot be made stops both programs before they train."""
    blocker = os.path.join(tmp, "a_file")
    open(blocker, "w").close()
    bad = os.path.join(blocker, "ck")
    for args in (["tutorial_ddp", "--epochs", "3", "--data", os.path.join(DATA, "breast_cancer.csv")],
                 ["tutorial_zero", "--steps", "120", "--data", os.path.join(DATA, "digits.csv")]):
        out, err = run(args + ["--ckpt-dir", bad], expect_rc=1, timeout=60)
        want = 'nb_checkpoint_make_dir: cannot create the folder "%s": Not a directory' % bad
        if want not in err:
            fail("%s with --ckpt-dir under a file should say %r:\n%s" % (args[0], want, err))
        if "epoch 1:" in out or "step 50:" in out:
            fail("%s trained before refusing its checkpoint folder:\n%s" % (args[0], out))
    print("a checkpoint folder that cannot be made stops both programs before training")


def test_cnn():
    out, _ = run(["tutorial_ddp", "--cnn", "--epochs", "2", "--data", os.path.join(DATA, "digits.csv")],
                 2, timeout=120)
    got = epochs(out, test_rows=359)
    if not got[-1][1] < got[0][1] or got[-1][2] < 60.0:
        fail("--cnn on the digits: train loss %.4f -> %.4f, accuracy %.2f%% after 2 epochs: not learning:\n%s"
             % (got[0][1], got[-1][1], got[-1][2], out))
    print("--cnn, 2 processes: digits test accuracy %.2f%%" % got[-1][2])
    _, err = run(["tutorial_ddp", "--cnn", "--epochs", "1"] + ["--data", os.path.join(DATA, "breast_cancer.csv")],
                 expect_rc=2, timeout=60)
    if "--cnn needs square images" not in err:
        fail("--cnn on a table of 30 features was not refused:\n" + err)


def test_missing_data(tmp):
    """Run from a directory without examples/datasets/ and no --data."""
    _, err = run(["tutorial_ddp", "--epochs", "1"], expect_rc=1, timeout=60, cwd=tmp)
    for want in ("examples/datasets/breast_cancer.csv", "--data FILE names the table",
                 "<prefix>/share/nabla/datasets/"):
        if want not in err:
            fail("without its table the program should say %r:\n%s" % (want, err))
    print("a missing table is named, with the --data hint")


def test_zero(tmp):
    def zero(nproc, *args, expect_rc=0):
        return run(["tutorial_zero", "--data", os.path.join(DATA, "digits.csv")] + list(args), nproc,
                   expect_rc=expect_rc, timeout=120)
    whole, stopped = os.path.join(tmp, "zero_whole"), os.path.join(tmp, "zero", "stopped")
    out, _ = zero(2, "--steps", "120", "--ckpt-dir", whole)
    final = re.search(r"step 120: test loss ([0-9.]+), accuracy ([0-9.]+)%", out)
    state2 = re.search(r"2 processes, ZeRO-1: optimizer state (\d+) bytes per process", out)
    if not final or not state2 or float(final.group(2)) < 90.0:
        fail("tutorial_zero on 2 processes did not learn the digits or did not say so:\n" + out)
    zero(2, "--steps", "120", "--stop-at", "70", "--ckpt-dir", stopped)
    out, _ = zero(2, "--steps", "120", "--resume", "--ckpt-dir", stopped)
    for want in ("resumed from %s/ckpt.safetensors at step 70 (epoch 1, batch 26)" % stopped,
                 "steps 71..120 of 120", final.group(0)):
        if want not in out:
            fail("the resumed tutorial_zero lacks %r:\n%s" % (want, out))
    if "step 50:" in out:
        fail("the resumed run trained steps before 71 again:\n" + out)
    a = open(os.path.join(whole, "ckpt.safetensors"), "rb").read()
    b = open(os.path.join(stopped, "ckpt.safetensors"), "rb").read()
    if a != b:
        fail("stopped at 70 and resumed, the checkpoint at step 120 differs from the uninterrupted run's")
    out, _ = zero(1, "--steps", "5")
    state1 = re.search(r"1 process, ZeRO-1: optimizer state (\d+) bytes per process", out)
    if not state1 or int(state1.group(1)) != 2 * int(state2.group(1)):
        fail("one process should hold twice the optimizer state of each of two (%s):\n%s"
             % (state2.group(1), out))
    _, err = zero(1, "--steps", "120", "--resume", "--ckpt-dir", stopped, expect_rc=1)
    if "was written by a run of 2 processes, this run has 1" not in err:
        fail("a checkpoint of 2 processes was not refused on 1:\n" + err)
    print("tutorial_zero: %s; stopped at 70 and resumed, the same checkpoint byte for byte" % final.group(0))
    out, _ = zero(2, "--steps", "120", "--zero3")
    z3 = re.search(r"step 120: test loss ([0-9.]+), accuracy ([0-9.]+)%", out)
    held = re.search(r"2 processes, ZeRO-3: parameters, gradients and optimizer state (\d+) bytes per process", out)
    if not z3 or not held or abs(float(z3.group(1)) - float(final.group(1))) > 1e-5 * float(final.group(1)):
        fail("tutorial_zero --zero3 should end with ZeRO-1's test loss (%s) and say what it holds:\n%s"
             % (final.group(1), out))
    # P bytes of parameters: one process holds P + P of gradients + 2P of moments, each of two ranks a half
    p = int(state2.group(1))
    if not 2 * p <= int(held.group(1)) <= 2 * p + 3 * 4 * 2 * 16:  # up to 16 elements of padding per layer
        fail("--zero3 on 2 processes holds %s bytes, expected about %d" % (held.group(1), 2 * p))
    _, err = zero(1, "--zero3", "--ckpt-dir", os.path.join(tmp, "z3"), expect_rc=2)
    print("tutorial_zero --zero3: %s, %s bytes per process" % (z3.group(0), held.group(1)))


def test_quotes(name="tutorial_ddp.c", at_least=8):
    doc = open(os.path.join(SOURCE, "docs", "tutorial.md")).read()
    program = open(os.path.join(SOURCE, "examples", name)).read()
    path = "examples/" + name
    blocks = re.findall(r"^```c " + re.escape(name) + r"\n(.*?)^```", doc, flags=re.M | re.S)
    if len(blocks) < at_least:
        fail("docs/tutorial.md quotes %d blocks of %s, expected at least %d" % (len(blocks), name, at_least))
    placed = []
    for b in blocks:
        first = b.strip().splitlines()[0] if b.strip() else "(empty)"
        at = program.find(b)
        if at < 0:
            fail("docs/tutorial.md quotes a block that %s does not have (it starts %r); copy the current "
                 "code into the doc" % (path, first))
        if program.find(b, at + 1) >= 0:
            fail("the block starting %r is in %s twice: quote more of it" % (first, path))
        placed.append((at, at + len(b), first))
    placed.sort()
    end = 0
    for begin, stop, first in placed:
        if begin < end:
            fail("the block starting %r overlaps the one before it in %s" % (first, path))
        gap = program[end:begin]
        if gap.strip():
            fail("docs/tutorial.md leaves out lines of %s before the block starting %r: %r"
                 % (path, first, gap.strip()[:200]))
        end = stop
    if program[end:].strip():
        fail("docs/tutorial.md leaves out the end of %s: %r" % (path, program[end:].strip()[:200]))
    print("%d quoted blocks make up %s" % (len(blocks), path))


def main():
    test_quotes_only = len(sys.argv) > 1 and sys.argv[1] == "--quotes"
    test_quotes()
    test_quotes("tutorial_zero.c", 10)
    if not test_quotes_only:
        probe = subprocess.run([os.path.join(BIN, "tutorial_ddp"), "--epochs", "1", "--data",
                                os.path.join(DATA, "breast_cancer.csv")],
                               capture_output=True, text=True, timeout=60)
        if "the gloo backend is not in this build" in probe.stderr:
            skip("the program needs a process group, and this build has no Gloo (libgloo-dev)")
        with tempfile.TemporaryDirectory(prefix="nb_test_tutorial_") as tmp:
            test_program(tmp)
            test_cnn()
            test_missing_data(tmp)
            test_unusable_ckpt_dir(tmp)
            test_zero(tmp)
            table = ["--data", os.path.join(DATA, "breast_cancer.csv")]
            test_resume_auto(tmp, "tutorial_ddp", (["--epochs", "1"] + table, ["--epochs", "2"] + table),
                             "epoch 1")
            digits = ["--data", os.path.join(DATA, "digits.csv")]
            test_resume_auto(tmp, "tutorial_zero", (["--steps", "20"] + digits, ["--steps", "40"] + digits),
                             "step 20")
    print("ok")


if __name__ == "__main__":
    main()
