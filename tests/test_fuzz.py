"""Every fuzz target builds and survives a few seconds of fuzzing.

`make fuzz` (fuzz/run.sh) fuzzes for minutes against a library built with
coverage and sanitizers; this test keeps the targets from rotting between
such runs. Each fuzz/fuzz_*.c is compiled with clang's libFuzzer, ASan and
UBSan, linked with this build's libnabla.a (and what it links, from the
generated nabla.pc); the sources a target names on a line
"smoke-instrument: ..." are compiled into it with instrumentation, so the
few seconds explore the parser under test rather than run blind. Each then
runs NABLA_FUZZ_SMOKE_SECONDS (default 3) seconds from its seed corpus
(fuzz/corpus/<name>/, read only) with its dictionary: a crash, a sanitizer
report or a failed build fails the test, with the log's end.

Skipped, with the reason, without clang or libFuzzer (Debian: clang-14,
libclang-rt-14-dev; `make test-deps` installs them, and under CI=true their
absence fails) and in a sanitizer build (-DNABLA_SANITIZE=ON), whose
library carries GCC's sanitizer runtime.
"""
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _programs import BUILD, SOURCE, fail, skip  # noqa: E402

SECONDS = int(os.environ.get("NABLA_FUZZ_SMOKE_SECONDS", "3"))


def find_clang():
    for cc in [os.environ.get("NABLA_FUZZ_CC"), "clang-14", "clang"]:
        if cc and shutil.which(cc):
            return cc
    return None


def library_flags(build):
    """-D and -I flags of the library's own compilation (compile_commands.json)."""
    entries = json.load(open(os.path.join(build, "compile_commands.json")))
    entry = next(e for e in entries if e["file"].endswith(os.path.join("util", "json.c")))
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    keep, i = [], 0
    while i < len(args):
        a = args[i]
        if a.startswith("-D") or a.startswith("-I"):
            keep.append(a)
            if a in ("-D", "-I"):
                keep.append(args[i + 1])
                i += 1
        elif a == "-isystem":
            keep += [a, args[i + 1]]
            i += 1
        i += 1
    return keep


def main():
    build = os.path.abspath(BUILD)
    cache = open(os.path.join(build, "CMakeCache.txt")).read()
    if re.search(r"^NABLA_SANITIZE:BOOL=(ON|1|TRUE)", cache, re.M):
        print("skipped: a sanitizer build; its library carries GCC's sanitizer runtime, which "
              "libFuzzer's cannot join (make fuzz builds its own)")
        sys.exit(77)
    cc = find_clang()
    if not cc:
        skip("no clang for libFuzzer (Debian: clang-14 libclang-rt-14-dev; make test-deps)")
    pc = open(os.path.join(build, "generated", "nabla.pc")).read()
    libs = shlex.split(re.search(r"^Libs.private: (.*)$", pc, re.M).group(1))
    lib = os.path.join(build, "lib", "libnabla.a")
    cflags = ["-g", "-O1", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=undefined",
              "-std=c11"] + library_flags(build)
    targets = sorted(f[:-2] for f in os.listdir(os.path.join(SOURCE, "fuzz"))
                     if f.startswith("fuzz_") and f.endswith(".c"))
    if not targets:
        fail("no fuzz/fuzz_*.c")
    with tempfile.TemporaryDirectory(prefix="nb_test_fuzz_") as tmp:
        probe = os.path.join(tmp, "probe.c")
        open(probe, "w").write("#include <stddef.h>\n#include <stdint.h>\n"
                               "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) "
                               "{ (void)d; (void)n; return 0; }\n")
        p = subprocess.run([cc, "-fsanitize=fuzzer", probe, "-o", os.path.join(tmp, "probe")],
                           capture_output=True, text=True)
        if p.returncode != 0:
            skip("%s cannot link libFuzzer (Debian: libclang-rt-14-dev): %s" % (cc, p.stderr.strip()[-300:]))

        def compile_one(name):
            src = os.path.join(SOURCE, "fuzz", name + ".c")
            m = re.search(r"smoke-instrument:([^*\n]*)", open(src).read())
            extra = [os.path.join(SOURCE, s) for s in m.group(1).split()] if m else []
            exe = os.path.join(tmp, name)
            t0 = time.time()
            p = subprocess.run([cc] + cflags + [src] + extra + [lib] + libs + ["-o", exe],
                               capture_output=True, text=True)
            return name, exe, p, time.time() - t0

        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            built = list(pool.map(compile_one, targets))
        for name, exe, p, secs in built:
            if p.returncode != 0:
                fail("%s does not build:\n%s" % (name, p.stderr[-3000:]))
        def fuzz_one(item):
            name, exe, _, build_s = item
            corpus = os.path.join(tmp, "corpus_" + name)
            os.mkdir(corpus)
            args = [exe, "-max_total_time=%d" % SECONDS, "-rss_limit_mb=2048", "-timeout=10",
                    "-print_final_stats=1", "-artifact_prefix=%s/%s-" % (tmp, name), corpus]
            seeds = os.path.join(SOURCE, "fuzz", "corpus", name)
            if os.path.isdir(seeds):
                args.append(seeds)
            d = os.path.join(SOURCE, "fuzz", name + ".dict")
            if os.path.exists(d):
                args.insert(1, "-dict=" + d)
            env = dict(os.environ)
            if any("cudart" in x for x in libs):  # as the sanitizer build's tests do
                env.setdefault("ASAN_OPTIONS", "protect_shadow_gap=0")
            p = subprocess.run(args, capture_output=True, text=True, errors="replace", cwd=tmp,
                               timeout=SECONDS + 120, env=env)
            return name, build_s, p.returncode, p.stdout + p.stderr

        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(fuzz_one, built))
        for name, build_s, rc, log in results:
            if rc != 0:
                fail("%s crashed (exit %d); the input is in the log:\n%s" % (name, rc, log[-4000:]))
            runs = re.search(r"stat::number_of_executed_units: *(\d+)", log)
            cov = re.findall(r"cov: (\d+)", log)
            print("%-20s built in %4.1f s, %9s inputs in %d s, %s edges" % (
                name, build_s, runs.group(1) if runs else "?", SECONDS, cov[-1] if cov else "?"))
    print("ok")


if __name__ == "__main__":
    main()
