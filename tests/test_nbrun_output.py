"""A rank's printf output under nbrun shows when the line is printed, not at
exit: nbrun sets NABLA_LINE_BUFFERED=1 and libnabla makes a piped stdout
line-buffered (Note [Line-buffered stdout under a launcher] in
tensor/error.c). tests/programs/nb_print_wait.c prints a line and then
waits for a file: the line must reach nbrun's stdout while it waits. With
NABLA_LINE_BUFFERED=0 the C library's block buffering is back and the line
comes only at exit (which shows the test can fail)."""
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import BIN, Node, TIME_SCALE, driver, fail  # noqa: E402


def start(flag, env_extra):
    env = dict(os.environ)
    env.pop("NABLA_LINE_BUFFERED", None)
    env.update(env_extra)
    argv = [os.path.join(BIN, "nbrun"), "--nproc-per-node", "1", driver("nb_print_wait"), flag]
    return Node(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))


def finish(node, flag):
    open(flag, "w").close()
    rc = node.p.wait(timeout=30 * TIME_SCALE)
    for t in node.threads:
        t.join(10)
    if rc != 0 or "[rank 0] done" not in node.text():
        fail("nb_print_wait under nbrun: exit %s:\n%s" % (rc, node.text()))


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_nbrun_output_") as tmp:
        flag = os.path.join(tmp, "go")
        node = start(flag, {})
        node.wait_for(r"^\[rank 0\] waiting for ", 20, "the first line, while the rank still runs")
        finish(node, flag)
        print("by default the line shows while the rank runs")

        flag = os.path.join(tmp, "go_off")
        node = start(flag, {"NABLA_LINE_BUFFERED": "0"})
        time.sleep(1.5)
        if "waiting for" in node.text():
            fail("with NABLA_LINE_BUFFERED=0 the line came before exit: is the switch ignored?\n"
                 + node.text())
        finish(node, flag)
        if "[rank 0] waiting for" not in node.text():
            fail("with NABLA_LINE_BUFFERED=0 the first line never came:\n" + node.text())
        print("with NABLA_LINE_BUFFERED=0 it shows at exit")
    print("ok")


if __name__ == "__main__":
    main()
