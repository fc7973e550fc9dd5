"""The CUDA plugin's checks, from a program linked with the build's
libnabla.so (Note [CUDA plugin] in tensor/cuda_plugin.h; tests/test_plugin.c
covers programs linked with libnabla.a).

- Without help, the plugin is found beside libnabla.so: asking for the
  device count loads it (the program's maps show it), and a CUDA context
  then works or, without a GPU, is refused as a device that does not exist.
- A shared object that exports the entry point but was built for another
  nabla version and plugin ABI is refused, and the error names the file,
  both versions and both ABI numbers. The fake plugin is compiled here.
- The plugin links libnabla.so (readelf: a NEEDED entry), defines none of
  libnabla's functions and exports nothing but its entry point (nm -D).

In a build without CUDA, NABLA_CUDA_PLUGIN is ignored and a CUDA context is
refused as "built without CUDA".
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import BUILD, SOURCE, fail, skip  # noqa: E402

CC = os.environ.get("NABLA_CC", "cc")

PROBE = r"""
#include <stdio.h>
#include <string.h>
#include <nabla/nabla.h>

int main(void) {
    int n = nb_cuda_device_count();
    char line[4096];
    FILE *f = fopen("/proc/self/maps", "r");
    printf("count=%d\nmapped=", n);
    while (f && fgets(line, sizeof line, f)) {
        char *p = strchr(line, '/');
        if (p && (strstr(p, "libnabla_cuda") || strstr(p, "fake_plugin"))) {
            p[strcspn(p, "\n")] = 0;
            printf("%s ", p);
        }
    }
    printf("\n");
    fflush(stdout);
    nb_ctx *ctx = nb_ctx_new(nb_cuda(0), 0);
    printf("context made\n");
    nb_ctx_free(ctx);
    return 0;
}
"""

# What a plugin of another build looks like from libnabla: the table's
# first two members (the ABI number and the version), nothing else.
FAKE = r"""
#include <stdint.h>
struct head { uint32_t abi; const char *version; };
static const struct head self = {999, "9.9.9"};
const void *nb__cuda_plugin_init(void) { return &self; }
"""


def nabla_version():
    text = open(os.path.join(SOURCE, "include", "nabla", "nabla.h")).read()
    parts = [re.search(r"#define NABLA_VERSION_%s (\d+)" % k, text).group(1)
             for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def plugin_abi():
    # the ABI number both sides compare, as tensor/cuda_plugin.h defines it
    text = open(os.path.join(SOURCE, "tensor", "cuda_plugin.h")).read()
    return re.search(r"#define NB__CUDA_PLUGIN_ABI (\d+)", text).group(1)


def compile_c(src, out, args, what):
    # NABLA_TEST_CFLAGS: a sanitized build's runtime (cmake/NablaTests.cmake)
    flags = os.environ.get("NABLA_TEST_CFLAGS", "").split()
    p = subprocess.run([CC, "-O1"] + flags + [src, "-o", out] + args, capture_output=True, text=True)
    if p.returncode != 0:
        fail("%s does not compile:\n%s" % (what, p.stderr[-3000:]))


def run(exe, env):
    e = dict(os.environ)
    e.pop("NABLA_CUDA_PLUGIN", None)
    e.update(env)
    return subprocess.run([exe], capture_output=True, text=True, env=e, timeout=60)


def check_links(plugin):
    """The plugin links libnabla.so and exports its entry point only."""
    if not shutil.which("readelf") or not shutil.which("nm"):
        skip("readelf and nm (binutils) are not installed")
    d = subprocess.run(["readelf", "-d", plugin], capture_output=True, text=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", d)
    if not any(n.startswith("libnabla.so") for n in needed):
        fail("%s does not link libnabla.so; it needs %s" % (plugin, ", ".join(needed)))
    out = subprocess.run(["nm", "-D", "--defined-only", plugin], capture_output=True, text=True).stdout
    mine = sorted(l.split()[-1] for l in out.splitlines() if l.split() and l.split()[-1].startswith("nb"))
    if mine != ["nb__cuda_plugin_init"]:
        fail("%s exports %s; only nb__cuda_plugin_init should be" % (plugin, ", ".join(mine)))
    print("the plugin links %s and exports only nb__cuda_plugin_init"
          % [n for n in needed if n.startswith("libnabla.so")][0])


def main():
    lib = os.path.abspath(os.path.join(BUILD, "lib"))
    cuda = os.path.exists(os.path.join(lib, "libnabla_cuda.so"))
    if cuda:
        check_links(os.path.join(lib, "libnabla_cuda.so"))
    with tempfile.TemporaryDirectory(prefix="nb_test_plugin_abi_") as tmp:
        probe_c = os.path.join(tmp, "probe.c")
        fake_c = os.path.join(tmp, "fake.c")
        with open(probe_c, "w") as f:
            f.write(PROBE)
        with open(fake_c, "w") as f:
            f.write(FAKE)
        probe = os.path.join(tmp, "probe")
        compile_c(probe_c, probe, ["-I" + os.path.join(SOURCE, "include"), "-L" + lib, "-lnabla",
                                   "-Wl,-rpath," + lib], "the probe")
        fake = os.path.join(tmp, "fake_plugin.so")
        compile_c(fake_c, fake, ["-shared", "-fPIC"], "the fake plugin")

        # found beside libnabla.so
        p = run(probe, {})
        got = dict(l.split("=", 1) for l in p.stdout.splitlines() if "=" in l)
        if "count" not in got:
            fail("the probe printed no device count (exit %d):\n%s%s" % (p.returncode, p.stdout, p.stderr))
        n = int(got["count"])
        if cuda:
            want = os.path.join(lib, "libnabla_cuda.so")
            if want not in got.get("mapped", ""):
                fail("asking for the device count did not load %s; mapped: %r" % (want, got.get("mapped")))
        elif got.get("mapped", "").strip():
            fail("a build without CUDA mapped %s" % got["mapped"])
        if n == 0:
            want = ("nb_ctx_new: device cuda:0 does not exist (0 CUDA devices visible)" if cuda
                    else "nb_ctx_new: device cuda:0: nabla was built without CUDA")
            if p.returncode == 0 or want not in p.stderr:
                fail("with no GPU, nb_ctx_new(cuda:0) should stop with %r; exit %d, stderr:\n%s"
                     % (want, p.returncode, p.stderr))
        elif p.returncode != 0 or "context made" not in p.stdout:
            fail("%d GPU(s), yet no CUDA context (exit %d):\n%s" % (n, p.returncode, p.stderr))
        print("beside libnabla.so: %d device(s), plugin %s" % (n, "loaded" if cuda else "absent (no CUDA)"))

        # another build's plugin
        p = run(probe, {"NABLA_CUDA_PLUGIN": fake})
        if cuda:
            want = (r"nb_ctx_new: device cuda:0: the CUDA backend could not be loaded: %s: built for "
                    r"nabla 9\.9\.9 \(plugin ABI 999\), this is nabla %s \(ABI %s\) \(the "
                    r"file NABLA_CUDA_PLUGIN names\)" % (re.escape(fake), re.escape(nabla_version()),
                                                         plugin_abi()))
            if "count=0" not in p.stdout or p.returncode == 0 or not re.search(want, p.stderr):
                fail("a plugin of another version: expected no device and %r; exit %d\n--- stdout\n%s"
                     "--- stderr\n%s" % (want, p.returncode, p.stdout, p.stderr))
            if "fake_plugin" in p.stdout.split("mapped=", 1)[1].split("\n", 1)[0]:
                fail("the refused plugin stayed mapped:\n%s" % p.stdout)
        else:
            want = "nb_ctx_new: device cuda:0: nabla was built without CUDA"
            if p.returncode == 0 or want not in p.stderr:
                fail("a build without CUDA should ignore NABLA_CUDA_PLUGIN and say %r:\n%s"
                     % (want, p.stderr))
        print("another version's plugin: refused, naming both versions" if cuda
              else "NABLA_CUDA_PLUGIN ignored without CUDA")
    print("ok")


if __name__ == "__main__":
    main()
