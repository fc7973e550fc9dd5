"""train_gpt --zero 2 (ZeRO-2: AdamW's state and the gradients sharded) end to end.

1. On two processes, 16 steps with --zero 2 end with the checkpoint that
   the same run without it writes, bit for bit (--clip 0: the global norm,
   summed in another order over the shards, scales nothing; --grad-accum 2
   goes through no_sync, which keeps the buckets until the synchronising
   backward). The banner says ZeRO-2.
2. state_bytes= on the end-of-run memory line: with P the bytes of the
   parameters (AdamW: the plain run holds P of parameters, P of gradients
   and 2P of moments, so P = plain / 4), --zero holds P + P + 3P / R and
   --zero 2 P + 3P / R, each up to the padding of its buckets (at most
   R - 1 elements per bucket, per copy).
3. On one and three processes, 20 steps with clipping on: --zero 2 and the
   plain run log the same losses, relative difference at most 1e-5 (with
   three ranks the reduce-scatter and the all-reduce add in other orders).
4. --zero 4 is refused (exit 2), naming what is available.
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import assert_same_training_state, fail, run, same_losses, state_bytes  # noqa: E402

SMALL = ["--layers", "2", "--heads", "2", "--width", "32", "--seq-len", "32", "--batch-size", "4",
         "--dropout", "0.1", "--grad-accum", "2", "--warmup", "4", "--eval-interval", "8",
         "--eval-windows", "16", "--metrics-interval", "2", "--sample-len", "0", "--progress", "plain"]


def train(tmp, name, extra, nproc=2, steps=16):
    d = os.path.join(tmp, name)
    out, _ = run(["train_gpt"] + SMALL + ["--steps", str(steps), "--ckpt-dir", d, "--metrics", d + "/m.jsonl"]
                 + extra, nproc)
    return d, out


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_train_gpt_zero2_") as tmp:
        plain, out_p = train(tmp, "plain", ["--clip", "0"])
        one, out_1 = train(tmp, "zero1", ["--clip", "0", "--zero"])
        two, out_2 = train(tmp, "zero2", ["--clip", "0", "--zero", "2"])
        if "(ZeRO-2)" not in out_2:
            fail("--zero 2: the banner does not say ZeRO-2:\n" + out_2)
        assert_same_training_state(plain + "/ckpt.safetensors", two + "/ckpt.safetensors",
                                   "--zero 2 and the plain run end with different checkpoints")
        print("--zero 2 on 2 processes: the plain run's checkpoint, bit for bit")

        sp, s1, s2 = state_bytes(out_p), state_bytes(out_1), state_bytes(out_2)
        if sp % 4:
            fail("plain state_bytes=%d is not 4 x the parameters' bytes" % sp)
        p, r, pad = sp // 4, 2, 3 * 4 * 64  # padding: 1 element per bucket and copy, few buckets
        for name, got, want in (("--zero", s1, 2 * p + 3 * p // r), ("--zero 2", s2, p + 3 * p // r)):
            if not (want <= got <= want + pad):
                fail("%s: state_bytes=%d, expected %d (+ padding up to %d); plain %d" % (name, got, want, pad, sp))
        print("state_bytes per process: plain %d, --zero %d, --zero 2 %d" % (sp, s1, s2))

        for nproc in (1, 3):
            a, _ = train(tmp, "clip_plain_%d" % nproc, [], nproc, 20)
            b, _ = train(tmp, "clip_zero2_%d" % nproc, ["--zero", "2"], nproc, 20)
            la, lb = same_losses(a + "/m.jsonl", b + "/m.jsonl", "--zero 2", 10, "%d processes" % nproc)
            print("--zero 2 on %d process%s with clipping: the plain run's losses (%d records)"
                  % (nproc, "es" if nproc > 1 else "", len(la)))

        _, err = run(["train_gpt", "--zero", "4"], 1, expect_rc=2)
        if "--zero takes no value, 1" not in err or "or 3 (parameters too)" not in err:
            fail("--zero 4: the refusal does not say what is available:\n" + err)
    print("ok")


if __name__ == "__main__":
    main()
