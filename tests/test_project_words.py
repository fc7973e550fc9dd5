"""The project's files speak of the project, and its docs of the code as it is.

A reader of nabla has the repository and nothing beside it. This test keeps
out of every tracked text file:

* paths outside the repository (a sibling folder reached with ../, the
  directories of the machine the project is developed on), which no user
  has;
* the vocabulary of the environment the project happened to be measured in
  rather than of the project (the words the patterns below list), in docs,
  scripts and the README;
* the names of scripts that were renamed or removed (RETIRED);
* sentences the code has made false and that came back before: the CUDA
  backend said not to exist, torchrun shown running a binary without
  --no_python.

It also checks that the README's quick start states how long each command
takes, and that the demo's time there is that of a fresh clone, so longer
than the training alone that docs/examples.md times.
"""
import os
import re
import subprocess
import sys

SOURCE = os.environ.get("NABLA_SOURCE_DIR",
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SELF = os.path.relpath(os.path.abspath(__file__), SOURCE)

TEXT_EXT = {".md", ".sh", ".py", ".c", ".h", ".cpp", ".cu", ".cuh", ".cmake", ".txt", ".in", ".json"}
PROSE_EXT = {".md", ".sh", ".py", ".txt", ""}  # docs, scripts, Makefile, .ci/run

# Scripts that were renamed or removed (what they became), so that no text
# sends a reader to a file that is not there, even as "then named ...".
RETIRED = {
    "gpu_session.sh": "benchmarks/gpu_check.sh",
    "tools/fetch_debs.sh": "dev/fetch_debs.sh",
    "tools/unpack_debs.sh": "dev/unpack_debs.sh",
    "tools/cuda_emu": "dev/cuda_emu",
    "gen_stub.py": "the CUDA plugin (tensor/cuda_plugin.c)",
}

# (pattern, why): anywhere in a tracked text file
EVERYWHERE = [
    (r"\.\./shared\b", "names a folder outside the repository"),
    (r"(?<![\w.])/work/", "names a folder outside the repository"),
    (r"\blent\b", "speaks of borrowed machines: say 'a machine with a GPU'"),
    (r"\bcarr(?:y|ied)\s*\[", "speaks of carried folders"),
    (r"\bother helpers\b", "speaks of helpers: say 'other builds and tests'"),
    (r"CUDA\s+backend\s+is\s+not\s+in\s+the\s+library", "the CUDA backend exists"),
    (r"until\s+the\s+CUDA\s+backend", "the CUDA backend exists"),
    (r"has\s+not\s+yet\s+run\s+on\s+a\s+GPU", "the CUDA backend has run on a GPU"),
] + [(r"(?<![\w/])" + re.escape(old) + r"\b", f"names a retired script: it is {new} now")
     for old, new in RETIRED.items()]
# only in prose and scripts (C code may name a call made on a CUDA device)
IN_PROSE = [
    (r"\bsessions?\b", "speaks of sessions: say what was run, when and where"),
    (r"\bdevice\s+(?:tool|calls?)\b", "speaks of a tool for borrowing a GPU, or of its calls"),
    (r"\bdevice[\s-]+time\b", "speaks of borrowed GPU time: say what was run and how long it took"),
]


def tracked_files():
    try:
        out = subprocess.run(["git", "-C", SOURCE, "ls-files", "-z"], capture_output=True, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n]
        if names:
            return names
    except (OSError, subprocess.CalledProcessError):
        pass
    names = []  # a source tree without git: every file but build output
    for root, dirs, files in os.walk(SOURCE):
        dirs[:] = [d for d in dirs if not d.startswith((".", "build", "_install"))]
        names += [os.path.relpath(os.path.join(root, f), SOURCE) for f in files]
    return names


def scan(names):
    problems = []
    for name in names:
        if name == SELF:
            continue
        ext = os.path.splitext(name)[1]
        base = os.path.basename(name)
        if ext not in TEXT_EXT and base not in ("Makefile", "run"):
            continue
        path = os.path.join(SOURCE, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        rules = list(EVERYWHERE)
        if ext in PROSE_EXT or base in ("Makefile", "run"):
            rules += IN_PROSE
        text = "\n".join(lines)
        for pattern, why in rules:  # whole text: a sentence may break across lines
            for m in re.finditer(pattern, text, re.I):
                i = text.count("\n", 0, m.start()) + 1
                problems.append(f"{name}:{i}: '{' '.join(m.group(0).split())}' {why}")
    return problems


def torchrun_lines(names):
    """torchrun runs a binary only with --no_python (--no-python in 2.x)."""
    problems = []
    for name in names:
        if not name.endswith(".md"):
            continue
        text = open(os.path.join(SOURCE, name), encoding="utf-8").read()
        joined = re.sub(r"\\\n", " ", text).split("\n")
        for line in joined:
            if re.match(r"\s*(?:\$\s*)?torchrun\s", line) and not re.search(r"--no[-_]python", line):
                problems.append(f"{name}: '{line.strip()}' runs a binary without --no_python")
    return problems


def minutes(text):
    """(low, high) minutes of '~3 min', 'about 4 minutes', '3-4 min'; None if absent."""
    m = re.search(r"(?:~|about\s+)?(\d+(?:\.\d+)?)(?:\s*-\s*(\d+(?:\.\d+)?))?\s*min", text)
    if not m:
        return None
    lo = float(m.group(1))
    return lo, float(m.group(2)) if m.group(2) else lo


def quick_start():
    problems = []
    readme = open(os.path.join(SOURCE, "README.md"), encoding="utf-8").read()
    m = re.search(r"## Quick start\n(.*?)\n## ", readme, re.S)
    if not m:
        return ["README.md: no '## Quick start' section"]
    block = m.group(1)
    times = {}
    for cmd in ("make demo", "make test"):
        line = next((l for l in block.split("\n") if l.startswith(cmd)), None)
        if line is None:
            problems.append(f"README.md quick start: no '{cmd}' line")
            continue
        t = minutes(line)
        if t is None:
            problems.append(f"README.md quick start: '{line.strip()}' does not say how long it takes")
        times[cmd] = t
    # the training alone, as docs/examples.md times it
    examples = open(os.path.join(SOURCE, "docs", "examples.md"), encoding="utf-8").read()
    t = re.search(r"takes about (\d+) seconds", examples)
    if not t:
        problems.append("docs/examples.md: the demo's training time ('takes about N seconds') is gone")
    elif times.get("make demo"):
        train_min = int(t.group(1)) / 60
        if times["make demo"][0] <= train_min:
            problems.append(f"README.md: 'make demo' takes {times['make demo'][0]} min, but the training "
                            f"alone takes {train_min:.1f} (docs/examples.md): a fresh clone builds first")
    return problems


def main():
    names = tracked_files()
    if len(names) < 50:
        print(f"FAIL: only {len(names)} files found under {SOURCE}")
        return 1
    problems = scan(names) + torchrun_lines(names) + quick_start()
    for p in problems:
        print("FAIL: " + p)
    if problems:
        return 1
    print(f"ok: {len(names)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
