"""`make demo`, shortened: runs examples/run_demo.sh (what the Makefile's
demo target runs after building) with --steps 30 and a short sample, and
checks that it trains on 2 processes with DDP (this build computes on the
CPU), prints the falling loss, an evaluation, a sample, and where the
checkpoint, the metrics and the plot went, and that those files exist; that
it shows the whole command it runs and names the plot it wrote; and that a
second run resumed at the last step says there is nothing to train (not
"steps 31..30") and names the plot asked for with --plot.
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import BUILD, SOURCE, check_svg, fail, read_metrics, read_safetensors  # noqa: E402


def main():
    script = os.path.join(SOURCE, "examples", "run_demo.sh")
    with tempfile.TemporaryDirectory(prefix="nb_test_demo_") as out:
        env = dict(os.environ, NABLA_DEMO_DIR=out, NABLA_PG_TIMEOUT="60")
        p = subprocess.run(["sh", script, BUILD, "--steps", "30", "--warmup", "5", "--eval-interval",
                            "15", "--log-interval", "10", "--sample-len", "60"],
                           capture_output=True, text=True, timeout=300, env=env)
        text = p.stdout
        if p.returncode != 0:
            fail("run_demo.sh exited with %d\n%s\n%s" % (p.returncode, text[-3000:], p.stderr[-3000:]))
        for want in ("DDP on 2 CPU processes", "2 processes with DDP", "step 30/30 | loss ",
                     "step 30: train loss", "sample (60 characters", "Elizabeth",
                     "checkpoint: %s/ckpt.safetensors (step 30)" % out,
                     "metrics:    %s/metrics.jsonl" % out, "plot:       %s/loss.svg" % out):
            if want not in text:
                fail("the demo's output lacks %r:\n%s" % (want, text))
        losses = [float(x) for x in re.findall(r"step \d+/30 \| loss ([0-9.]+)", text)]
        if len(losses) < 3 or not losses[-1] < losses[0]:
            fail("the printed loss does not fall: %s" % losses)
        _, meta, _ = read_safetensors(os.path.join(out, "ckpt.safetensors"))
        if meta.get("step") != "30" or meta.get("world_size") != "2":
            fail("checkpoint metadata %r" % meta)
        if len([r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["kind"] == "eval"]) != 2:
            fail("expected two evaluations in the metrics")
        check_svg(os.path.join(out, "loss.svg"), 2)
        # the command, whole, on one line: the launcher, the program, the demo's flags and ours
        cmd = [l for l in text.splitlines() if l.startswith("demo: ") and "/nbrun " in l]
        if len(cmd) != 1:
            fail("the demo does not show the command it runs:\n%s" % text)
        for want in (os.path.join(BUILD, "bin", "nbrun") + " --nproc-per-node 2 " +
                     os.path.join(BUILD, "bin", "train_gpt"), " --layers 3 ", " --prompt Elizabeth ",
                     " --plot %s/loss.svg " % out, " --steps 30 ", " --sample-len 60"):
            if want not in cmd[0]:
                fail("the command line %r lacks %r" % (cmd[0], want))
        if "demo: done. The loss curves are in %s/loss.svg" % out not in text:
            fail("the demo does not name the plot it wrote:\n%s" % text[-1500:])

        # resumed at the end: nothing to train, and the plot asked for
        again = os.path.join(out, "again.svg")
        p = subprocess.run(["sh", script, BUILD, "--resume", "--steps", "30", "--sample-len", "0",
                            "--plot", again], capture_output=True, text=True, timeout=300, env=env)
        text = p.stdout
        if p.returncode != 0:
            fail("the resumed demo exited with %d\n%s\n%s" % (p.returncode, text[-3000:], p.stderr[-3000:]))
        for want in ("nothing to train: the checkpoint is at step 30 of 30 (a larger --steps trains further)",
                     "plot:       %s" % again, "demo: done. The loss curves are in %s" % again,
                     'DEMO_ARGS="--resume --steps 60"'):
            if want not in text:
                fail("the resumed demo's output lacks %r:\n%s" % (want, text))
        if re.search(r"steps 31\.\.30|step 31/", text):
            fail("the resumed demo speaks of step 31:\n%s" % text)
        check_svg(again, 2)
    print("ok: the demo trained, sampled and wrote its files (losses %s)" % losses)


if __name__ == "__main__":
    main()
