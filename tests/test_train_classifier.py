"""train_classifier end to end.

1. The MLP on the breast-cancer table (455 training / 114 test rows, batch
   8 per process) reaches at least 95% test accuracy on one process and on
   two under nbrun with DDP; the CNN on the digits reaches at least 95% on
   one process and on two with SyncBatchNorm. Evaluation is exact: every
   test row is counted once whatever the number of processes.
2. Resume: 4 epochs straight, and 2 epochs, a checkpoint, a new process
   that resumes for 2 more, end with the same checkpoint bit for bit.
3. The metrics log has one record per epoch and the plot is written.
4. Errors: bad flags exit with status 2 and a message.
"""
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import assert_same_training_state, check_svg, fail, read_metrics, run  # noqa: E402


def accuracy(out, rows):
    m = re.search(r"test accuracy ([0-9.]+)% \((\d+) rows\)", out)
    if not m:
        fail("no final accuracy in the output:\n" + out)
    if int(m.group(2)) != rows:
        fail("evaluated %s test rows, expected every one of the %d exactly once" % (m.group(2), rows))
    return float(m.group(1))


def test_accuracy(tmp):
    cases = [("mlp", 1, [], 114, "455 training and 114 test rows"),
             ("mlp", 2, [], 114, "2 processes with DDP, batch 8 per process, 28 steps per epoch"),
             ("cnn", 1, [], 359, "1438 training and 359 test rows"),
             ("cnn", 2, ["--sync-bn"], 359, "SyncBatchNorm")]
    for model, nproc, extra, rows, says in cases:
        metrics = os.path.join(tmp, "%s%d" % (model, nproc), "m.jsonl")
        out, _ = run(["train_classifier", "--model", model, "--progress", "plain", "--metrics", metrics]
                     + extra, nproc)
        if says not in out:
            fail("%s on %d process(es): the output lacks %r:\n%s" % (model, nproc, says, out))
        acc = accuracy(out, rows)
        if acc < 95.0:
            fail("%s on %d process(es): test accuracy %.2f%% < 95%%" % (model, nproc, acc))
        records = read_metrics(metrics)
        epochs = 20 if model == "mlp" else 15
        if [r["epoch"] for r in records] != list(range(1, epochs + 1)):
            fail("%s: metrics records for epochs %s" % (model, [r["epoch"] for r in records]))
        if abs(records[-1]["test_accuracy"] * 100 - acc) > 0.01:
            fail("%s: the log's last test accuracy %s differs from the printed %.2f"
                 % (model, records[-1]["test_accuracy"], acc))
        check_svg(metrics[:-6] + ".svg", 4)
        print("%s on %d process(es)%s: test accuracy %.2f%% over %d rows"
              % (model, nproc, " " + " ".join(extra) if extra else "", acc, rows))


def test_resume(tmp):
    base = ["train_classifier", "--model", "cnn", "--epochs", "4", "--progress", "off"]
    a, b = os.path.join(tmp, "straight"), os.path.join(tmp, "resumed")
    run(base + ["--ckpt-dir", a])
    run(base + ["--ckpt-dir", b, "--stop-at", "2"])
    out, _ = run(base + ["--ckpt-dir", b, "--resume"])
    if "checkpoint: %s/ckpt.safetensors (epoch 4)" % b not in out:
        fail("resumed run:\n" + out)
    assert_same_training_state(a + "/ckpt.safetensors", b + "/ckpt.safetensors",
                               "4 epochs straight and 2 + 2 resumed differ")
    print("resume: bitwise equal checkpoints (model, BatchNorm statistics, Adam state)")


def test_errors():
    for args, msg in ((["--model", "rnn"], '--model must be mlp or cnn, not "rnn"'),
                      (["--model", "cnn", "--channels", "16,x"], "--channels must be a comma-separated"),
                      (["--epochs"], "--epochs needs a value"),
                      (["--resume"], "--ckpt-dir with --resume")):
        _, err = run(["train_classifier"] + args, expect_rc=2)
        if msg not in err:
            fail("%s: %r lacks %r" % (args, err, msg))
    print("errors: refused with messages")


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_train_classifier_") as tmp:
        test_accuracy(tmp)
        test_resume(tmp)
        test_errors()
    print("ok")


if __name__ == "__main__":
    main()
