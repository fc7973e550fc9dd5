"""DDP's dependencies point one way (Note [DDP hook points] in distributed/ddp.c).

The reducer's files (distributed/ddp.c, ddp_verify.c, ddp_buckets.c and
their headers ddp_reducer.h, ddp_buckets.h) include no feature's header
and name no feature: they call no function a feature file defines and
look at no feature's slot (NB__DDP_ZERO, ...) by name; features reach the
reducer only through its hook tables. Among all of distributed/ddp*.c,
"file A calls a function that file B defines" has no circle (the
reducer's three files taken as one), and no
feature file calls another feature's functions: a feature depends on the
reducer alone. A call is an identifier nb_... followed by "(" outside
comments and strings.

An optimizer is changed through optimizer verbs (optim/sharded.h, Note
[Sharded optimizer] in optim/sharded.c): no file of distributed/ includes
optim/internal.h, the optimizer's fields.
"""
import glob
import os
import re
import sys

SOURCE = os.environ.get("NABLA_SOURCE_DIR",
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIST = os.path.join(SOURCE, "distributed")
REDUCER = {"ddp.c", "ddp_verify.c", "ddp_buckets.c"}
REDUCER_HEADERS = {"ddp_reducer.h", "ddp_buckets.h"}
WRAPPER = "ddp_wrapper.c"  # the constructor: the reducer plus the features its options ask for


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def code_of(path):
    text = open(path).read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def defined(text):
    """Functions defined with external linkage: a definition at column 0
    whose line does not start with static."""
    names = set()
    for m in re.finditer(r"^(?!static\b)[A-Za-z_][\w \*]*?\b(nb_\w+)\s*\([^;{]*\)\s*\{", text, flags=re.M):
        names.add(m.group(1))
    return names


def main():
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(DIST, "ddp*.c")))
    for f in REDUCER | {WRAPPER}:
        if f not in files:
            fail("distributed/%s is missing: update this test with the layout" % f)
    features = [f for f in files if f not in REDUCER and f != WRAPPER]
    if len(features) < 5:
        fail("only %d feature files found in distributed/: %s" % (len(features), features))
    code = {f: code_of(os.path.join(DIST, f)) for f in files}
    owner = {}
    for f in files:
        for name in defined(code[f]):
            owner[name] = f
    if not any(owner.get(n) == "ddp_zero.c" for n in owner) or "nb_ddp_backward" not in owner:
        fail("the definition pattern found nothing (ddp_zero.c's functions, nb_ddp_backward): fix this test")
    calls = {}
    for f in files:
        called = set(re.findall(r"\b(nb_\w+)\s*\(", code[f]))
        calls[f] = {owner[n] for n in called if n in owner and owner[n] != f}

    # the reducer: its own files only, by call and by include
    for f in sorted(REDUCER | REDUCER_HEADERS):
        path = os.path.join(DIST, f)
        raw = open(path).read()
        for inc in re.findall(r'#include\s+"distributed/(ddp\w*\.h)"', raw):
            if inc not in REDUCER_HEADERS:
                fail("distributed/%s includes distributed/%s, a header of the features" % (f, inc))
        text = code_of(path)
        for slot in re.findall(r"\bNB__DDP_(?!FEATURES\b|FEATURE_LIST\b|CONFLICT_LIST\b)[A-Z_]+\b", text):
            if f != "ddp_reducer.h":
                fail("distributed/%s names the feature slot %s; the reducer calls features only "
                     "through their hook tables" % (f, slot))
        if f.endswith(".c"):
            for g in sorted(calls[f]):
                if g not in REDUCER:
                    bad = sorted(n for n in set(re.findall(r"\b(nb_\w+)\s*\(", code[f])) if owner.get(n) == g)
                    fail("distributed/%s (the reducer) calls %s of distributed/%s" % (f, ", ".join(bad), g))

    # features: the reducer only
    for f in features:
        for g in sorted(calls[f]):
            if g not in REDUCER:
                bad = sorted(n for n in set(re.findall(r"\b(nb_\w+)\s*\(", code[f])) if owner.get(n) == g)
                fail("distributed/%s calls %s of distributed/%s: a feature depends on the reducer alone"
                     % (f, ", ".join(bad), g))

    # no circle at all (the wrapper included; the reducer's files count as one)
    def node(f):
        return "the reducer" if f in REDUCER else f

    graph = {}
    for f in files:
        graph.setdefault(node(f), set()).update(node(g) for g in calls[f] if node(g) != node(f))
    calls = graph
    state = {}

    def visit(f, path):
        state[f] = "open"
        for g in sorted(calls[f]):
            if state.get(g) == "open":
                cycle = path[path.index(g):] + [g]
                fail("a circle of calls among distributed/ddp*.c: " + " -> ".join(cycle))
            if g not in state:
                visit(g, path + [g])
        state[f] = "done"

    for f in sorted(graph):
        if f not in state:
            visit(f, [f])

    # optimizer fields stay optim/'s
    for path in sorted(glob.glob(os.path.join(DIST, "*.[ch]")) + glob.glob(os.path.join(DIST, "*.cpp"))):
        if re.search(r'#include\s+"optim/internal\.h"', open(path).read()):
            fail("distributed/%s includes optim/internal.h: reach the optimizer through the verbs of "
                 "optim/sharded.h instead of its fields" % os.path.basename(path))
    print("ok: %d files, reducer %s, %d features, no circle" % (len(files), sorted(REDUCER), len(features)))


if __name__ == "__main__":
    main()
