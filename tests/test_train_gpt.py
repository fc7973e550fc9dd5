"""train_gpt end to end.

1. Learning: on a 300 kB slice of the shipped text, a small GPT trained for
   150 steps ends with a held-out loss well below the unigram entropy of
   the slice (computed here from its bytes): the model has learnt more than
   character frequencies. Its first loss is near ln V (an untrained model
   is uniform), the metrics log and the plot are written, and a sample is
   printed.
2. Resume is exact: 16 steps straight, and 8 steps, a checkpoint, a new
   process that resumes and runs 8 more, end with the same checkpoint bit
   for bit (model, AdamW state, dropout generator, data position) and the
   same metrics; on one process and on two under nbrun with DDP.
3. Token shards in llm.c's format (--data) train too, and --synthetic
   (random tokens, no dataset) runs with a first loss near ln V.
4. Errors: a checkpoint from another world size is refused with a message;
   bad flags exit with status 2.
5. Kept checkpoints (Note [Kept checkpoints] in examples/common/resume.c):
   checkpoints at steps 4, 8 and 12 leave ckpt.safetensors and the two
   before it; --resume auto passes over a truncated newest (naming it and
   its fault) and resumes from step 8, then over a newest with a NaN
   (resuming from step 12);
   with every file damaged it exits 1 naming each, and --resume
   auto-or-fresh starts afresh.
"""
import json
import collections
import math
import os
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import assert_same_training_state, check_svg, fail, read_metrics, run, SOURCE  # noqa: E402

TEXT = os.path.join(SOURCE, "examples", "datasets", "austen.txt")
SMALL = ["--layers", "2", "--heads", "2", "--width", "32", "--seq-len", "32", "--batch-size", "4",
         "--dropout", "0.1", "--grad-accum", "2", "--warmup", "4", "--eval-interval", "4",
         "--eval-windows", "16", "--metrics-interval", "2", "--sample-len", "16", "--progress", "plain"]


def unigram_entropy(data):
    counts = collections.Counter(data)
    return -sum(c / len(data) * math.log(c / len(data)) for c in counts.values())


def test_learns(tmp):
    data = open(TEXT, "rb").read()[:300000]
    path = os.path.join(tmp, "slice.txt")
    open(path, "wb").write(data)
    h = unigram_entropy(data)
    v = len(set(data))
    metrics = os.path.join(tmp, "learn", "metrics.jsonl")
    out, _ = run(["train_gpt", "--text", path, "--layers", "2", "--heads", "4", "--width", "64",
                  "--steps", "150", "--warmup", "20", "--lr", "3e-3", "--eval-interval", "75",
                  "--eval-windows", "128", "--metrics-interval", "5", "--sample-len", "40",
                  "--progress", "plain", "--metrics", metrics])
    rows = read_metrics(metrics)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    if [r["step"] for r in evals] != [75, 150] or len(train) != 30:
        fail("metrics: eval steps %s, %d train records" % ([r["step"] for r in evals], len(train)))
    first, val = train[0]["loss"], evals[-1]["val_loss"]
    if abs(first - math.log(v)) > 0.4:
        fail("the first losses average %.3f, expected about ln %d = %.3f" % (first, v, math.log(v)))
    if not val < h - 0.4:
        fail("held-out loss %.3f is not well below the unigram entropy %.3f nats" % (val, h))
    for want in ("step 150/150 | loss ", "step 150: train loss", "sample (40 characters",
                 "metrics:    " + metrics, "plot:       " + metrics[:-6] + ".svg"):
        if want not in out:
            fail("output lacks %r:\n%s" % (want, out))
    check_svg(metrics[:-6] + ".svg", 2)
    print("learns: held-out loss %.3f < unigram entropy %.3f - 0.4 (first loss %.3f, ln V %.3f)"
          % (val, h, first, math.log(v)))


def test_resume(tmp, nproc):
    base = SMALL + ["--steps", "16"]
    a, b = os.path.join(tmp, "straight%d" % nproc), os.path.join(tmp, "resumed%d" % nproc)
    run(["train_gpt"] + base + ["--ckpt-dir", a, "--metrics", a + "/m.jsonl"], nproc)
    run(["train_gpt"] + base + ["--ckpt-dir", b, "--metrics", b + "/m.jsonl", "--stop-at", "8"], nproc)
    out, _ = run(["train_gpt"] + base + ["--ckpt-dir", b, "--metrics", b + "/m.jsonl", "--resume"], nproc)
    if "steps 9..16 of 16 (resumed)" not in out:
        fail("the resumed run does not say where it starts:\n" + out)
    assert_same_training_state(a + "/ckpt.safetensors", b + "/ckpt.safetensors",
                               "%d process(es): 16 steps straight and 8 + 8 resumed differ" % nproc)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "time"} for r in rows]
    ma, mb = strip(read_metrics(a + "/m.jsonl")), strip(read_metrics(b + "/m.jsonl"))
    if ma != mb:
        fail("%d process(es): the metrics differ:\n%s\n%s" % (nproc, ma, mb))
    print("resume on %d process(es): bitwise equal checkpoints, equal metrics (%d records)"
          % (nproc, len(ma)))
    return a


def test_tokens(tmp):
    data = open(TEXT, "rb").read()[:20000]
    path = os.path.join(tmp, "shard_000.bin")
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(data), *([0] * 253)))
        f.write(struct.pack("<%dH" % len(data), *data))
    out, _ = run(["train_gpt", "--data", os.path.join(tmp, "shard_*.bin"), "--vocab-size", "256"]
                 + SMALL + ["--steps", "4", "--sample-len", "5"])
    if "token shards" not in out or "sample (5 tokens" not in out:
        fail("token shards run:\n" + out)
    print("token shards: trained and sampled")


def test_synthetic(tmp):
    metrics = os.path.join(tmp, "synthetic.jsonl")
    out, _ = run(["train_gpt", "--synthetic", "--vocab-size", "300"] + SMALL
                 + ["--steps", "4", "--sample-len", "5", "--metrics", metrics])
    first = read_metrics(metrics)[0]["loss"]
    if "random tokens (--synthetic)" not in out or abs(first - math.log(300)) > 0.3:
        fail("--synthetic: first loss %.3f, ln 300 = %.3f:\n%s" % (first, math.log(300), out))
    _, err = run(["train_gpt", "--synthetic", "--data", "x.bin"], expect_rc=2)
    if "--synthetic makes its own tokens" not in err:
        fail("--synthetic with --data: " + err)
    print("synthetic: random tokens, first loss %.3f (ln 300 = %.3f)" % (first, math.log(300)))


def test_errors(tmp, ckpt_dir_2proc):
    _, err = run(["train_gpt"] + SMALL + ["--steps", "20", "--ckpt-dir", ckpt_dir_2proc, "--resume"],
                 expect_rc=1)
    if "was written with world_size 2, this run has 1" not in err:
        fail("resuming a 2-process checkpoint on 1 process: " + err)
    # an error before the group exists carries the launcher's rank, not 0
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    free_port = sock.getsockname()[1]
    sock.close()
    _, err = run(["train_gpt"] + SMALL + ["--steps", "2"], expect_rc=1,
                 env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port), "NABLA_JOIN_TIMEOUT": "1"})
    if "train_gpt (rank 1): joining the run: " not in err:
        fail("an error of rank 1 before the join is not labelled rank 1: " + err)
    _, err = run(["train_gpt", "--no-such-flag"], expect_rc=2)
    if 'unknown flag "--no-such-flag"' not in err:
        fail("unknown flag: " + err)
    _, err = run(["train_gpt", "--steps", "ten"], expect_rc=2)
    if '--steps: "ten" is not an integer' not in err:
        fail("bad value: " + err)
    _, err = run(["train_gpt", "--data", os.path.join(tmp, "none_*.bin")], expect_rc=1)
    if "no token shard matches" not in err:
        fail("missing shards: " + err)
    print("errors: refused with messages")


def put_nan(path):
    """Writes a NaN over the first element of the file's first f32 tensor."""
    raw = bytearray(open(path, "rb").read())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    at = 8 + n + header[name]["data_offsets"][0]
    raw[at:at + 4] = struct.pack("<f", float("nan"))
    open(path, "wb").write(bytes(raw))
    return name


def test_kept_checkpoints(tmp):
    d = os.path.join(tmp, "kept")
    base = SMALL + ["--ckpt-dir", d, "--ckpt-interval", "4"]
    run(["train_gpt"] + base + ["--steps", "12"])
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    if files != ["ckpt.safetensors", "ckpt.step000000004.safetensors", "ckpt.step000000008.safetensors"]:
        fail("checkpoints kept at steps 4, 8, 12: " + str(files))
    newest = os.path.join(d, "ckpt.safetensors")
    data = open(newest, "rb").read()
    open(newest, "wb").write(data[:len(data) // 2])
    out, err = run(["train_gpt"] + base + ["--steps", "14", "--resume", "auto"])
    if "--resume auto passes over %s: " % newest not in err or "steps 9..14 of 14 (resumed)" not in out \
            or "--resume auto: from %s/ckpt.step000000008.safetensors" % d not in out:
        fail("a truncated newest checkpoint: not resumed from step 8:\n" + out + err)
    # the resumed run saved steps 12 and 14 (the damaged file was not kept): 8, 12 and 14 remain
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    if files != ["ckpt.safetensors", "ckpt.step000000008.safetensors", "ckpt.step000000012.safetensors"]:
        fail("checkpoints kept after the resume: " + str(files))
    name = put_nan(newest)
    out, err = run(["train_gpt"] + base + ["--steps", "14", "--resume", "auto"])
    if "--resume auto passes over %s: " % newest not in err or '"%s"' % name not in err \
            or "--resume auto: from %s/ckpt.step000000012.safetensors" % d not in out:
        fail("a NaN in the newest checkpoint: not resumed from step 12:\n" + out + err)
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            p = os.path.join(d, f)
            open(p, "wb").write(open(p, "rb").read()[:100])
    _, err = run(["train_gpt"] + base + ["--steps", "14", "--resume", "auto"], expect_rc=1)
    names = [f for f in os.listdir(d) if f.endswith(".safetensors")]
    if "none can be resumed from" not in err or any(os.path.join(d, f) not in err for f in names):
        fail("every checkpoint damaged: not refused naming each of %s:\n%s" % (names, err))
    out, _ = run(["train_gpt"] + base + ["--steps", "2", "--resume", "auto-or-fresh"])
    if "steps 1..2 of 2\n" not in out:
        fail("--resume auto-or-fresh over damaged files: not a fresh start:\n" + out)
    print("kept checkpoints: a truncated and a NaN newest fall back to the one before; all damaged refused, "
          "auto-or-fresh starts afresh")


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_train_gpt_") as tmp:
        test_learns(tmp)
        test_resume(tmp, 1)
        two = test_resume(tmp, 2)
        test_tokens(tmp)
        test_synthetic(tmp)
        test_errors(tmp, two)
        test_kept_checkpoints(tmp)
    print("ok")


if __name__ == "__main__":
    main()
