"""libnabla.so exports its declared surface and nothing else (include/nabla/api.h).

- Every function declared at file scope in include/nabla/*.h carries
  NB_API (static inline definitions aside): a public function declared
  without it would be hidden in libnabla.so, linkable from libnabla.a only.
- Every NB_API function is exported by libnabla.so (nm -D --defined-only).
- The library exports no other nb_/nb__ symbol, except the internals
  marked NB_PLUGIN_API in the internal headers (the CUDA plugin's short
  list, at most 40), each of which is exported.
- It exports nothing that is not an nb_ name: no C++ standard library
  instantiation or typeinfo (std::), which the Gloo shim makes with
  default visibility whatever -fvisibility says; cmake/nabla.map keeps
  them local.
- The public tensor struct shows no private field: its members are the
  public ones listed here and `priv`, the opaque pointer to the library's
  bookkeeping (Note [Tensor bookkeeping] in tensor/internal.h). A new
  member is a decision about the public interface: add it here too.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import BUILD, SOURCE, fail, skip  # noqa: E402

PLUGIN_MAX = 40
TENSOR_FIELDS = ["dtype", "device", "ndim", "shape", "strides", "data", "base", "ctx", "name",
                 "requires_grad", "grad", "node", "priv"]
INTERNAL_DIRS = ("tensor", "tensor/cuda", "tensor/cpu", "distributed", "autograd", "nn", "optim",
                 "checkpoint", "data", "models", "monitor", "util")


def blank(m):
    return re.sub(r"[^\n]", " ", m.group(0))


def code_of(text):
    """The text with comments, strings, C++ guards and preprocessor lines blanked."""
    t = re.sub(r"/\*.*?\*/", blank, text, flags=re.S)
    t = re.sub(r"//[^\n]*", blank, t)
    t = re.sub(r'"(?:\\.|[^"\\\n])*"', blank, t)
    t = re.sub(r"#ifdef __cplusplus.*?#endif", blank, t, flags=re.S)
    return re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", blank, t, flags=re.M)


def statements(text):
    """File-scope statements ending in ";" (brace bodies and what precedes
    them, definitions and struct bodies, left out)."""
    t = code_of(text)
    out, depth, start = [], 0, 0
    for i, c in enumerate(t):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                start = i + 1
        elif c == ";" and depth == 0:
            out.append(t[start:i].strip())
            start = i + 1
    return [s for s in out if s]


def declared(text):
    """[(name, marks)] for each function declared at file scope: marks is
    the set of NB_* words before its name."""
    found = []
    for st in statements(text):
        if re.match(r"(typedef|static)\b", st):
            continue
        for m in re.finditer(r"\b(nb_\w+)\s*\(", st):
            before = st[:m.start()].rstrip()
            if before.endswith("(") or before.endswith("(*"):
                continue  # a parameter or a pointer to function
            found.append((m.group(1), set(re.findall(r"\bNB_[A-Z_]+\b", before))))
            break
    return found


def exported(lib):
    p = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True)
    if p.returncode != 0:
        fail("nm -D %s failed: %s" % (lib, p.stderr))
    return {line.split()[-1] for line in p.stdout.splitlines() if len(line.split()) >= 3}


def demangled(names):
    """The C++ spelling of names (c++filt), or the names where it is missing."""
    if not shutil.which("c++filt"):
        return names
    p = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    out = p.stdout.splitlines()
    return out if p.returncode == 0 and len(out) == len(names) else names


def tensor_fields():
    text = code_of(open(os.path.join(SOURCE, "include", "nabla", "tensor.h")).read())
    m = re.search(r"struct nb_tensor \{(.*?)\};", text, flags=re.S)
    if not m:
        fail("include/nabla/tensor.h: no struct nb_tensor { ... }: fix this test")
    return [re.search(r"(\w+)\s*(?:\[[^\]]*\])?\s*$", d).group(1)
            for d in m.group(1).split(";") if d.strip()]


def main():
    fields = tensor_fields()
    if fields != TENSOR_FIELDS:
        fail("struct nb_tensor (include/nabla/tensor.h) has the members %s, not %s: the library's "
             "own bookkeeping goes behind priv (struct nb__tensor_priv, tensor/internal.h)"
             % (", ".join(fields), ", ".join(TENSOR_FIELDS)))
    public = {}
    for path in sorted(glob.glob(os.path.join(SOURCE, "include", "nabla", "*.h"))):
        for name, marks in declared(open(path).read()):
            rel = "include/nabla/" + os.path.basename(path)
            if "NB_API" not in marks:
                fail("%s declares %s without NB_API: mark it (include/nabla/api.h), or libnabla.so "
                     "will not export it" % (rel, name))
            public[name] = rel
    if len(public) < 300:
        fail("found only %d NB_API functions in include/nabla/*.h: the parser is broken" % len(public))
    plugin = {}
    for d in INTERNAL_DIRS:
        for path in sorted(glob.glob(os.path.join(SOURCE, d, "*.h"))):
            for name, marks in declared(open(path).read()):
                rel = os.path.relpath(path, SOURCE)
                if "NB_API" in marks:
                    fail("%s marks %s NB_API: only include/nabla/ declares the public interface; "
                         "an internal the CUDA plugin calls is NB_PLUGIN_API" % (rel, name))
                if "NB_PLUGIN_API" in marks:
                    plugin[name] = rel
    if len(plugin) > PLUGIN_MAX:
        fail("%d internals are marked NB_PLUGIN_API (at most %d): %s"
             % (len(plugin), PLUGIN_MAX, ", ".join(sorted(plugin))))

    lib = os.path.join(BUILD, "lib", "libnabla.so")
    if not os.path.exists(lib):
        fail("%s is not built" % lib)
    if not shutil.which("nm"):
        skip("nm (binutils) is not installed")
    syms = exported(lib)
    missing = sorted(n for n in public if n not in syms)
    if missing:
        fail("libnabla.so does not export %d NB_API functions: %s"
             % (len(missing), ", ".join("%s (%s)" % (n, public[n]) for n in missing[:20])))
    missing = sorted(n for n in plugin if n not in syms)
    if missing:
        fail("libnabla.so does not export the NB_PLUGIN_API internals %s" % ", ".join(missing))
    extra = sorted(s for s in syms if s.startswith("nb") and s not in public and s not in plugin)
    if extra:
        fail("libnabla.so exports %d symbols that no header marks NB_API or NB_PLUGIN_API: %s"
             % (len(extra), ", ".join(extra[:30])))
    foreign = sorted(s for s in syms if not s.startswith("nb_"))
    if foreign:
        fail("libnabla.so exports %d symbols that are not nb_ names (cmake/nabla.map should keep "
             "them local): %s" % (len(foreign), "; ".join(demangled(foreign[:10]))))
    internal = sorted(s for s in syms if s.startswith("nb__"))
    print("ok: %d NB_API functions exported, %d internals for the CUDA plugin%s"
          % (len(public), len(internal), (": " + ", ".join(internal)) if internal else ""))


if __name__ == "__main__":
    main()
