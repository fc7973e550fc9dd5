"""benchmarks/compare_torch.py without torch: the ratio in words, the --quick,
--threads, --batch and --nabla-env parsing, the line on torch 1.x against 2.x, and the message and
exit status when no interpreter has torch."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _programs import SOURCE, fail  # noqa: E402

sys.path.insert(0, os.path.join(SOURCE, "benchmarks"))
import compare_torch as ct  # noqa: E402  (imports no torch)


def expect(got, want, what):
    if got != want:
        fail(f"{what}: got {got!r}, expected {want!r}")


def main():
    if "torch" in sys.modules:
        fail("compare_torch imported torch in the parent process")
    # nabla / torch: 100 ms against 132 ms is 1.32x faster; 130 against 100 1.30x slower
    expect(ct.verdict(100 / 132), "nabla 1.32x faster", "verdict(100/132)")
    expect(ct.verdict(130 / 100), "nabla 1.30x slower", "verdict(1.3)")
    expect(ct.verdict(1.004), "even", "verdict(1.004)")
    expect(ct.verdict(0.0), "?", "verdict(0)")
    cell = ct.ratio_cell([1.0, 2.0, 3.0], [4.0, 4.0, 4.0])  # medians 2 and 4
    if not cell.strip().startswith("0.500") or "nabla 2.00x faster" not in cell:
        fail(f"ratio_cell: {cell!r}")

    a = ct.parse_args(["--quick"])
    expect((a.steps, a.repeats, a.bf16_models, a.compile, a.threads), (5, 2, "", False, [None, 1]), "--quick")
    a = ct.parse_args(["--quick", "--compile", "--steps", "7", "--threads", "2"])
    expect((a.steps, a.repeats, a.compile, a.threads), (7, 2, False, [2]), "--quick with --steps, --compile")
    a = ct.parse_args([])
    expect((a.steps, a.repeats, a.bf16_models, a.threads), (20, 5, "cnn,gpt", [None, 1]), "the defaults")
    expect(ct.parse_args(["--threads", "default,1,2"]).threads, [None, 1, 2], "--threads default,1,2")
    r = subprocess.run([sys.executable, os.path.join(SOURCE, "benchmarks", "compare_torch.py"), "--threads", "two"],
                       capture_output=True, text=True)
    if r.returncode != 2 or "neither 'default' nor a count" not in r.stderr:
        fail(f"--threads two: exit {r.returncode}, {r.stderr!r}")

    # nabla's environment and the batches (Note [nabla's environment])
    a = ct.parse_args(["--nabla-env", "OPENBLAS_CORETYPE=Prescott", "--nabla-env", "X=a=b"])
    expect(a.nabla_env, [("OPENBLAS_CORETYPE", "Prescott"), ("X", "a=b")], "--nabla-env twice")
    a = ct.parse_args(["--batch", "cnn=64,mlp=64"])
    expect((a.batch, ct.BATCH["cnn"], ct.BATCH["mlp"], ct.BATCH["gpt"]), ({"cnn": 64, "mlp": 64}, 64, 64, 16),
           "--batch cnn=64,mlp=64")
    for bad, why in ((["--nabla-env", "OMP_NUM_THREADS=1"], "is a thread variable"),
                     (["--nabla-env", "Prescott"], "is not VAR=VALUE"),
                     (["--batch", "cnn=0"], "is not MODEL=N"), (["--batch", "resnet=8"], "is not MODEL=N"),
                     (["--batch", "cnn=64", "--ddp", "2"], "the DDP rows keep")):
        r = subprocess.run([sys.executable, os.path.join(SOURCE, "benchmarks", "compare_torch.py"), *bad],
                           capture_output=True, text=True)
        if r.returncode != 2 or why not in r.stderr:
            fail(f"{' '.join(bad)}: exit {r.returncode}, {r.stderr!r}")

    line = ct.old_torch_line([("1.13.1", "Prescott"), ("2.15.0", None)])
    if not line or "generic SSE kernels" not in line or "1.13.1" not in line or "2.15.0" not in line:
        fail(f"old_torch_line with a generic core: {line!r}")
    line = ct.old_torch_line([("1.13.1", "Zen"), ("2.15.0", None)])
    if not line or "generic" in line:
        fail(f"old_torch_line with a known core: {line!r}")
    expect(ct.old_torch_line([("2.15.0", None)]), None, "old_torch_line with one version")

    # an interpreter without torch named on the command line: a message and exit 1
    env = dict(os.environ, NABLA_BIN=os.path.join(os.environ.get("NABLA_BINARY_DIR", "build"), "bin"))
    r = subprocess.run([sys.executable, os.path.join(SOURCE, "benchmarks", "compare_torch.py"), "--quick",
                        "--torch-python", "/bin/false"], capture_output=True, text=True, env=env)
    if r.returncode != 1 or "torch does not import under /bin/false" not in r.stderr:
        fail(f"--torch-python /bin/false: exit {r.returncode}, {r.stderr!r}")
    print("ok")


if __name__ == "__main__":
    main()
