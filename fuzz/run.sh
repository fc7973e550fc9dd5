#!/usr/bin/env bash
# Builds every fuzz/fuzz_*.c as a libFuzzer target (with AddressSanitizer
# and UndefinedBehaviorSanitizer) against the library sources, and runs
# each for a number of seconds.
#
#   fuzz/run.sh [SECONDS] [TARGET...]      default: 60 seconds, every target
#
# A target is one file fuzz/<name>.c defining LLVMFuzzerTestOneInput; it may
# include public and internal headers by path from the project root.
# Optional companions: fuzz/corpus/<name>/ (seed inputs, read only) and
# fuzz/<name>.dict (a libFuzzer dictionary). The library is built by CMake
# into $FUZZ_BUILD_DIR/lib (default build-fuzz/lib) with coverage
# instrumentation; each target's growing corpus, crash files and log go to
# $FUZZ_BUILD_DIR/{corpus,artifacts}/<name>/ and $FUZZ_BUILD_DIR/<name>.log.
# Environment: CC (default clang-14, else clang), FUZZ_BUILD_DIR, FUZZ_JOBS
# (build parallelism, default 2). Exits 1 if any target found a crash.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=${1:-60}
[ $# -gt 0 ] && shift
case $seconds in
  ''|*[!0-9]*) echo "usage: $0 [SECONDS] [TARGET...]" >&2; exit 2 ;;
esac
build=${FUZZ_BUILD_DIR:-$root/build-fuzz}
jobs=${FUZZ_JOBS:-2}
cc=${CC:-}
if [ -z "$cc" ]; then
  for c in clang-14 clang; do
    if command -v "$c" >/dev/null 2>&1; then cc=$c; break; fi
  done
fi
[ -n "$cc" ] || { echo "fuzz: no clang found (Debian: clang-14 libclang-rt-14-dev)" >&2; exit 2; }

sanitize="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
flags="-g -O1 -fno-omit-frame-pointer $sanitize"

mkdir -p "$build"
echo "== building the library with $cc (coverage + ASan + UBSan) in $build/lib"
cmake -S "$root" -B "$build/lib" -DCMAKE_C_COMPILER="$cc" -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_FLAGS="$flags -fsanitize=fuzzer-no-link" \
  -DNABLA_CUDA=OFF -DNABLA_GLOO=OFF -DNABLA_BUILD_TESTS=OFF >"$build/cmake.log" 2>&1 \
  || { cat "$build/cmake.log" >&2; exit 1; }
cmake --build "$build/lib" --target nabla -j"$jobs" >"$build/build.log" 2>&1 \
  || { cat "$build/build.log" >&2; exit 1; }
# Everything the static library needs (OpenBLAS, oneDNN and its OpenMP
# runtime, ...), as CMake found it: the Libs.private line of the nabla.pc it
# generated, so that a new dependency of the library needs no edit here.
libs=$(sed -n 's/^Libs.private: //p' "$build/lib/generated/nabla.pc")
[ -n "$libs" ] || { echo "fuzz: no Libs.private in $build/lib/generated/nabla.pc" >&2; exit 1; }

targets=()
for src in "$root"/fuzz/fuzz_*.c; do
  [ -e "$src" ] || continue
  name=$(basename "$src" .c)
  if [ $# -gt 0 ]; then
    want=0
    for t in "$@"; do [ "$t" = "$name" ] && want=1; done
    [ $want -eq 1 ] || continue
  fi
  targets+=("$name")
done
[ ${#targets[@]} -gt 0 ] || { echo "fuzz: no targets (fuzz/fuzz_*.c) matched" >&2; exit 2; }

failed=()
summary=()
for name in "${targets[@]}"; do
  echo "== $name: building"
  "$cc" $flags -fsanitize=fuzzer -std=c11 -D_POSIX_C_SOURCE=200809L \
    -DNABLA_HAVE_CUDA=0 -DNABLA_HAVE_GLOO=0 -I"$root/include" -I"$root" \
    "$root/fuzz/$name.c" "$build/lib/lib/libnabla.a" $libs -lm -lpthread -o "$build/$name"
  corpus=$build/corpus/$name
  artifacts=$build/artifacts/$name
  mkdir -p "$corpus" "$artifacts"
  args=(-max_total_time="$seconds" -print_final_stats=1 -artifact_prefix="$artifacts/"
        -rss_limit_mb=4096 -timeout=10)
  [ -f "$root/fuzz/$name.dict" ] && args+=(-dict="$root/fuzz/$name.dict")
  dirs=("$corpus")
  [ -d "$root/fuzz/corpus/$name" ] && dirs+=("$root/fuzz/corpus/$name")
  echo "== $name: fuzzing for $seconds s (log: $build/$name.log)"
  if "$build/$name" "${args[@]}" "${dirs[@]}" >"$build/$name.log" 2>&1; then
    status=ok
  else
    status=FAILED
    failed+=("$name")
    tail -40 "$build/$name.log" >&2
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$build/$name.log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$build/$name.log" | tail -1 || true)
  units=$(find "$corpus" -type f | wc -l)
  summary+=("$(printf '%-22s %-7s %12s executions  %s  corpus %s files' "$name" "$status" \
    "${execs:-?}" "${cov:-cov: ?}" "$units")")
done

echo "== summary ($seconds s per target)"
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: crashes in: ${failed[*]} (inputs in $build/artifacts/)" >&2
  exit 1
fi
