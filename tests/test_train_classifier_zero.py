"""train_classifier --zero (ZeRO-1: the optimizer's state sharded over the processes) end to end.

1. MLP (SGD with momentum) on two processes: --zero halves the optimizer
   state per process (the banner's figure), and 3 epochs with it end with
   the checkpoint that the same run without it writes, bit for bit (model,
   momentum buffers, metadata): with two ranks the reduce-scatter adds the
   same two numbers as the all-reduce, and the update is element-wise.
2. Resume under --zero is exact: 2 epochs, a checkpoint, a new run that
   resumes for 1 more, ends with the checkpoint of 3 straight epochs.
3. CNN (Adam, BatchNorm buffers) on two processes: 1 epoch with --zero ends
   with the plain run's checkpoint, bit for bit.
4. MLP with --zero 2 (ZeRO-2, the gradients sharded too): the plain run's
   checkpoint of 3 epochs, bit for bit, with less state per process than
   --zero (state_bytes= on the last line).
"""
import re
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import assert_same_training_state, fail, optimizer_state, run  # noqa: E402


def train(tmp, name, model, epochs, extra):
    d = os.path.join(tmp, name)
    out, _ = run(["train_classifier", "--model", model, "--epochs", str(epochs), "--progress", "plain",
                  "--ckpt-dir", d] + extra, 2)
    return d + "/ckpt.safetensors", out


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_train_classifier_zero_") as tmp:
        plain, out_p = train(tmp, "plain", "mlp", 3, [])
        plain_mlp = plain
        zero, out_z = train(tmp, "zero", "mlp", 3, ["--zero"])
        (bp, zp), (bz, zz) = optimizer_state(out_p), optimizer_state(out_z)
        # two ranks: half the state each, up to one padding element per bucket
        if zp or not zz or not (bp / 2 <= bz <= bp / 2 + 64):
            fail("optimizer state per process: %d bytes plain, %d with --zero (expected half)" % (bp, bz))
        assert_same_training_state(plain, zero, "mlp: --zero and the plain run end with different checkpoints")
        print("mlp --zero on 2 processes: %d of %d bytes of optimizer state per process; the plain "
              "run's checkpoint, bit for bit" % (bz, bp))

        part, _ = train(tmp, "part", "mlp", 3, ["--zero", "--stop-at", "2"])
        _, out = train(tmp, "part", "mlp", 3, ["--zero", "--resume"])
        assert_same_training_state(zero, part, "mlp --zero: 3 epochs straight and 2 + 1 resumed differ")
        print("mlp --zero resume: bitwise equal checkpoints")

        plain, _ = train(tmp, "cnn_plain", "cnn", 1, [])
        zero, out = train(tmp, "cnn_zero", "cnn", 1, ["--zero"])
        if "(ZeRO-1)" not in out:
            fail("cnn --zero: the banner does not say ZeRO-1:\n" + out)
        assert_same_training_state(plain, zero, "cnn: --zero and the plain run end with different checkpoints")
        print("cnn --zero (Adam): the plain run's checkpoint, bit for bit")

        two, out_2 = train(tmp, "zero2", "mlp", 3, ["--zero", "2"])
        if "(ZeRO-2)" not in out_2:
            fail("mlp --zero 2: the banner does not say ZeRO-2:\n" + out_2)
        assert_same_training_state(plain_mlp, two, "mlp: --zero 2 and the plain run end with different checkpoints")
        b1, b2 = (int(re.search(r"state_bytes=(\d+)", o).group(1)) for o in (out_z, out_2))
        if not b2 < b1:
            fail("mlp: state_bytes=%d with --zero 2, %d with --zero: expected less" % (b2, b1))
        print("mlp --zero 2: the plain run's checkpoint, bit for bit; state_bytes %d (--zero: %d)" % (b2, b1))
    print("ok")


if __name__ == "__main__":
    main()
