"""train_gpt --zero (ZeRO-1: AdamW's state sharded over the processes) end to end.

1. On two processes, --zero halves the optimizer state per process (the
   banner's figure), and 16 steps with it end with the checkpoint that the
   same run without it writes, bit for bit (model, AdamW state, metadata):
   with two ranks the reduce-scatter adds the same two numbers as the
   all-reduce, and clipping is off (--clip 0) so that the global norm,
   summed in another order over the shards, scales nothing. Gradient
   accumulation (--grad-accum 2) goes through no_sync.
2. Resume under --zero is exact: 8 steps, a checkpoint, a new run that
   resumes and does 8 more, ends with the checkpoint of 16 straight steps.
3. With clipping on, --zero and the plain run agree on every loss they log
   to 5 significant digits (the norms differ in the last bits).
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import assert_same_training_state, fail, optimizer_state, run, same_losses  # noqa: E402

SMALL = ["--layers", "2", "--heads", "2", "--width", "32", "--seq-len", "32", "--batch-size", "4",
         "--dropout", "0.1", "--grad-accum", "2", "--warmup", "4", "--eval-interval", "8",
         "--eval-windows", "16", "--metrics-interval", "2", "--sample-len", "0", "--progress", "plain",
         "--steps", "16"]


def train(tmp, name, extra):
    d = os.path.join(tmp, name)
    out, _ = run(["train_gpt"] + SMALL + ["--ckpt-dir", d, "--metrics", d + "/m.jsonl"] + extra, 2)
    return d, out


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_train_gpt_zero_") as tmp:
        plain, out_p = train(tmp, "plain", ["--clip", "0"])
        zero, out_z = train(tmp, "zero", ["--clip", "0", "--zero"])
        (bp, zp), (bz, zz) = optimizer_state(out_p), optimizer_state(out_z)
        # two ranks: half the state each, up to one padding element per bucket and moment
        if zp or not zz or not (bp / 2 <= bz <= bp / 2 + 4096):
            fail("optimizer state per process: %d bytes plain, %d with --zero (expected half)" % (bp, bz))
        assert_same_training_state(plain + "/ckpt.safetensors", zero + "/ckpt.safetensors",
                                   "--zero and the plain run end with different checkpoints")
        print("--zero on 2 processes: %d of %d bytes of optimizer state per process; the plain "
              "run's checkpoint, bit for bit" % (bz, bp))

        part, _ = train(tmp, "part", ["--clip", "0", "--zero", "--stop-at", "8"])
        _, out = train(tmp, "part", ["--clip", "0", "--zero", "--resume"])
        if "steps 9..16 of 16 (resumed)" not in out:
            fail("the resumed run does not say where it starts:\n" + out)
        assert_same_training_state(zero + "/ckpt.safetensors", part + "/ckpt.safetensors",
                                   "--zero: 16 steps straight and 8 + 8 resumed differ")
        print("--zero resume: bitwise equal checkpoints")

        a, _ = train(tmp, "clip_plain", [])
        b, _ = train(tmp, "clip_zero", ["--zero"])
        la, lb = same_losses(a + "/m.jsonl", b + "/m.jsonl", "--zero", 8)
        print("--zero with clipping: the same losses (%d records)" % len(la))
    print("ok")


if __name__ == "__main__":
    main()
