#!/usr/bin/env python3
"""How long a 2-rank run takes to start under a flood of idle connections
to its store (Note [Admission under a flood] in distributed/store_server.c).

A thread holds --conns idle connections to the run's store, closes the
oldest and opens a new one --rate times a second,
and reopens at once those the store closed (at most --burst a tick), for as
long as the runs last: nothing leaves this host, and it stops by itself.
Each run starts `nbrun --nproc-per-node 2 --master-port PORT sh -c 'sleep
W; exec dist_scenario ok'` (join, one all-reduce, exit): nbrun listens on
the port from its start, so for W seconds (--warmup) the flood fills the
kernel's backlog before rank 0 serves the store. The row gives the run's
wall time less W. --restart adds runs whose first generation fails (after
W, rank 1 kills itself) under --max-restarts 1, so the restarted
generation must join under the same flood (its time is the whole run's
less W). The rows also say the exit code and how many summary lines the
store wrote on stderr.

--transport unix (the default, what a run on one node uses: Note [Store on
one node] in distributed/store_unix.c) floods the store's Unix-domain
socket, $NABLA_STORE_DIR or /tmp/nabla-<uid>/store-PORT.sock, as a process
of the same user (another user's connections never reach it); --transport
tcp sets NABLA_STORE_TRANSPORT=tcp and floods 127.0.0.1:PORT.

    python3 benchmarks/store_flood.py --bin build/bin --runs 3 --restart
"""
import argparse
import collections
import os
import select
import socket
import subprocess
import sys
import threading
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def unix_path(port):
    folder = os.environ.get("NABLA_STORE_DIR") or "/tmp/nabla-%d" % os.geteuid()
    return os.path.join(folder, "store-%d.sock" % port)


class Flood(threading.Thread):
    def __init__(self, port, conns, rate, burst, transport):
        super().__init__(daemon=True)
        self.port, self.conns, self.rate, self.burst = port, conns, rate, burst
        self.transport = transport
        self.stop = threading.Event()
        self.opened = 0
        self.peak = 0

    def connect(self):
        unix = self.transport == "unix"
        s = socket.socket(socket.AF_UNIX if unix else socket.AF_INET)
        s.settimeout(0.2)
        try:
            s.connect(unix_path(self.port) if unix else ("127.0.0.1", self.port))
        except OSError:
            s.close()
            return None
        self.opened += 1
        return s

    def run(self):
        held = collections.deque()
        tick = 1.0 / self.rate
        while not self.stop.is_set():
            t0 = time.monotonic()
            if held:  # the store closed some: they are reopened below
                readable, _, _ = select.select(list(held), [], [], 0)
                for s in readable:
                    held.remove(s)
                    s.close()
            if held:
                held.popleft().close()  # the churn: one a tick
            for _ in range(min(self.burst, self.conns - len(held))):
                s = self.connect()
                if s is None:
                    break
                held.append(s)
            self.peak = max(self.peak, len(held))
            time.sleep(max(0.0, tick - (time.monotonic() - t0)))
        for s in held:
            s.close()


def run_once(cmd, env, limit):
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=limit)
    return time.monotonic() - t0, p.returncode, p.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/bin", help="folder of nbrun (dist_scenario is in ../tests)")
    ap.add_argument("--conns", type=int, default=500)
    ap.add_argument("--rate", type=float, default=20.0, help="connections reopened a second")
    ap.add_argument("--burst", type=int, default=20, help="connections opened a tick at most")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--restart", action="store_true", help="also a run restarted once under the flood")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of flood before rank 0 starts")
    ap.add_argument("--transport", choices=("unix", "tcp"), default="unix",
                    help="the store's socket on one node (tcp: NABLA_STORE_TRANSPORT=tcp)")
    a = ap.parse_args()
    nbrun = os.path.join(a.bin, "nbrun")
    scenario = os.path.join(a.bin, "..", "tests", "dist_scenario")
    env = dict(os.environ, NABLA_JOIN_TIMEOUT="60")
    if a.transport == "tcp":
        env["NABLA_STORE_TRANSPORT"] = "tcp"
    w = a.warmup
    cases = [("join", ["sh", "-c", "sleep %g; exec %s ok" % (w, scenario)], [])] * a.runs
    if a.restart:
        script = ('if [ "$NABLA_RESTART_COUNT" = 0 ]; then sleep %g; exec %s killed; else exec %s ok; fi'
                  % (w, scenario, scenario))
        cases += [("restart", ["sh", "-c", script], ["--max-restarts", "1"])] * a.runs
    print("| run | flood held (peak) | seconds to the end | exit | store summary lines |")
    print("|---|---|---|---|---|")
    worst = 0
    for name, prog, extra in cases:
        port = free_port()
        flood = Flood(port, a.conns, a.rate, a.burst, a.transport)
        cmd = [nbrun, "--nproc-per-node", "2", "--master-port", str(port)] + extra + prog
        flood.start()
        try:
            secs, code, err = run_once(cmd, env, 120)
            secs -= w
        finally:
            flood.stop.set()
            flood.join()
        lines = err.count("that did not prove they belong to the run")
        if name == "restart" and "restart 1 of 1" not in err:
            code = code or 99
        print("| %s | %d | %.2f | %d | %d |" % (name, flood.peak, secs, code, lines))
        if code != 0:
            sys.stderr.write(err[-3000:])
        worst = max(worst, code)
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
