"""Elastic membership: nbrun --nnodes MIN:MAX.

1. A late node joins at the next restart (two nbruns on this host,
   loopback): node 0 starts alone once --rdzv-timeout has passed (world
   size 2, generation 0); node 1, started after that, says it waits; when
   generation 0 fails (its rank 1 exits with 3), generation 1 has both
   nodes, ranks renumbered 0..3 with a new store port and run id, and ends
   well; node 1 then exits 0 too.
2. A cut link (two network namespaces, tests/_netns.py): train_gpt on two
   nodes of two processes, a checkpoint every 5 steps, --resume auto
   --keep-batch global. Once training is under way, node 1's veth is set
   down (packets vanish). Node 0's ranks name the silent peers at the
   liveness limit, its nbrun restarts, waits --rdzv-timeout for node 1, and
   continues alone with world size 2 from the newest checkpoint, to the last
   step, exit 0; node 1 fails (its ranks lose the store, then its nbrun the
   rendezvous), and nothing is left in either namespace.
   Skipped (77) only where a network namespace cannot be made.
"""
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _netns  # noqa: E402
from _programs import BIN, Node, fail  # noqa: E402

LIVENESS_S = 3
RDZV_S = 6


def nbrun(node_rank, port, addr, extra, program, spawn=None, env=None):
    argv = [os.path.join(BIN, "nbrun"), "--nnodes", "1:2", "--node-rank", str(node_rank), "--nproc-per-node", "2",
            "--master-addr", addr, "--master-port", str(port)] + extra + program
    if spawn:
        return Node(spawn(argv))
    return Node(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))


def test_late_node(tmp, env):
    port = 29400 + os.getpid() % 500
    script = ("echo \"gen $NABLA_RESTART_COUNT rank $RANK of $WORLD_SIZE group $GROUP_RANK port $MASTER_PORT "
              "id $NABLA_RUN_ID\"; "
              "if [ $NABLA_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then "
              "while [ ! -e %s/go ]; do sleep 0.05; done; exit 3; fi; sleep 0.3" % tmp)
    prog = ["sh", "-c", script]
    extra = ["--rdzv-timeout", "1", "--max-restarts", "1"]
    n0 = nbrun(0, port, "127.0.0.1", extra, prog, env=env)
    n0.wait_for(r"^\[rank 1\] gen 0 rank 1 of 2 group 0 ", 30, "node 0 alone in generation 0")
    n1 = nbrun(1, port, "127.0.0.1", extra, prog, env=env)
    n1.wait_for(r"^nbrun: generation 0 started without this node; it joins at the next restart$", 30,
                "node 1, late", [n0])
    open(os.path.join(tmp, "go"), "w").close()
    for n in (n0, n1):
        try:
            n.p.wait(60)
        except subprocess.TimeoutExpired:
            n0.p.kill(), n1.p.kill()
            fail("still running after 60 s:\n--- node 0\n%s\n--- node 1\n%s" % (n0.text(), n1.text()))
        for t in n.threads:
            t.join(5)
    report = "--- node 0 (exit %s)\n%s\n--- node 1 (exit %s)\n%s" % (n0.p.returncode, n0.text(), n1.p.returncode,
                                                                     n1.text())
    if n0.p.returncode != 0 or n1.p.returncode != 0:
        fail("the late node's run did not end well\n" + report)
    out = n0.text() + n1.text()
    for pattern in (r"nbrun: generation 0: 1 node of --nnodes 1:2 after [\d.]+ s, world size 2 \(the others did "
                    r"not join within --rdzv-timeout; they join at the next restart\)",
                    r"nbrun: restart 1 of 1 after: rank 1 \(local rank 1, pid \d+\) exited with code 3",
                    r"nbrun: generation 1: 2 nodes of --nnodes 1:2 after [\d.]+ s, world size 4\n",
                    r"nbrun: generation 1: this node is member 2 of 2, ranks 2\.\.3 of world size 4"):
        if not re.search(pattern, out):
            fail("no match for %r\n%s" % (pattern, report))
    ports = {}
    for rank, g, world, group, port_, rid in re.findall(
            r"^\[rank (\d)\] gen (\d) rank \1 of (\d) group (\d) port (\d+) id (\S+)$", out, re.M):
        ports.setdefault(g, set()).add((world, port_, rid))
        if g == "1" and group != str(int(rank) // 2):
            fail("generation 1: rank %s on group %s\n%s" % (rank, group, report))
    if len(ports.get("0", ())) != 1 or len(ports.get("1", ())) != 1 or ports["0"] == ports["1"]:
        fail("the generations' worlds, store ports and run ids: %s\n%s" % (ports, report))
    (w0, p0, id0), (w1, p1, id1) = next(iter(ports["0"])), next(iter(ports["1"]))
    if (w0, w1) != ("2", "4") or p0 == p1 or id1 != id0 + "-r1":
        fail("generation 0 %s, generation 1 %s\n%s" % ((w0, p0, id0), (w1, p1, id1), report))
    print("late node: generation 0 ran without it (world size 2), it joined generation 1 (world size 4, "
          "ranks 0..3, a new store port and run id)")


def test_cut(tmp, env):
    port = 29615
    args = ["--layers", "2", "--heads", "2", "--width", "32", "--seq-len", "32", "--batch-size", "2",
            "--eval-interval", "0", "--eval-windows", "16", "--sample-len", "0", "--progress", "plain",
            "--log-interval", "1", "--steps", "300", "--ckpt-interval", "5", "--ckpt-dir", os.path.join(tmp, "ck"),
            "--resume", "auto", "--keep-batch", "global"]
    extra = ["--rdzv-timeout", str(RDZV_S), "--max-restarts", "2"]
    prog = [os.path.join(BIN, "train_gpt")] + args
    with _netns.Nodes() as nodes:
        env = dict(env, NABLA_STORE_SECRET_FILE=_netns.secret_file(tmp, "netns_secret"))
        ns = [nbrun(i, port, _netns.ADDR[0], extra, prog, spawn=lambda a, i=i: nodes.popen(i, a, env=env))
              for i in (0, 1)]
        ns[0].wait_for(r"^\[rank 0\] 4 processes with DDP", 40, "both nodes in generation 0", [ns[1]])
        ns[0].wait_for(r"^\[rank 0\] step 12/300 ", 40, "training under way", [ns[1]])
        cut = time.monotonic()
        nodes.link_down(1)
        limit = LIVENESS_S + RDZV_S + 60
        while ns[0].p.poll() is None and time.monotonic() < cut + limit:
            time.sleep(0.1)
        t0 = time.monotonic() - cut
        while ns[1].p.poll() is None and time.monotonic() < cut + limit:
            time.sleep(0.1)
        hung = [i for i in (0, 1) if ns[i].p.poll() is None]
        left = {i: _netns.ns_pids(nodes.ns[i]) for i in (0, 1)}
        nodes.close()
        for n in ns:
            for t in n.threads:
                t.join(5)
        report = "\n".join("--- node %d (exit %s)\n%s" % (i, n.p.returncode,
                                                          re.sub(r"(?m)^\[rank \d\] step \d+/300 .*\n", "",
                                                                 n.text())[-5000:])
                           for i, n in enumerate(ns))
        if hung:
            fail("node(s) %s still running %d s after the cut\n%s" % (hung, limit, report))
        if ns[0].p.returncode != 0:
            fail("node 0 did not continue alone to the end\n" + report)
        if ns[1].p.returncode == 0:
            fail("node 1 exited with 0 though its link was cut\n" + report)
        out0 = ns[0].text()
        for pattern in (r"nbrun: restart 1 of 2 after: rank \d \(local rank \d, pid \d+\) exited with code 1",
                        r"nbrun: generation 1: 1 node of --nnodes 1:2 after %d\.\d s, world size 2 " % RDZV_S,
                        r"^\[rank 0\] world size 4 -> 2 since the checkpoint, --keep-batch global: the global "
                        r"batch stays 8 sequences, now 4 per process \(was 2\)$",
                        r"^\[rank 0\] --resume auto: from %s$" % re.escape(os.path.join(tmp, "ck", "ckpt.safetensors")),
                        r"^\[rank 0\] checkpoint: .* \(step 300\)$"):
            if not re.search(pattern, out0, re.M):
                fail("node 0: no match for %r\n%s" % (pattern, report))
        for i in (0, 1):
            if left[i]:
                fail("processes left behind in node %d's namespace: %s\n%s" % (i, left[i], report))
        last = [l for l in ns[1].text().splitlines() if l.startswith("nbrun:")][-1:]
        print("cut link: node 0 continued alone after the %d s rendezvous and ended after %.1f s; node 1 "
              "exited with %d (%s)" % (RDZV_S, t0, ns[1].p.returncode, last[0] if last else ""))


def main():
    env = dict(os.environ, NABLA_LIVENESS_TIMEOUT=str(LIVENESS_S), NABLA_PG_TIMEOUT="60", NABLA_JOIN_TIMEOUT="30",
               NABLA_STALL_WARNING="0", NBRUN_GRACE="5", OPENBLAS_NUM_THREADS="1")
    env.pop("NABLA_RUN_ID", None)
    with tempfile.TemporaryDirectory(prefix="nb_test_elastic_") as tmp:
        env["NABLA_STORE_SECRET_FILE"] = _netns.secret_file(tmp)
        test_late_node(tmp, env)
        test_cut(tmp, env)
    print("ok")


if __name__ == "__main__":
    main()
