"""The library's layers and the CUDA plugin's boundary (docs/design.md, Note
[CUDA plugin] in tensor/cuda_plugin.h). Read from the sources, so it holds
in a build without CUDA too. A call is an identifier nb_... followed by "("
outside comments and strings.

- tensor/ is the bottom: its files (tensor/cpu/ and tensor/cuda/ included)
  include headers of nabla/ and tensor/ only, never of distributed/,
  autograd/, nn/, optim/ or the others above it.
- Nothing above tensor/ branches on the device: the layers, the optimizers
  (optim/) and SyncBatchNorm (distributed/sync_batch_norm.c) include no
  header of tensor/cpu/ or tensor/cuda/, call no CPU or CUDA kernel
  (nb__cpu_*, nb__cuda_*) and name no device type (NB_DEVICE_CPU,
  NB_DEVICE_CUDA): they call ops, or a kernel through the backend table.
- The plugin (tensor/cuda/ and distributed/pg_nccl.c) calls of libnabla's
  functions only those libnabla.so exports: declared NB_API in
  include/nabla/ or NB_PLUGIN_API in an internal header. Its linker says so
  in a build with CUDA; this says so everywhere.
- Kernels call no op front end: the plugin calls no function of nabla/ops.h,
  nabla/autograd.h, nabla/nn.h or nabla/optim.h, and of nabla/tensor.h only
  its facts (nb_numel, nb_shape_str, ...), never a function that makes,
  copies, writes or reads a tensor.
- libnabla calls nothing of the plugin's by name except through the table
  (tensor/cuda_plugin.c defines the few names both have).
"""
import glob
import os
import re
import sys

SOURCE = os.environ.get("NABLA_SOURCE_DIR",
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = ["nn", "optim", "models", "data", "checkpoint", "autograd", "monitor"]
NEUTRAL = ["nn/*.c", "optim/*.c", "distributed/sync_batch_norm.c"]
PLUGIN = ["tensor/cuda/*.c", "tensor/cuda/*.cu", "tensor/cuda/*.cpp", "tensor/cuda/*.h",
          "tensor/cuda/*.cuh", "distributed/pg_nccl.c"]
TENSOR_FACTS = {"nb_numel", "nb_is_contiguous", "nb_is_leaf", "nb_same_shape", "nb_shape_str",
                "nb_normalize_dim"}
NO_FRONT_ENDS = ["ops.h", "autograd.h", "nn.h", "optim.h"]


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def files(patterns):
    out = []
    for p in patterns:
        out += glob.glob(os.path.join(SOURCE, p))
    return sorted(set(out))


def rel(path):
    return os.path.relpath(path, SOURCE)


def code_of(path):
    text = open(path, errors="replace").read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def includes(path):
    return re.findall(r'^\s*#\s*include\s+"([^"]+)"', open(path, errors="replace").read(), flags=re.M)


def calls(text):
    """Names called in text; a prototype at column 0 declares, it does not call."""
    text = re.sub(r"^(?![\s#])[A-Za-z_][\w \*]*?\bnb_\w+\s*\([^;{]*\)[^;{]*;", " ", text, flags=re.M)
    return set(re.findall(r"\b(nb_\w+)\s*\(", text))


def defined(text):
    """Functions defined with external linkage: a definition at column 0
    whose line does not start with static."""
    return set(m.group(1) for m in re.finditer(
        r'^(?!static\b)(?:extern "" )?[A-Za-z_][\w \*]*?\b(nb_\w+)\s*\([^;{]*\)\s*\{', text, flags=re.M))


def marked(paths, mark):
    """Names declared at file scope with `mark` before them in these headers."""
    names = set()
    for p in paths:
        text = re.sub(r"\\\n", " ", code_of(p))
        for m in re.finditer(r"\b%s\b[^;{}()]*?\b(nb_\w+)\s*\(" % mark, text):
            names.add(m.group(1))
    return names


def main():
    tensor = files(["tensor/*.[ch]", "tensor/cpu/*.[ch]"] + PLUGIN[:-1])
    if len(tensor) < 40:
        fail("found only %d files in tensor/: fix this test" % len(tensor))
    for f in tensor:
        for inc in includes(f):
            top = inc.split("/")[0]
            if "/" in inc and top not in ("nabla", "tensor"):
                fail("%s includes %s: tensor/ is the bottom layer and includes only nabla/ and "
                     "tensor/ headers" % (rel(f), inc))

    neutral = files(NEUTRAL)
    if len(neutral) < 10:
        fail("found only %d files of nn/, optim/ and sync_batch_norm.c: fix this test" % len(neutral))
    for f in neutral:
        for inc in includes(f):
            if inc.startswith("tensor/cpu/") or inc.startswith("tensor/cuda/"):
                fail("%s includes %s: above tensor/, code reaches kernels through the backend table "
                     "(tensor/backend.h), never a device's headers" % (rel(f), inc))
        text = code_of(f)
        for n in sorted(calls(text)):
            if n.startswith("nb__cpu_") or n.startswith("nb__cuda_"):
                fail("%s calls %s: a device's kernel, called above tensor/" % (rel(f), n))
        m = re.search(r"\bNB_DEVICE_(CPU|CUDA|META)\b", text)
        if m:
            fail("%s names %s: nothing above tensor/ branches on the device" % (rel(f), m.group(0)))

    plugin = files(PLUGIN)
    if not any(f.endswith("backend.c") for f in plugin) or len(plugin) < 15:
        fail("the plugin's files were not found (%d): fix this test" % len(plugin))
    plugin_code = {f: code_of(f) for f in plugin}
    plugin_defs = set()
    for t in plugin_code.values():
        plugin_defs |= defined(t)
    lib_files = [f for f in files(["tensor/*.c", "tensor/cpu/*.c", "autograd/*.c", "nn/*.c", "optim/*.c",
                                   "checkpoint/*.c", "data/*.c", "distributed/*.c", "distributed/*.cpp",
                                   "models/*.c", "monitor/*.c", "util/*.c"]) if f not in plugin]
    lib_code = {f: code_of(f) for f in lib_files}
    lib_defs = {}
    for f, t in lib_code.items():
        for n in defined(t):
            lib_defs.setdefault(n, f)
    if "nb__empty" not in lib_defs or "nb__cuda_gemm" not in plugin_defs:
        fail("the definition pattern found nothing (nb__empty, nb__cuda_gemm): fix this test")
    public = marked(files(["include/nabla/*.h"]), "NB_API")
    exported = public | marked(files(["*/*.h", "tensor/*/*.h"]), "NB_PLUGIN_API")
    front_ends = set()
    for h in NO_FRONT_ENDS:
        front_ends |= marked([os.path.join(SOURCE, "include", "nabla", h)], "NB_API")
    tensor_api = marked([os.path.join(SOURCE, "include", "nabla", "tensor.h")], "NB_API")
    front_ends |= tensor_api - TENSOR_FACTS
    if len(public) < 300 or "nb_matmul" not in front_ends or "nb_copy_" not in front_ends:
        fail("the NB_API pattern found %d functions: fix this test" % len(public))
    for f in plugin:
        for n in sorted(calls(plugin_code[f])):
            if n in front_ends:
                fail("%s calls %s, an op front end or a tensor's maker: a kernel calls the "
                     "backend's entries (Note [CUDA plugin])" % (rel(f), n))
            if n in lib_defs and n not in plugin_defs and n not in exported:
                fail("%s calls %s (%s), which libnabla.so does not export: mark its declaration "
                     "NB_PLUGIN_API (tensor/internal.h), or do without it"
                     % (rel(f), n, rel(lib_defs[n])))
    for f, t in lib_code.items():
        for n in sorted(calls(t)):
            if n in plugin_defs and n not in lib_defs:
                fail("%s calls %s, defined in the CUDA plugin (%s): libnabla reaches the plugin "
                     "through its table (tensor/cuda_plugin.h)" % (rel(f), n, ", ".join(
                         rel(p) for p in plugin if n in defined(plugin_code[p]))))
    print("ok: tensor/ at the bottom (%d files), %d device-neutral files, the plugin (%d files) "
          "calls %d exported functions of libnabla" % (
              len(tensor), len(neutral), len(plugin),
              len({n for t in plugin_code.values() for n in calls(t)} & exported)))


if __name__ == "__main__":
    main()
