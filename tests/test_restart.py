"""Runs that survive a lost rank: nbrun --max-restarts with train_gpt --resume auto.

1. Two ranks, 12 steps, a checkpoint every 3. In the first generation rank 0
   (which serves the store) is SIGKILLed as it starts step 5; in the second,
   rank 1 is SIGSTOPped as it starts step 8 and rank 0 names it at the
   liveness limit (2 s). Under --max-restarts 2 the run completes, each
   restart announced with its cause and count, and its last checkpoint
   equals, bit for bit (model, AdamW state, data position, dropout
   generator), the one of an uninterrupted run: each generation resumed
   from the newest checkpoint (steps 4.. then 7..) on a fresh store.
   The faults come from the program's test hook NABLA_TEST_FAULT
   (examples/common/fault.h), so that they land at known steps.
2. With --max-restarts 1 the same faults end the run: the second failure's
   exit code, "no restart left".
3. --resume auto takes the newest complete checkpoint: never a temporary
   file of a save in progress (a complete one with a later step is there),
   never a damaged one (a truncated file with a later step is passed over,
   with a line on stderr); the run then ends with the checkpoint of an
   uninterrupted run. An empty or missing directory means a fresh start.
"""
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import assert_same_training_state, BIN, fail, run, run_in_scratch  # noqa: E402

TINY = ["--layers", "2", "--heads", "2", "--width", "32", "--seq-len", "32", "--batch-size", "4",
        "--dropout", "0.1", "--grad-accum", "2", "--warmup", "4", "--eval-interval", "0",
        "--eval-windows", "16", "--sample-len", "0", "--progress", "plain", "--log-interval", "1",
        "--steps", "12", "--ckpt-interval", "3"]
FAULTS = "0:0:5:KILL,1:1:8:STOP"


def nbrun(args, env, timeout=120):
    cmd = [os.path.join(BIN, "nbrun"), "--nproc-per-node", "2"] + args
    e = dict(os.environ, NABLA_PG_TIMEOUT="60", NABLA_LIVENESS_TIMEOUT="2", NBRUN_GRACE="10",
             OPENBLAS_NUM_THREADS="1")
    e.update(env)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    return p.returncode, p.stdout + p.stderr


def expect(text, pattern, what):
    if not re.search(pattern, text):
        fail("%s: no match for %r in:\n%s" % (what, pattern, text[-6000:]))


def test_restarts(tmp):
    ref = os.path.join(tmp, "straight")
    rc, out = nbrun([os.path.join(BIN, "train_gpt")] + TINY + ["--ckpt-dir", ref], {})
    if rc != 0:
        fail("the uninterrupted run exited with %d:\n%s" % (rc, out))

    d = os.path.join(tmp, "restarted")
    rc, out = nbrun(["--max-restarts", "2", os.path.join(BIN, "train_gpt")] + TINY
                    + ["--ckpt-dir", d, "--resume", "auto"], {"NABLA_TEST_FAULT": FAULTS})
    if rc != 0:
        fail("under --max-restarts 2 the run exited with %d:\n%s" % (rc, out[-6000:]))
    expect(out, r"--resume auto: no checkpoint in %s: a fresh start" % re.escape(d), "first start")
    expect(out, r"nbrun: restart 1 of 2 after: rank 0 \(local rank 0, pid \d+\) was killed by signal 9 "
           r"\(Killed\) \(\"NABLA_TEST_FAULT: rank 0 sends itself SIGKILL at step 5\"\)\n", "first restart")
    expect(out, r"nbrun: restart 2 of 2 after: rank 0 \(local rank 0, pid \d+\) exited with code 1 "
           r"\(\"train_gpt \(rank 0\): .*rank 1 \(host [^,]*, pid \d+\) has shown no sign of life for "
           r"[0-9.]+ s \(NABLA_LIVENESS_TIMEOUT=2 s\).*\"\); rank 1 had been stopped by signal 19 ",
           "second restart")
    starts = re.findall(r"steps (\d+)\.\.12 of 12( \(resumed\))?", out)
    if starts != [("1", ""), ("4", " (resumed)"), ("7", " (resumed)")]:
        fail("the generations started at %s, expected steps 1, 4 (resumed) and 7 (resumed):\n%s"
             % (starts, out[-6000:]))
    if "no restart left" in out:
        fail("a restart was refused:\n" + out[-4000:])
    assert_same_training_state(os.path.join(ref, "ckpt.safetensors"), os.path.join(d, "ckpt.safetensors"),
                               "after two restarts the checkpoint differs from the uninterrupted run's")
    print("--max-restarts 2: SIGKILL of rank 0 at step 5, SIGSTOP of rank 1 at step 8; resumed at "
          "steps 4 and 7; the last checkpoint equals the uninterrupted run's bit for bit")

    d1 = os.path.join(tmp, "one_restart")
    rc, out = nbrun(["--max-restarts", "1", os.path.join(BIN, "train_gpt")] + TINY
                    + ["--ckpt-dir", d1, "--resume", "auto"], {"NABLA_TEST_FAULT": FAULTS})
    if rc != 1:
        fail("under --max-restarts 1 two failures should end the run with rank 0's exit code 1, not "
             "%d:\n%s" % (rc, out[-4000:]))
    expect(out, r"nbrun: restart 1 of 1 after: rank 0 ", "the only restart")
    expect(out, r"nbrun: no restart left \(--max-restarts 1\): the run fails\nnbrun: rank 0 \(local rank 0, "
           r"pid \d+\) failed first: exited with code 1", "the end")
    print("--max-restarts 1: the second failure ends the run (exit 1, no restart left)")


def test_resume_auto_picks(tmp):
    a = os.path.join(tmp, "picks_straight")
    run(["train_gpt"] + TINY + ["--steps", "6", "--ckpt-dir", a])
    b = os.path.join(tmp, "picks_source")
    run(["train_gpt"] + TINY + ["--steps", "6", "--stop-at", "3", "--ckpt-dir", b])
    step3 = open(os.path.join(b, "ckpt.safetensors"), "rb").read()
    run(["train_gpt"] + TINY + ["--steps", "6", "--stop-at", "5", "--ckpt-dir", b, "--resume"])
    step5 = open(os.path.join(b, "ckpt.safetensors"), "rb").read()

    c = os.path.join(tmp, "picks")
    os.makedirs(c)
    open(os.path.join(c, "step3.safetensors"), "wb").write(step3)
    # a save in progress (complete, but not renamed yet) and a damaged file, both at step 5
    open(os.path.join(c, "ckpt.safetensors.tmp.host.123.0"), "wb").write(step5)
    open(os.path.join(c, "damaged.safetensors"), "wb").write(step5[:len(step5) // 2])
    out, err = run(["train_gpt"] + TINY + ["--steps", "6", "--ckpt-dir", c, "--resume", "auto"])
    if "steps 4..6 of 6 (resumed)" not in out or \
            "--resume auto: from %s/step3.safetensors" % c not in out:
        fail("--resume auto did not take step3.safetensors:\n" + out)
    if "--resume auto passes over %s/damaged.safetensors" % c not in err:
        fail("the damaged file is not named:\n" + err)
    assert_same_training_state(os.path.join(a, "ckpt.safetensors"), os.path.join(c, "ckpt.safetensors"),
                               "resumed from step3.safetensors, the run ends elsewhere than the uninterrupted one")

    e = os.path.join(tmp, "picks_missing")
    out, _ = run(["train_gpt"] + TINY + ["--steps", "2", "--ckpt-dir", e, "--resume", "auto"])
    if "--resume auto: no checkpoint in %s: a fresh start" % e not in out or "steps 1..2 of 2\n" not in out:
        fail("--resume auto without a directory:\n" + out)
    _, err = run(["train_gpt"] + TINY + ["--ckpt-dir", e, "--resume", "newest"], expect_rc=2)
    if "--resume takes no value, 'auto' or 'auto-or-fresh', not \"newest\"" not in err:
        fail("--resume newest: " + err)
    print("--resume auto: the newest complete checkpoint (not a temporary file, not a damaged one); "
          "none: a fresh start")


def main():
    run_in_scratch("restart", test_restarts, test_resume_auto_picks)


if __name__ == "__main__":
    main()
