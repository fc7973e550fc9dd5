"""A cut link between two nodes: train_classifier under `nbrun --nnodes 2`
in two network namespaces (tests/_netns.py), two processes per node; once
training is under way the veth is set down from outside (`ip link set
... down`: packets vanish, no connection is reset, as when a cable is
pulled or a switch dies).

1. Both nbruns end, with a non-zero status, within the liveness limit
   (NABLA_LIVENESS_TIMEOUT=3) plus the time to stop the processes; the
   test gives them LIMIT_S.
2. Node 0 names what it lost: node 1's ranks, 2 and 3, and their host
   (nbnode1); node 1 names the store's side: rank 0 and host nbnode0.
3. No process is left behind in either namespace.

Skipped (77) only where a network namespace cannot be made."""
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _netns  # noqa: E402
from _programs import BIN, Node, fail  # noqa: E402

PORT = 29614
LIVENESS_S = 3
LIMIT_S = LIVENESS_S + 9  # detection + nb_pg_free's 2 s + nbrun's grace period (5 s at most)
START_S = 40              # bound on the start: join, and the first steps


def main():
    env = dict(os.environ, NABLA_LIVENESS_TIMEOUT=str(LIVENESS_S), NABLA_PG_TIMEOUT="60",
               NABLA_JOIN_TIMEOUT="30", NABLA_STALL_WARNING="0", NBRUN_GRACE="5", OPENBLAS_NUM_THREADS="1",
               NABLA_RUN_ID="netns-cut-%d" % os.getpid())
    with _netns.Nodes() as nodes, tempfile.TemporaryDirectory() as tmp:
        env["NABLA_STORE_SECRET_FILE"] = _netns.secret_file(tmp)  # several nodes need one
        nodes_ = []
        for i in (0, 1):
            argv = [os.path.join(BIN, "nbrun"), "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "2",
                    "--master-addr", _netns.ADDR[0], "--master-port", str(PORT),
                    os.path.join(BIN, "train_classifier"), "--model", "mlp", "--epochs", "100000",
                    "--progress", "plain"]
            nodes_.append(Node(nodes.popen(i, argv, env=env)))
        # training is under way once rank 0 has finished an epoch
        deadline = time.monotonic() + START_S
        while not re.search(r"epoch 2\b", nodes_[0].text()):
            if any(n.p.poll() is not None for n in nodes_):
                fail("a node ended before the link was cut:\n--- node 0\n%s\n--- node 1\n%s"
                     % (nodes_[0].text(), nodes_[1].text()))
            if time.monotonic() > deadline:
                fail("training did not get under way within %d s:\n%s" % (START_S, nodes_[0].text()))
            time.sleep(0.05)
        cut = time.monotonic()
        nodes.link_down(0)
        while any(n.p.poll() is None for n in nodes_) and time.monotonic() < cut + LIMIT_S:
            for n in nodes_:
                if n.ended is None and n.p.poll() is not None:
                    n.ended = time.monotonic() - cut
            time.sleep(0.05)
        for n in nodes_:
            if n.ended is None and n.p.poll() is not None:
                n.ended = time.monotonic() - cut
        hung = [i for i, n in enumerate(nodes_) if n.p.poll() is None]
        left = {i: _netns.ns_pids(nodes.ns[i]) for i in (0, 1)}
        nodes.close()
        for n in nodes_:
            for t in n.threads:
                t.join(5)
        report = "\n".join("--- node %d (exit %s)\n%s" % (i, n.p.returncode, n.text()[-4000:])
                           for i, n in enumerate(nodes_))
        if hung:
            fail("node(s) %s still running %d s after the link was cut\n%s" % (hung, LIMIT_S, report))
        for i, n in enumerate(nodes_):
            if n.p.returncode == 0:
                fail("node %d exited with 0 after the link was cut\n%s" % (i, report))
        for i in (0, 1):
            if left[i]:
                fail("processes left behind in node %d's namespace: %s\n%s" % (i, left[i], report))
        out0, out1 = nodes_[0].text(), nodes_[1].text()
        if not re.search(r"rank [23] \(host nbnode1, pid \d+\) has shown no sign of life for [\d.]+ s "
                         r"\(NABLA_LIVENESS_TIMEOUT=%d s\).*; silent as well: rank [23] \(host nbnode1, pid \d+\)"
                         % LIVENESS_S, out0):
            fail("node 0 does not name both ranks of node 1 (2 and 3) and their host\n" + report)
        if not re.search(r"the store is unreachable .* at 10\.213\.0\.1:%d .*; rank 0 runs on host nbnode0, pid \d+"
                         % PORT, out1):
            fail("node 1 does not name the store on rank 0 and its host\n" + report)
        first = [re.search(r"^nbrun: (rank \d+ .*)$", t, re.M) for t in (out0, out1)]
        if not all(first):
            fail("an nbrun does not say which rank failed first\n" + report)
        print("cut link: node 0 ended after %.1f s, node 1 after %.1f s (liveness limit %d s); "
              "nothing left in the namespaces" % (nodes_[0].ended, nodes_[1].ended, LIVENESS_S))
        for t in (out0, out1):
            for line in t.splitlines():
                if "no sign of life" in line or "store" in line or line.startswith("nbrun:"):
                    print("  " + line)


if __name__ == "__main__":
    main()
