"""`make demo`, shortened: runs examples/run_demo.sh (what the Makefile's
demo target runs after building) with --steps 30 and a short sample, and
checks that it trains on 2 processes with DDP (this build computes on the
CPU), prints the falling loss, an evaluation, a sample, and where the
checkpoint, the metrics and the plot went, and that those files exist.
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
    print("ok: the demo trained, sampled and wrote its files (losses %s)" % losses)


if __name__ == "__main__":
    main()
