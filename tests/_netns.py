"""Two "machines" on one host, for the multi-node tests (not a test: ctest
skips files whose name starts with an underscore).

Two network namespaces, nbmn<pid>a and nbmn<pid>b, joined by a veth pair
(nbv<pid>a in the first, nbv<pid>b in the second) with the addresses
10.213.0.1/24 and 10.213.0.2/24; each namespace has its own loopback and
nothing else, so a connection between the two can only cross the veth.
Commands started with Nodes.popen run in a namespace (ip netns exec) and in
a UTS namespace of their own whose hostname is nbnode0 or nbnode1, so that
the messages naming a host tell the two nodes apart.

Started commands get SIGKILL if the test process dies (PR_SET_PDEATHSIG;
nbrun's ranks die with nbrun). Every name carries this process's pid (parallel runs do not collide; the
subnet is the same in every pair, which is fine: it exists only inside
them). Nodes is a context manager: leaving it, even on an exception or
SIGTERM, kills whatever still runs in the namespaces and deletes them
(deleting a namespace deletes its end of the veth, and with it the pair).
Namespaces left by a run that was killed with SIGKILL are deleted by the
next run (their pid no longer exists).

Needs the ip tool (iproute2: without it the tests skip, and fail under
CI=true, as for any test dependency: _programs.skip) and the right to make
a network namespace (root, CAP_SYS_ADMIN). Where `ip netns add` is refused,
the tests end as skipped (77) with ip's words, under CI=true as well: that
is a property of the machine (not root, a container without the
capability), not a package `make test-deps` would install."""
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _programs  # noqa: E402

ADDR = ("10.213.0.1", "10.213.0.2")


def secret_file(directory, name="secret"):
    """A store secret both nodes share, as a user would give it: a file of
    mode 0600 named by NABLA_STORE_SECRET_FILE (several nodes need one)."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    return path
PREFIX = 24


def _ip(*args, check=True, timeout=10):
    p = subprocess.run(["ip"] + list(args), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError("ip %s: %s" % (" ".join(args), p.stderr.strip()))
    return p


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ns_pids(ns):
    """Pids of the processes that run in namespace ns."""
    p = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def _kill_and_delete(ns):
    for pid in ns_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while ns_pids(ns) and time.monotonic() < deadline:
        time.sleep(0.05)
    _ip("netns", "del", ns, check=False)


def _remove_stale():
    p = _ip("netns", "list", check=False)
    for line in p.stdout.splitlines():
        m = re.match(r"(nbmn(\d+)[ab])\b", line)
        if m and (int(m.group(2)) == os.getpid() or not _alive(int(m.group(2)))):
            _kill_and_delete(m.group(1))


def _die_with_parent():
    """In the child before exec: SIGKILL when the test dies, even by SIGKILL
    (nbrun's own processes die with nbrun)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def skip(reason):
    print("skipped: network namespaces cannot be made here (%s)" % reason)
    sys.exit(77)


def _tool(name):
    if not shutil.which(name):
        _programs.skip("%s is not installed (iproute2, util-linux: make test-deps)" % name)


class Nodes:
    """The two namespaces; node i has address ADDR[i]."""

    def __init__(self):
        tag = str(os.getpid())
        self.ns = ("nbmn%sa" % tag, "nbmn%sb" % tag)
        self.veth = ("nbv%sa" % tag, "nbv%sb" % tag)
        self.procs = []
        self._old_term = None

    def __enter__(self):
        _tool("ip")
        _tool("unshare")
        _remove_stale()
        p = _ip("netns", "add", self.ns[0], check=False)
        if p.returncode != 0:
            skip("ip netns add, as uid %d: %s" % (os.geteuid(), p.stderr.strip()))
        self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            _ip("netns", "add", self.ns[1])
            _ip("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
            for i in (0, 1):
                _ip("link", "set", self.veth[i], "netns", self.ns[i])
                _ip("-n", self.ns[i], "addr", "add", "%s/%d" % (ADDR[i], PREFIX), "dev", self.veth[i])
                _ip("-n", self.ns[i], "link", "set", "lo", "up")
                _ip("-n", self.ns[i], "link", "set", self.veth[i], "up")
            self.wait_up()
        except BaseException:
            self.close()
            raise
        return self

    def _on_term(self, signum, frame):
        self.close()
        sys.exit(128 + signum)

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for ns in self.ns:
            _kill_and_delete(ns)
        self.procs = []
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def wait_up(self, timeout=5.0):
        """Waits until both ends of the veth report carrier (LOWER_UP)."""
        deadline = time.monotonic() + timeout
        while True:
            states = [_ip("-n", self.ns[i], "link", "show", self.veth[i]).stdout for i in (0, 1)]
            if all("LOWER_UP" in s for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the veth pair did not come up: %s" % " / ".join(states))
            time.sleep(0.05)

    def command(self, i, argv):
        """argv run in node i's namespace, with hostname nbnode<i>."""
        return ["ip", "netns", "exec", self.ns[i], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', "nbnode%d" % i] + list(argv)

    def popen(self, i, argv, env=None):
        p = subprocess.Popen(self.command(i, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True, env=env, preexec_fn=_die_with_parent)
        self.procs.append(p)
        return p

    def link_down(self, i=0):
        _ip("-n", self.ns[i], "link", "set", self.veth[i], "down")

    def tx_bytes(self, i):
        """Bytes node i has sent through its end of the veth."""
        out = _ip("-n", self.ns[i], "-s", "-j", "link", "show", self.veth[i]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])
