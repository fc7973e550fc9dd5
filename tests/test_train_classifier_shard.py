"""train_classifier --zero --ckpt-sharded: each process writes its shard, rank 0 the index.

1. CNN (Adam, BatchNorm running statistics: buffers, written whole by rank
   0) on two processes: one epoch with --zero --ckpt-sharded leaves an
   index and two shards, which `nb_ckpt consolidate` turns into the
   checkpoint the same run writes without --ckpt-sharded, bit for bit.
2. MLP (SGD with momentum), --zero 2: two epochs, a sharded checkpoint, a
   new run that resumes from it for one more ends with the state of three
   straight epochs written as a single file, bit for bit.
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import assert_same_training_state, fail, read_safetensors, run  # noqa: E402


def train(tmp, name, model, epochs, extra):
    d = os.path.join(tmp, name)
    run(["train_classifier", "--model", model, "--epochs", str(epochs), "--progress", "plain",
         "--ckpt-dir", d] + extra, 2)
    return d


def consolidated(d):
    out = d + ".consolidated.safetensors"
    run(["nb_ckpt", "consolidate", os.path.join(d, "ckpt.safetensors"), out])
    return out


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_train_classifier_shard_") as tmp:
        one = train(tmp, "cnn", "cnn", 1, ["--zero"])
        sh = train(tmp, "cnn_sharded", "cnn", 1, ["--zero", "--ckpt-sharded"])
        header, meta, _ = read_safetensors(os.path.join(sh, "ckpt.safetensors"))
        folder = os.path.join(sh, meta.get("shard_dir", "?"))
        if header or not os.path.isdir(folder) or sorted(os.listdir(folder)) != \
                ["rank0-of-2.safetensors", "rank1-of-2.safetensors"]:
            fail("cnn --ckpt-sharded: the index has %d tensors; %s holds %s" % (
                len(header), folder, os.listdir(folder) if os.path.isdir(folder) else "nothing"))
        assert_same_training_state(os.path.join(one, "ckpt.safetensors"), consolidated(sh),
                                   "cnn: the consolidated sharded checkpoint is not the single file")
        print("cnn --zero --ckpt-sharded: 2 shards; consolidated, the single-file checkpoint bit for bit")

        straight = train(tmp, "mlp", "mlp", 3, ["--zero", "2"])
        part = train(tmp, "mlp_part", "mlp", 3, ["--zero", "2", "--ckpt-sharded", "--stop-at", "2"])
        train(tmp, "mlp_part", "mlp", 3, ["--zero", "2", "--ckpt-sharded", "--resume"])
        assert_same_training_state(os.path.join(straight, "ckpt.safetensors"), consolidated(part),
                                   "mlp --zero 2: 3 epochs straight and 2 + 1 resumed from shards differ")
        print("mlp --zero 2: resumed from a sharded checkpoint, the straight run's state bit for bit")
    print("ok")


if __name__ == "__main__":
    main()
