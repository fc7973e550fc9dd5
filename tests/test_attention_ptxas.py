"""The flash-attention kernels' resources (tensor/cuda/attention.cu, Note
[Flash attention kernels]): compiled with nvcc for the default CUDA
architectures with `-Xptxas -v`, every kernel must spill nothing and use at
most SMEM_BUDGET bytes of shared memory, the budget the source states.

Needs nvcc (NABLA_NVCC, else PATH, else /usr/local/cuda/bin), not a GPU;
without one it skips, saying so (CI has no CUDA toolkit)."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import SOURCE, fail  # noqa: E402

KERNELS = os.path.join(SOURCE, "tensor", "cuda", "attention.cu")
CMAKE = os.path.join(SOURCE, "cmake", "NablaDependencies.cmake")


def find_nvcc():
    for cand in (os.environ.get("NABLA_NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def default_archs():
    """The real architectures of CMAKE_CUDA_ARCHITECTURES' default, as the
    build sets it (ptxas runs for those; a -virtual entry is PTX only)."""
    text = open(CMAKE).read()
    m = re.search(r'set\(CMAKE_CUDA_ARCHITECTURES "([^"]+)"\)', text)
    if not m:
        fail("no default CMAKE_CUDA_ARCHITECTURES in " + CMAKE)
    return [a.split("-")[0] for a in m.group(1).split(";") if not a.endswith("-virtual")]


def budget():
    m = re.search(r"#define SMEM_BUDGET \((\d+) \* 1024\)", open(KERNELS).read())
    if not m:
        fail("attention.cu states no SMEM_BUDGET (#define SMEM_BUDGET (N * 1024))")
    return int(m.group(1)) * 1024


def kernels(ptxas_out):
    """[(kernel, arch, spill store bytes, spill load bytes, smem bytes)]"""
    rows, cur, spill = [], None, None
    for line in ptxas_out.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line)
        if m:
            cur, spill = m.groups(), None
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur:
            spill = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used \d+ registers.*?(\d+) bytes smem", line)
        if m and cur:
            if spill is None:
                fail("ptxas printed no spill line for %s (%s):\n%s" % (cur[0], cur[1], ptxas_out))
            rows.append((cur[0], cur[1], spill[0], spill[1], int(m.group(1))))
            cur = None
    return rows


def main():
    nvcc = find_nvcc()
    if not nvcc:
        print("skipped: no nvcc (NABLA_NVCC, PATH, /usr/local/cuda/bin): the kernels are not compiled here")
        sys.exit(77)
    archs = default_archs()
    # device code only (-cubin: no host compilation), one nvcc per arch, at once
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for a in archs:
            cmd = [nvcc, "-std=c++17", "-I" + SOURCE, "-I" + os.path.join(SOURCE, "include"), "-Xptxas", "-v",
                   "-cubin", "-arch=sm_" + a, KERNELS, "-o", os.path.join(tmp, "attention_%s.cubin" % a)]
            runs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        out = ""
        for cmd, p in runs:
            text = p.communicate(timeout=900)[0]
            if p.returncode != 0:
                fail("nvcc failed (%d): %s\n%s" % (p.returncode, " ".join(cmd), text))
            out += text
    rows = kernels(out)
    limit, bad = budget(), []
    # three kernels (forward, dq, dk/dv) x 3 dtypes x 4 head-dimension classes, per arch
    if len(rows) != 36 * len(archs):
        bad.append("expected %d kernels (36 per arch, archs %s), ptxas reported %d" % (36 * len(archs), archs, len(rows)))
    for name, arch, st, ld, smem in rows:
        if st or ld:
            bad.append("%s (%s) spills: %d bytes stored, %d loaded" % (name, arch, st, ld))
        if smem > limit:
            bad.append("%s (%s) uses %d bytes of shared memory, over SMEM_BUDGET %d" % (name, arch, smem, limit))
    if bad:
        fail("\n".join(bad))
    print("ok: %d kernels for sm_%s, no spills, shared memory at most %d of %d bytes"
          % (len(rows), "/sm_".join(archs), max(r[4] for r in rows), limit))


if __name__ == "__main__":
    main()
