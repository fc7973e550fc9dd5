"""nbrun names the rank that failed first (Note [Who failed first] in
tools/nbrun.c) also when it reaps both failures together: a rank killed by
a signal outranks a peer that exited with an error, even when the peer
ended first and the pending SIGCHLD names it (under load nbrun may not run
between the two ends; then the peer, a process of one thread, is often
reapable first).

The order is made on purpose, each step waiting for the state it needs:
two ranks wait on a FIFO each; nbrun is stopped (SIGSTOP); the exiting rank
is let go and seen a zombie, then the killed one; nbrun is continued and
reaps both at once. Both arrangements run (killed rank 0, exiting rank 1
and the reverse), so that whichever order the kernel lists the children in,
one of them has the killed child reaped before the exited one whose
SIGCHLD is pending. Before the fix the first arrangement named rank 1
("exited with code 1")."""
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import BIN, Node, TIME_SCALE, fail  # noqa: E402

LIMIT_S = 30 * TIME_SCALE  # bounds a hang only


def state(pid):
    """The state letter of /proc/<pid>/stat (R, S, T, Z...)."""
    with open("/proc/%d/stat" % pid) as f:
        s = f.read()
    return s[s.rindex(")") + 2]


def wait_until(cond, what, node):
    deadline = time.monotonic() + LIMIT_S
    while not cond():
        if time.monotonic() > deadline:
            fail("%s: not within %d s:\n%s" % (what, LIMIT_S, node.text()[-4000:]))
        time.sleep(0.01)


def release(fifo):
    with open(fifo, "w") as f:
        f.write("go\n")


def one(tmp, killed):
    exiting = 1 - killed
    for r in (0, 1):
        os.mkfifo(os.path.join(tmp, "go%d" % r))
    script = ('d="%s"; echo $$ > "$d/pid$RANK.tmp" && mv "$d/pid$RANK.tmp" "$d/pid$RANK"; '
              'read x < "$d/go$RANK"; if [ "$RANK" = %d ]; then kill -9 $$; fi; exit 1') % (tmp, killed)
    argv = [os.path.join(BIN, "nbrun"), "--nproc-per-node", "2", "sh", "-c", script]
    node = Node(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        pid_files = [os.path.join(tmp, "pid%d" % r) for r in (0, 1)]
        wait_until(lambda: all(os.path.exists(f) for f in pid_files), "both ranks start", node)
        pids = [int(open(f).read()) for f in pid_files]
        os.kill(node.p.pid, signal.SIGSTOP)
        wait_until(lambda: state(node.p.pid) == "T", "nbrun stops", node)
        release(os.path.join(tmp, "go%d" % exiting))
        wait_until(lambda: state(pids[exiting]) == "Z", "rank %d exits" % exiting, node)
        release(os.path.join(tmp, "go%d" % killed))
        wait_until(lambda: state(pids[killed]) == "Z", "rank %d is killed" % killed, node)
        os.kill(node.p.pid, signal.SIGCONT)
        rc = node.p.wait(timeout=LIMIT_S)
    finally:
        if node.p.poll() is None:
            node.p.kill()
            node.p.wait()
    for t in node.threads:
        t.join(10)
    out = node.text()
    want = "nbrun: rank %d (local rank %d, pid %d) failed first: was killed by signal 9" % (killed, killed,
                                                                                          pids[killed])
    if want not in out or rc != 137:
        fail("rank %d exited with code 1 and then rank %d was killed by SIGKILL, reaped together: exit %d "
             "(expected 137) and no %r in:\n%s" % (exiting, killed, rc, want, out))
    print("rank %d exits 1, then rank %d is killed; reaped together, the killed rank is named first"
          % (exiting, killed))


def main():
    for killed in (0, 1):
        with tempfile.TemporaryDirectory(prefix="nb_test_nbrun_first_") as tmp:
            one(tmp, killed)
    print("ok")


if __name__ == "__main__":
    main()
