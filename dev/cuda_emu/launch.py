"""Turns one of nabla's CUDA sources into C++ for the emulator (dev/cuda_emu).

    python3 launch.py SRC DST

Every launch `kernel<...><<<grid, block[, smem[, stream]]>>>(args)` becomes
`EMU_LAUNCH((grid), (block), (smem), (kernel<...>)(args))` (emu.h); the
stream is dropped. A `#define MAX_BLOCKS N` line (tensor/cuda/types.cuh)
gets an #ifndef around it so that the Makefile's MAX_BLOCKS=... can lower
the cap on grid sizes. The rest of the file is copied as it is.
"""
import re
import sys

LAUNCH = re.compile(r"<<<(.*?)>>>\(", re.S)


def split_top(text):
    """Splits text at the commas outside parentheses and brackets (not
    angle brackets: `a < b ? a : b` is a common grid size)."""
    parts, depth, cur = [], 0, ""
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    return parts + [cur]


def kernel_start(s, at):
    """Where the kernel expression (a name with template arguments) that
    ends just before index `at` begins."""
    depth, j = 0, at - 1
    while j >= 0:
        c = s[j]
        if c == ">":
            depth += 1
        elif c == "<":
            depth -= 1
        elif depth == 0 and not (c.isalnum() or c in "_ \n,:"):
            break
        j -= 1
    k = j + 1
    while s[k] in " \n":
        k += 1
    for word in ("else", "return"):  # `else kernel<<<...` is a statement
        if re.match(word + r"\s", s[k:]):
            k += len(word)
            while s[k] in " \n":
                k += 1
    return k


def convert(s):
    out, pos, n = [], 0, 0
    while True:
        m = LAUNCH.search(s, pos)
        if not m:
            out.append(s[pos:])
            break
        k0 = kernel_start(s, m.start())
        cfg = split_top(m.group(1))
        if len(cfg) < 2:
            sys.exit("launch.py: cannot read the launch configuration <<<%s>>>" % m.group(1))
        end, depth = m.end(), 1  # the closing parenthesis of the arguments
        while depth:
            depth += {"(": 1, ")": -1}.get(s[end], 0)
            end += 1
        smem = cfg[2] if len(cfg) > 2 else "0"
        out.append(s[pos:k0])
        out.append("EMU_LAUNCH((%s), (%s), (%s), (%s)(%s))"
                   % (cfg[0], cfg[1], smem, s[k0:m.start()].strip(), s[m.end():end - 1]))
        pos, n = end, n + 1
    s = "".join(out)
    s = re.sub(r"^#define MAX_BLOCKS (\S+)(.*)$", r"#ifndef MAX_BLOCKS\n#define MAX_BLOCKS \1\2\n#endif",
               s, flags=re.M)
    return s, n


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    text, n = convert(open(src).read())
    open(dst, "w").write(text)
