"""An installed nabla is complete and usable from outside the tree.

`cmake --install` into a temporary prefix puts the libraries, headers,
nabla.pc and the CMake package in place, nbrun, nb_plot, nb_scale and nb_ckpt in <prefix>/bin,
the tutorial's two programs in <prefix>/share/nabla/examples and the
shipped datasets in <prefix>/share/nabla/datasets. The installed
tutorial_ddp.c is then built out of the tree twice, with pkg-config
(libnabla.so) and with CMake's find_package(nabla) (libnabla.a), and each
build trains one epoch on 2 processes under the installed nbrun, reading
the installed table; tutorial_zero.c is built with pkg-config and trains
on 2 processes with ZeRO-1, stops at a checkpoint and resumes from it.

The CUDA backend (Note [CUDA plugin] in tensor/cuda_plugin.h): a small
probe program, built both ways too, does CPU work and reads its
/proc/self/maps. Linked with libnabla.so (pkg-config), it maps no CUDA
library; in a build with CUDA the plugin must be installed, and asking for
the device count loads it, found beside libnabla.so. Linked with libnabla.a
(find_package), it has the CUDA backend linked in (a build with CUDA): the
CUDA runtime is mapped from the start and no plugin ever is; without CUDA,
nothing is.
"""
import glob
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import BUILD, fail, skip  # noqa: E402

CMAKE = os.environ.get("NABLA_CMAKE", "cmake")
CC = os.environ.get("NABLA_CC", "cc")


def sh(cmd, what, env=None, cwd=None, timeout=120):
    e = dict(os.environ)
    e.setdefault("OPENBLAS_NUM_THREADS", "1")
    e.setdefault("NABLA_PG_TIMEOUT", "60")
    if env:
        e.update(env)
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=cwd, timeout=timeout)
    if p.returncode != 0:
        fail("%s: %s exited with %d\n--- stdout\n%s\n--- stderr\n%s"
             % (what, " ".join(cmd), p.returncode, p.stdout[-3000:], p.stderr[-3000:]))
    return p.stdout, p.stderr


def check_layout(prefix):
    for rel in ("bin/nbrun", "bin/nb_plot", "bin/nb_scale", "bin/nb_ckpt"):
        path = os.path.join(prefix, rel)
        if not os.access(path, os.X_OK):
            fail("the install lacks the program %s (docs send users to it)" % rel)
    # Only those: the test drivers (tests/programs/), the examples and the
    # benchmarks stay in the build tree.
    extra = sorted(set(os.listdir(os.path.join(prefix, "bin"))) - {"nbrun", "nb_plot", "nb_scale", "nb_ckpt"})
    if extra:
        fail("the install has programs it should not ship in bin/: %s" % ", ".join(extra))
    for rel in ("include/nabla/nabla.h", "include/nabla/ops.h",
                "share/nabla/examples/tutorial_ddp.c", "share/nabla/examples/tutorial_zero.c",
                "share/nabla/datasets/breast_cancer.csv", "share/nabla/datasets/digits.csv"):
        if not os.path.isfile(os.path.join(prefix, rel)):
            fail("the install lacks %s" % rel)
    pcs = glob.glob(os.path.join(prefix, "lib*", "**", "nabla.pc"), recursive=True)
    configs = glob.glob(os.path.join(prefix, "lib*", "**", "nablaConfig.cmake"), recursive=True)
    if len(pcs) != 1 or len(configs) != 1:
        fail("expected one nabla.pc and one nablaConfig.cmake under %s, found %s and %s"
             % (prefix, pcs, configs))
    return os.path.dirname(pcs[0])


def train(prefix, exe, env=None):
    """One epoch on 2 processes under the installed nbrun; checks the output."""
    out, _ = sh([os.path.join(prefix, "bin", "nbrun"), "--nproc-per-node", "2", "--master-port", "0",
                 exe, "--epochs", "1", "--data",
                 os.path.join(prefix, "share", "nabla", "datasets", "breast_cancer.csv")],
                "training with " + os.path.basename(exe), env=env, cwd=os.path.dirname(exe))
    for want in ("2 processes (gloo backend", "epoch 1: train loss", "(114 rows)"):
        if want not in out:
            fail("%s under the installed nbrun: the output lacks %r:\n%s" % (exe, want, out))
    return [l for l in out.splitlines() if "epoch 1:" in l][0]


PROBE = r"""
#include <stdio.h>
#include <string.h>
#include <nabla/nabla.h>

static void maps(const char *when) {
    char line[4096];
    FILE *f = fopen("/proc/self/maps", "r");
    printf("%s=", when);
    while (f && fgets(line, sizeof line, f)) {
        char *p = strchr(line, '/');
        if (!p || !(strstr(p, "libcu") || strstr(p, "libnccl") || strstr(p, "libnabla_cuda")))
            continue;
        p[strcspn(p, "\n")] = 0;
        printf("%s ", p);
    }
    printf("\n");
    if (f) fclose(f);
}

int main(int argc, char **argv) {
    maps("start");
    nb_ctx *ctx = nb_ctx_new(nb_cpu(), 0);
    nb_tensor *x = nb_arange(ctx, NB_F32, 0, 6, 1);
    printf("sum=%g\n", nb_item(nb_sum(ctx, nb_mul(ctx, x, x), 0, NULL, false)));
    nb_ctx_free(ctx);
    maps("cpu");
    if (argc > 1) {
        printf("count=%d\n", nb_cuda_device_count());
        maps("asked");
    }
    return 0;
}
"""


def check_probe(exe, libdir, cuda, env=None, linked=False):
    """Runs the probe: no CUDA library for CPU work; with CUDA, asking
    loads the installed plugin. linked: the static build, whose CUDA
    backend (with CUDA) is linked in."""
    out, _ = sh([exe, "ask"], os.path.basename(exe), env=env)
    got = dict(l.split("=", 1) for l in out.splitlines() if "=" in l)
    if got.get("sum") != "55":
        fail("%s: sum of squares of 0..5 is %s, not 55:\n%s" % (exe, got.get("sum"), out))
    if linked and cuda:
        for when in ("start", "cpu", "asked"):
            if "libcudart" not in got.get(when, "") or "libnabla_cuda" in got.get(when, ""):
                fail("%s (libnabla.a with the CUDA backend linked in) should map the CUDA runtime "
                     "and no plugin; after %s it maps: %s" % (exe, when, got.get(when)))
        print("%s: the CUDA backend linked in, no plugin; device count %s"
              % (os.path.basename(exe), got.get("count")))
        return
    for when in ("start", "cpu"):
        if got.get(when, "?").strip():
            fail("%s maps CUDA libraries after %s work: %s" % (exe, when, got.get(when)))
    plugin = os.path.join(libdir, "libnabla_cuda.so")
    if cuda and plugin not in got.get("asked", ""):
        fail("%s: asking for the CUDA devices did not load %s; mapped: %s"
             % (exe, plugin, got.get("asked")))
    if not cuda and got.get("asked", "?").strip():
        fail("%s: a build without CUDA mapped %s" % (exe, got.get("asked")))
    print("%s: CPU work maps no CUDA library; device count %s%s"
          % (os.path.basename(exe), got.get("count"), ", plugin loaded" if cuda else ""))


def main():
    with tempfile.TemporaryDirectory(prefix="nb_test_install_") as tmp:
        prefix = os.path.join(tmp, "prefix")
        sh([CMAKE, "--install", BUILD, "--prefix", prefix], "cmake --install")
        pcdir = check_layout(prefix)
        libdir = os.path.dirname(pcdir)
        src = os.path.join(prefix, "share", "nabla", "examples", "tutorial_ddp.c")

        # pkg-config, shared library
        flags, _ = sh(["pkg-config", "--cflags", "--libs", "nabla"], "pkg-config",
                      env={"PKG_CONFIG_PATH": pcdir})
        app_pc = os.path.join(tmp, "pc", "tutorial_ddp")
        os.makedirs(os.path.dirname(app_pc))
        sh([CC, "-O1", src, "-o", app_pc] + flags.split(), "compiling with pkg-config's flags")
        probe_src = os.path.join(tmp, "probe.c")
        with open(probe_src, "w") as f:
            f.write(PROBE)
        probe_pc = os.path.join(tmp, "pc", "probe")
        sh([CC, "-O1", probe_src, "-o", probe_pc] + flags.split(), "compiling the probe with pkg-config's flags")

        # CMake find_package, static library
        app = os.path.join(tmp, "cm")
        os.makedirs(app)
        with open(os.path.join(app, "CMakeLists.txt"), "w") as f:
            f.write("cmake_minimum_required(VERSION 3.22)\n"
                    "project(tutorial C)\n"
                    "find_package(nabla 0.1 REQUIRED)\n"
                    "add_executable(tutorial_ddp %s)\n"
                    "target_link_libraries(tutorial_ddp nabla::nabla)\n"
                    "add_executable(probe %s)\n"
                    "target_link_libraries(probe nabla::nabla)\n"
                    % (src.replace("\\", "/"), probe_src.replace("\\", "/")))
        sh([CMAKE, "-S", app, "-B", os.path.join(app, "build"), "-DCMAKE_PREFIX_PATH=" + prefix,
            "-DCMAKE_C_COMPILER=" + CC, "-DCMAKE_BUILD_TYPE=Release"], "cmake configure")
        sh([CMAKE, "--build", os.path.join(app, "build")], "cmake --build")
        app_cm = os.path.join(app, "build", "tutorial_ddp")

        # the CUDA plugin: installed with a CUDA build, loaded only when asked for
        cuda = os.path.exists(os.path.join(BUILD, "lib", "libnabla_cuda.so"))
        if cuda != os.path.exists(os.path.join(libdir, "libnabla_cuda.so")):
            fail("the build %s libnabla_cuda.so, the install %s"
                 % (("has", "lacks") if cuda else ("lacks", "has")))
        check_probe(probe_pc, libdir, cuda, env={"LD_LIBRARY_PATH": libdir})
        check_probe(os.path.join(app, "build", "probe"), libdir, cuda, linked=True)

        probe = subprocess.run([app_cm, "--epochs", "1", "--data", os.devnull],
                               capture_output=True, text=True, timeout=60)
        if "the gloo backend is not in this build" in probe.stderr:
            skip("the tutorial needs a process group, and this build has no Gloo (libgloo-dev)")
        print("pkg-config build:  " + train(prefix, app_pc, env={"LD_LIBRARY_PATH": libdir}))
        print("find_package build: " + train(prefix, app_cm))

        # the second program, with pkg-config: ZeRO-1 on 2 processes, a checkpoint, a resume
        zero_src = os.path.join(prefix, "share", "nabla", "examples", "tutorial_zero.c")
        zero = os.path.join(tmp, "pc", "tutorial_zero")
        sh([CC, "-O1", zero_src, "-o", zero] + flags.split(), "compiling tutorial_zero.c with pkg-config's flags")
        digits = os.path.join(prefix, "share", "nabla", "datasets", "digits.csv")
        ck = os.path.join(tmp, "zero_ck")
        run_zero = [os.path.join(prefix, "bin", "nbrun"), "--nproc-per-node", "2", "--master-port", "0", zero,
                    "--data", digits, "--steps", "20", "--ckpt-dir", ck]
        sh(run_zero + ["--stop-at", "10"], "tutorial_zero to step 10", env={"LD_LIBRARY_PATH": libdir})
        out, _ = sh(run_zero + ["--resume"], "tutorial_zero resumed", env={"LD_LIBRARY_PATH": libdir})
        for want in ("resumed from %s/ckpt.safetensors at step 10" % ck, "steps 11..20 of 20",
                     "step 20: test loss"):
            if want not in out:
                fail("the installed tutorial_zero's output lacks %r:\n%s" % (want, out))
        print("tutorial_zero (pkg-config build): " + [l for l in out.splitlines() if "test loss" in l][0])
    print("ok")


if __name__ == "__main__":
    main()
