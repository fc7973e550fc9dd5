#!/usr/bin/env bash
# Checks and measures nabla on a machine with an NVIDIA GPU: builds with
# CUDA, runs the GPU suites and compute-sanitizer, trains the examples there,
# and times our kernels and training steps against PyTorch. The work is cut
# into phases, each step of which has its own time limit, so that a check can
# be run as a few short invocations (docs/gpu_check.md):
#
#   probe  nvidia-smi, nvcc, CMake, PyTorch, compute-sanitizer, and where
#          cuDNN and NCCL live (/usr/local/cuda, the system, or the Python
#          environment's nvidia/* packages)
#   build  Release build with NABLA_CUDA=ON in $BUILD_DIR (-Werror if WERROR=ON),
#          for the GPU's own architecture only (faster to compile);
#          NABLA_CUDA_EXTRA_ROOT points at the Python packages' cuDNN/NCCL when
#          the toolkit has none
#   test   ctest -L gpu; the CPU's bf16/oneDNN suites on that CPU; short runs of
#          train_gpt and train_classifier on the GPU, f32 and --bf16; then sanitize
#   bench  bench_cuda and compare_torch_cuda.py (ours against PyTorch, op by
#          op), gpt2_gpu.py (GPT-2 small bf16 training steps against PyTorch
#          eager and torch.compile), run_scaling.sh over the GPUs there are
#   cpu    compare_torch.py on that machine's CPU, 1 thread, f32 and bf16
#          rows of both GPTs (its CPU may have AVX512_BF16/AMX;
#          $CPU_TIMEOUT seconds, 420, as each comparison of cpuddp)
#   sanitize  compute-sanitizer memcheck over every tests/test_cuda_* binary
#          (within $SANITIZE_BUDGET seconds) and racecheck over $RACECHECK
#   dnnl   oneDNN's ISA and kernels on that CPU, the share of GPT steps its
#          primitives take, GPT steps per ISA cap
#   cpuddp DDP on 2 CPU processes against PyTorch DDP (compare_torch.py --ddp 2,
#          GPT), at the default buckets and at 0.25 MiB with the per-bucket
#          step, with the overlap across ranks: on a host with cores to spare
#          for communication (~3 min)
#
#   perf   the whole performance decision in one call of at most
#          $PERF_BUDGET seconds (540): build for the GPU's architecture
#          only, the GPU suites, the attention micro-benchmark
#          (attention_gpu.py: composed, own and cudnn against PyTorch's
#          scaled_dot_product_attention), bench_gpt2 --bf16 at batch 8 and
#          the best batch on each attention path there is (peak, and the
#          device memory in use), a per-kernel profile of one step (ncu
#          --clock-control none, where there is ncu) and a per-entry one
#          (CUDA events, bench_gpt2 --profile-events) beside the meta
#          device's projection, then
#          a pack step: at most 8 files under $OUT (summary, tables, one
#          archive of the logs). Without a GPU it says so and ends at once.
#          Not in `all`; run it alone, first, with a fresh $OUT.
#
#   benchmarks/gpu_check.sh [--phase probe,build,test,bench,cpu,perf|all]   (default all)
#
# From the project's root. A GPU machine without our Debian packages (Check,
# OpenBLAS, oneDNN, Gloo) gets them as .deb files in .deps/, downloaded
# elsewhere by dev/fetch_debs.sh; this script unpacks them
# (dev/unpack_debs.sh) before anything else. test and bench build first
# when $BUILD_DIR has no build. Every log and table goes under $OUT/<phase>/
# (OUT: default build-gpu-out/), with one line per step in $OUT/summary.txt;
# the tables and the summary are printed last.
set -uo pipefail

phases=all
while [ $# -gt 0 ]; do
  case $1 in
    --phase) phases=${2:?--phase needs a value}; shift 2 ;;
    --phase=*) phases=${1#--phase=}; shift ;;
    -h|--help) sed -n '2,/^set -uo/{/^set -uo/!p}' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "$phases" = all ] && phases=probe,build,test,bench,cpu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-$ROOT/build-gpu-out}  # ignored by git, as every build-*/

# A GPU is there when nvidia-smi lists one and CUDA_VISIBLE_DEVICES (when
# set) does not hide them all ("" or -1).
have_gpu() {
  case ${CUDA_VISIBLE_DEVICES-unset} in ""|-1) return 1 ;; esac
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}
# perf alone on a machine without a GPU: nothing to unpack, build or measure
if [ "$phases" = perf ] && ! have_gpu; then
  mkdir -p "$OUT"
  echo "gpu_check --phase perf: no GPU here (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them): nothing measured" |
    tee "$OUT/summary.txt"
  exit 0
fi
BUILD_DIR=${BUILD_DIR:-build-gpu}
SANITIZE_BUDGET=${SANITIZE_BUDGET:-240}
SANITIZE_TIMEOUT=${SANITIZE_TIMEOUT:-150}
RACECHECK=${RACECHECK:-test_cuda_reduce test_cuda_layers}  # suites whose kernels use shared memory
STEP_TIMEOUT=${STEP_TIMEOUT:-240}  # seconds any one step may take
WERROR=${WERROR:-OFF}              # a newer host compiler there may warn where ours does not
JOBS=${JOBS:-$(nproc)}
# GPT2_ARGS: extra arguments for gpt2_gpu.py (e.g. "--steps 10")
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
T0=$(date +%s)
export PYTHONUNBUFFERED=1

note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$SUMMARY"; }
# run NAME LOG CMD...: runs CMD with its output in LOG, notes the exit status
run() {
  local name=$1 log=$2; shift 2
  local t rc=0
  t=$(date +%s)
  timeout "$STEP_TIMEOUT" "$@" >"$log" 2>&1 || rc=$?
  note "$name: exit $rc$( [ $rc = 124 ] && echo " (timed out after ${STEP_TIMEOUT}s)") ($(( $(date +%s) - t ))s) -> ${log#$OUT/}"
  return $rc
}

# ---------------------------------------------------------------- deps
if ls .deps/*.deb >/dev/null 2>&1; then
  # shellcheck disable=SC1091
  source dev/unpack_debs.sh .deps || exit 1
else
  note "no .deps/*.deb: Check, OpenBLAS, oneDNN and Gloo must be installed already (docs/gpu_check.md)"
fi

# cuDNN and NCCL: the toolkit's or the system's, else the Python packages'
find_prefix() { # header library: prints the prefix holding include/HEADER
  local h=$1 d
  for d in /usr/local/cuda /usr /usr/local; do
    [ -f "$d/include/$h" ] && { echo "$d"; return; }
  done
  [ -f "/usr/include/x86_64-linux-gnu/$h" ] && { echo /usr; return; }
  local site
  site=$(python3 -c 'import site, sysconfig; print(" ".join(set(site.getsitepackages() + [sysconfig.get_paths()["purelib"]])))' 2>/dev/null)
  for d in $site; do
    local f
    f=$(find "$d/nvidia" -maxdepth 4 -name "$h" -path '*/include/*' 2>/dev/null | head -1)
    [ -n "$f" ] && { dirname "$(dirname "$f")"; return; }
  done
}
CUDNN_PREFIX=$(find_prefix cudnn.h)
NCCL_PREFIX=$(find_prefix nccl.h)
extra=""
for p in "$CUDNN_PREFIX" "$NCCL_PREFIX"; do
  case $p in ""|/usr|/usr/local|/usr/local/cuda) ;; *)
    extra=${extra:+$extra;}$p
    for l in "$p/lib" "$p/lib64"; do [ -d "$l" ] && export LD_LIBRARY_PATH=$l${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; done ;;
  esac
done
export PATH=$PATH:/usr/local/cuda/bin
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)

# -------------------------------------------------------------- phases
phase_probe() {
  local d=$OUT/probe; mkdir -p "$d"
  {
    echo "== nvidia-smi"; nvidia-smi
    nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
    echo "== nvcc"; command -v nvcc; nvcc --version
    echo "== cmake"; cmake --version | head -1
    echo "== python"; command -v python3; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
    echo "== cuDNN prefix: ${CUDNN_PREFIX:-not found}; NCCL prefix: ${NCCL_PREFIX:-not found}"
    ls "${CUDNN_PREFIX:-/nonexistent}"/lib*/libcudnn.so* "${NCCL_PREFIX:-/nonexistent}"/lib*/libnccl.so* 2>&1
    python3 -c 'import nvidia, os; [print(p, sorted(os.listdir(p))) for p in nvidia.__path__]' 2>&1
    echo "== compute-sanitizer: ${SANITIZER:-not found}"
    echo "== cores: $(nproc), memory: $(free -g | awk '/Mem/{print $2}') GiB"
    echo "== CPU: $(grep -m1 'model name' /proc/cpuinfo)"
    echo "   flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|avx512f|avx512_bf16|amx_bf16|amx_tile)$' | tr '\n' ' ')"
    echo "== compilers: $(gcc --version | head -1); $(g++ --version 2>&1 | head -1); pkg-config $(command -v pkg-config)"
  } >"$d/probe.txt" 2>&1
  note "probe: CPU $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) ($(grep -m1 '^flags' /proc/cpuinfo | grep -o 'avx512_bf16\|amx_bf16' | tr '\n' ' '))"
  note "probe: $(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null); nvcc $(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p'); cuDNN in ${CUDNN_PREFIX:-?}; NCCL in ${NCCL_PREFIX:-?}"
}

phase_build() { # [LOG_DIR]
  local d=${1:-$OUT/build}; mkdir -p "$d"
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    local cc gen=()
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    command -v ninja >/dev/null && gen=(-G Ninja)
    run configure "$d/configure.log" cmake -S . -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DNABLA_CUDA=ON -DNABLA_WERROR="$WERROR" ${cc:+-DCMAKE_CUDA_ARCHITECTURES=${cc}-real} \
      ${extra:+"-DNABLA_CUDA_EXTRA_ROOT=$extra"} || { tail -30 "$d/configure.log"; return 1; }
  fi
  run build "$d/build.log" cmake --build "$BUILD_DIR" -j"$JOBS" || { grep -B2 -A8 -m5 'error' "$d/build.log"; tail -20 "$d/build.log"; return 1; }
  note "build: $(grep -c 'warning:' "$d/build.log") compiler warnings (first ones below)"
  grep -m5 'warning:' "$d/build.log" | tee -a "$SUMMARY"
  return 0 # (no warnings: grep's 1 is no failure)
}

ensure_built() { [ -x "$BUILD_DIR/bin/bench_cuda" ] || phase_build; }

phase_test() {
  local d=$OUT/test; mkdir -p "$d"
  ensure_built || return 1
  run "ctest -L gpu" "$d/ctest-gpu.log" ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure --timeout 120 -j4
  grep -E "tests passed|Failed|\*\*\*|Not Run|Skipped" "$d/ctest-gpu.log" | tee -a "$SUMMARY"
  # the CPU's bf16 paths (AVX512_BF16 / AMX where this CPU has them; emulated on ours)
  run "ctest CPU bf16/oneDNN suites on this CPU" "$d/ctest-cpu-bf16.log" ctest --test-dir "$BUILD_DIR" \
    -R 'cpu_bf16|dnnl|bf16_programs|test_matmul|attention' -E '_logic$' --output-on-failure --timeout 120 -j8
  grep -E "tests passed|Failed|\*\*\*|Not Run" "$d/ctest-cpu-bf16.log" | tee -a "$SUMMARY"

  local bin=$BUILD_DIR/bin
  run "train_gpt f32 (cuda)" "$d/train_gpt_f32.log" "$bin/train_gpt" --layers 2 --heads 4 --width 128 \
    --steps 60 --warmup 10 --eval-interval 30 --eval-windows 64 --sample-len 60 --progress plain
  run "train_gpt --bf16 (cuda)" "$d/train_gpt_bf16.log" "$bin/train_gpt" --bf16 --layers 2 --heads 4 --width 128 \
    --steps 60 --warmup 10 --eval-interval 30 --eval-windows 64 --sample-len 60 --progress plain
  run "train_gpt --synthetic --bf16 GPT-2 small, 5 steps" "$d/train_gpt_gpt2.log" "$bin/train_gpt" --synthetic --bf16 \
    --layers 12 --heads 12 --width 768 --seq-len 1024 --vocab-size 50304 --batch-size 8 --steps 5 \
    --warmup 1 --eval-windows 8 --sample-len 8 --progress plain
  run "train_classifier mlp (cuda)" "$d/train_mlp.log" "$bin/train_classifier" --model mlp --progress plain
  run "train_classifier cnn --bf16 (cuda)" "$d/train_cnn_bf16.log" "$bin/train_classifier" --model cnn --bf16 \
    --epochs 5 --progress plain
  for f in "$d"/train_*.log; do echo "  $(basename "$f"): $(grep -E 'val loss|test accuracy' "$f" | tail -1)"; done | tee -a "$SUMMARY"

  phase_sanitize
}

# memcheck over every GPU suite, then racecheck over $RACECHECK, run side by
# side (the sanitizers are CPU-bound), within $SANITIZE_BUDGET seconds in all.
# NCCL's communicator set-up probes kernel images this GPU lacks and handles
# the errors itself: CUDA API errors are not reported for the suites that
# use NCCL (our own calls are checked by the code); memory errors are.
sanitize_one() { # TOOL NAME LOG: one suite under compute-sanitizer
  local tool=$1 name=$2 log=$3 rc=0 extra=()
  case $name in test_cuda_nccl|test_cuda_ddp) extra=(--report-api-errors no) ;; esac
  [ "$tool" = racecheck ] && extra+=(--racecheck-report hazard)
  (exe=$(realpath "$BUILD_DIR/tests/$name") && cd "$BUILD_DIR" && timeout "$SANITIZE_TIMEOUT" \
    "$SANITIZER" --tool "$tool" "${extra[@]}" --error-exitcode 99 --print-limit 20 "$exe") >"$log" 2>&1 || rc=$?
  note "$tool $name: exit $rc$( [ $rc = 124 ] && echo " (timed out after ${SANITIZE_TIMEOUT}s)")$( [ $rc = 99 ] && echo ' (ERRORS)') $(grep -m1 'RACECHECK SUMMARY\|ERROR SUMMARY' "$log")"
}

phase_sanitize() {
  local d=$OUT/test; mkdir -p "$d"
  ensure_built || return 1
  if [ -z "$SANITIZER" ]; then note "compute-sanitizer not found: sanitizers skipped"; return 0; fi
  local start t name
  start=$(date +%s)
  for name in $RACECHECK; do
    [ -x "$BUILD_DIR/tests/$name" ] && sanitize_one racecheck "$name" "$d/racecheck-$name.log" &
  done
  for t in "$BUILD_DIR"/tests/test_cuda_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    case " ${MEMCHECK_ONLY:-$name} " in *" $name "*) ;; *) continue ;; esac
    if [ $(( $(date +%s) - start )) -gt "$SANITIZE_BUDGET" ]; then note "memcheck $name: not run (SANITIZE_BUDGET ${SANITIZE_BUDGET}s spent)"; continue; fi
    sanitize_one memcheck "$name" "$d/memcheck-$name.log"
  done
  wait
}

phase_bench() {
  local d=$OUT/bench; mkdir -p "$d"
  ensure_built || return 1
  local bin=$BUILD_DIR/bin
  run bench_cuda "$d/bench_cuda.json" "$bin/bench_cuda" --json
  run "compare_torch_cuda.py" "$d/compare_torch_cuda.txt" python3 benchmarks/compare_torch_cuda.py \
    --ours "$d/bench_cuda.json" --out "$d/compare_torch_cuda.json"
  # gpt2_gpu.py runs bench_gpt2 --bf16 itself, then PyTorch eager and torch.compile
  # shellcheck disable=SC2086
  run "gpt2_gpu.py" "$d/gpt2_gpu.txt" python3 benchmarks/gpt2_gpu.py --bin "$bin" ${GPT2_ARGS:-} ||
    { grep -m1 'out of memory' "$d/gpt2_gpu.txt" | tee -a "$SUMMARY"
      # shellcheck disable=SC2086
      run "gpt2_gpu.py --batch 4" "$d/gpt2_gpu_b4.txt" python3 benchmarks/gpt2_gpu.py --bin "$bin" \
        --batch 4 ${GPT2_ARGS:-}; }
  run "run_scaling.sh (one GPU per rank)" "$d/scaling.txt" env NABLA_BIN="$bin" \
    benchmarks/run_scaling.sh --out "$d" --steps 20
  echo; cat "$d/compare_torch_cuda.txt"; echo; cat "$d/gpt2_gpu.txt"
  if [ -f "$d/gpt2_gpu_b4.txt" ]; then cat "$d/gpt2_gpu_b4.txt"; fi
}

# The CPU beside the GPU (AVX512_BF16 / AMX where it has them): the CPU
# comparison with its bf16 rows, one thread each side (compare_torch.py).
phase_cpu() {
  local d=$OUT/cpu; mkdir -p "$d"
  ensure_built || return 1
  # shellcheck disable=SC2086
  # both GPTs, f32 pairs and bf16 triples: ~3 min on that machine, so a longer limit than a step's
  STEP_TIMEOUT=${CPU_TIMEOUT:-420} run "compare_torch.py (CPU, 1 thread, f32 and bf16)" "$d/compare_torch_cpu.txt" \
    python3 benchmarks/compare_torch.py --bin "$BUILD_DIR/bin" --threads 1 ${CPU_COMPARE_ARGS:---models gpt,gpt6 --bf16-models gpt,gpt6 --steps 8 --repeats 3}
  tail -25 "$d/compare_torch_cpu.txt"
}

# DDP on CPU processes where the communication threads have cores of their
# own: the DDP target (<= 0.75x PyTorch DDP with >= 80% hidden) measured
# away from a 2-core machine's contention.
phase_cpuddp() {
  local d=$OUT/cpuddp; mkdir -p "$d"
  ensure_built || return 1
  STEP_TIMEOUT=${CPU_TIMEOUT:-420} run "compare_torch.py --ddp 2 (CPU, default buckets)" "$d/ddp_default.txt" \
    python3 benchmarks/compare_torch.py --bin "$BUILD_DIR/bin" --threads 1 --models gpt --bf16-models "" \
    --ddp 2 --steps 20 --repeats 3
  STEP_TIMEOUT=${CPU_TIMEOUT:-420} run "compare_torch.py --ddp 2 (CPU, 0.25 MiB, per-bucket step)" \
    "$d/ddp_small.txt" python3 benchmarks/compare_torch.py --bin "$BUILD_DIR/bin" --threads 1 --models gpt \
    --bf16-models "" --ddp 2 --steps 20 --repeats 3 --ddp-bucket-mb 0.25 --nabla-bucket-step
  grep -h -A1 'nabla ms.*hidden' "$d/ddp_default.txt" "$d/ddp_small.txt"
}

# "step <median ms>; oneDNN <ms> per step (<share>%, <calls> per step); <primitive:impl> <ms> ..."
# from a bench_ddp --machine run of STEPS steps (and its 3 warm-up steps) under ONEDNN_VERBOSE=1:
# the exec times of the last STEPS steps' calls
dnnl_share() { # LOG STEPS
  awk -F, -v steps="$2" '
    $1 == "onednn_verbose" && $2 == "exec" { n++; t[n] = $NF; impl[n] = $4 ":" $5 }
    /^model=/ { match($0, / ms=[0-9.]+/); ms = substr($0, RSTART + 4, RLENGTH - 4) }
    END {
      if (!n || !ms) { print "no oneDNN calls or no step time"; exit }
      per = n / (steps + 3); first = n - per * steps + 1; tot = 0
      for (i = first; i <= n; i++) { tot += t[i]; by[impl[i]] += t[i] }
      printf "step %.1f ms; oneDNN %.1f ms/step (%.0f%%, %d calls/step)", ms, tot / steps, 100 * tot / steps / ms, per
      for (k in by) printf "; %s %.1f", k, by[k] / steps
      printf "\n"
    }' "$1"
}

# oneDNN on that CPU: which ISA and kernels it picks (ONEDNN_VERBOSE), and
# the GPT steps on one thread, f32 and bf16, with oneDNN allowed each ISA
# from AVX-512 up to AMX (interleaved rounds; bench_ddp --no-ddp).
phase_dnnl() {
  local d=$OUT/dnnl; mkdir -p "$d"
  ensure_built || return 1
  local b=$BUILD_DIR/bin/bench_ddp round isa m dt
  local th=(OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NABLA_NUM_THREADS=1)
  env "${th[@]}" ONEDNN_VERBOSE=1 "$b" --model gpt --device cpu --no-ddp --bf16 --steps 1 >"$d/verbose-bf16.log" 2>&1
  env "${th[@]}" ONEDNN_VERBOSE=1 "$b" --model gpt --device cpu --no-ddp --steps 1 >"$d/verbose-f32.log" 2>&1
  for f in "$d"/verbose-*.log; do
    note "$(basename "$f"): $(grep -m1 -o 'isa:[^,]*' "$f"); primitives run: $(awk -F, '$2 == "exec" {split($7, a, ":"); print $4 "," $5 "," a[1]}' "$f" | sort | uniq -c | sort -rn | head -6 | tr -s ' \n' ' ')"
  done
  # how much of a step oneDNN's primitives take (their own exec times; the verbose output
  # slows the step itself a little): the rest is casts, our kernels and OpenBLAS
  for m in gpt gpt6; do
    for dt in f32 bf16; do
      env "${th[@]}" ONEDNN_VERBOSE=1 timeout 300 "$b" --model $m --device cpu --no-ddp \
        $( [ $dt = bf16 ] && echo --bf16) --steps 8 --machine >"$d/share-$m-$dt.log" 2>&1
      note "dnnl share $m $dt: $(dnnl_share "$d/share-$m-$dt.log" 8)"
    done
  done
  for round in 1 2; do
    for isa in ALL AVX512_CORE_AMX AVX512_CORE_BF16 AVX512_CORE; do
      for m in gpt gpt6; do
        for dt in f32 bf16; do
          local r
          r=$(env "${th[@]}" ONEDNN_MAX_CPU_ISA=$isa timeout 120 "$b" --model $m --device cpu --no-ddp \
            $( [ $dt = bf16 ] && echo --bf16) --steps "${DNNL_STEPS:-6}" --machine 2>&1 | grep -o 'ms=[0-9.]*' | head -1)
          note "dnnl round $round isa $isa $m $dt: ${r:-failed}"
        done
      done
    done
  done
}

# ------------------------------------------------------------------ perf
# Each step gets what is left of $PERF_BUDGET (less 20 s kept for the pack)
# or its own limit, whichever is less; the logs go to $OUT/perf-logs/,
# packed at the end into $OUT/perf-logs.tar.gz.
PERF_BUDGET=${PERF_BUDGET:-540}
perf_left() { echo $(( PERF_BUDGET - 20 - ($(date +%s) - T0) )); }
perf_run() { # NAME LIMIT LOG CMD...: run under min(LIMIT, what is left)
  local name=$1 limit=$2 log=$3 left; shift 3
  left=$(perf_left)
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then note "$name: not run (PERF_BUDGET ${PERF_BUDGET}s spent)"; return 1; fi
  STEP_TIMEOUT=$limit run "$name" "$log" "$@"
}
# the highest memory.used nvidia-smi reports (MiB, the driver's total - free
# that cudaMemGetInfo gives) while CMD runs
perf_mem_run() { # FILE LIMIT CMD...: CMD's output in FILE, then "mem_used_mib=N" appended
  local file=$1 limit=$2 pid max=0 v rc=0; shift 2
  timeout "$limit" "$@" >"$file" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    v=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | tr -d ' ')
    [ -n "$v" ] && [ "$v" -gt "$max" ] && max=$v
    sleep 0.2
  done
  wait "$pid" || rc=$?
  echo "mem_used_mib=$max" >>"$file"
  return $rc
}
# bench_gpt2's --machine line and the memory in use, as one table row
gpt2_row() { # LOG PATH BATCH
  local m
  m=$(grep -m1 '^model=' "$1")
  if [ -z "$m" ]; then echo "$2 batch $3: no result ($(grep -m1 -i 'error\|out of memory\|abort' "$1" | cut -c1-120))"; return 1; fi
  echo "$2 batch $3: $(echo "$m" | tr ' ' '\n' | grep -E '^(ms|tok_s|mfu|peak_bytes|step_ctx_gib|params_ctx_gib)=' | tr '\n' ' ')$(grep -m1 -o 'mem_used_mib=[0-9]*' "$1")"
}

phase_perf() {
  if ! have_gpu; then note "perf: no GPU here: nothing measured"; return 0; fi
  local logs=$OUT/perf-logs bin=$BUILD_DIR/bin
  rm -rf "$logs"; mkdir -p "$logs"
  # 1. build for this GPU's architecture only (phase_build reads its compute capability)
  local left; left=$(perf_left)
  STEP_TIMEOUT=$(( left < 240 ? left : 240 )) phase_build "$logs" || { perf_pack; return 1; }
  # 2. the GPU parity suites
  perf_run "ctest -L gpu" 150 "$logs/ctest-gpu.log" ctest --test-dir "$BUILD_DIR" -L gpu \
    --output-on-failure --timeout 120 -j4
  grep -E "tests passed|Failed|\*\*\*" "$logs/ctest-gpu.log" | tee -a "$SUMMARY"
  # 3. attention at (8, 12, 1024, 64): each path there is, and PyTorch's SDPA
  perf_run "attention_gpu.py" 120 "$logs/attention.log" python3 benchmarks/attention_gpu.py \
    --bin "$bin" --out "$logs/attention.json"
  sed -n '/^causal attention/,$p' "$logs/attention.log" >"$OUT/attention.txt"
  # 4. GPT-2 small, bf16: batch 8 and the best batch, on each attention path that ran fused
  local paths="composed" p b best
  for p in own cudnn; do
    grep -qE "^$p +fused" "$OUT/attention.txt" && paths="$paths $p"
  done
  {
    echo "bench_gpt2 --bf16 (GPT-2 small, T=1024, 6 steps after 2): step ms, tokens/s, MFU (6N), the"
    echo "device's largest total (peak_bytes, as the meta device's), step and model context peaks (GiB),"
    echo "device memory in use (MiB, nvidia-smi's, as cudaMemGetInfo)"
  } >"$OUT/gpt2.txt"
  for p in $paths; do
    best=""
    for b in 8 16 32; do
      [ "$(perf_left)" -lt 40 ] && { note "bench_gpt2 $p batch $b: not run (PERF_BUDGET spent)"; continue; }
      left=$(perf_left)
      perf_mem_run "$logs/gpt2-$p-b$b.log" $(( left < 90 ? left : 90 )) env NABLA_CUDA_ATTENTION="$p" \
        "$bin/bench_gpt2" --bf16 --batch "$b" --steps 6 --warmup 2 --machine
      if gpt2_row "$logs/gpt2-$p-b$b.log" "$p" "$b" >>"$OUT/gpt2.txt"; then best=$b; else break; fi
    done
    note "bench_gpt2 $p: largest batch that ran ${best:-none} (the best tokens/s is in gpt2.txt)"
  done
  # 5. one step, kernel by kernel, beside the meta device's projection
  local gpu meta_gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null)
  case $gpu in *H200*) meta_gpu=h200 ;; *H100*) meta_gpu=h100 ;; *A100*) meta_gpu=a100 ;; *) meta_gpu="" ;; esac
  perf_run "bench_gpt2 --device meta:cuda" 30 "$logs/meta.log" "$bin/bench_gpt2" --device meta:cuda \
    ${meta_gpu:+--gpu $meta_gpu} --bf16 --batch 8 --steps 1 --warmup 0
  # CUDA events around each backend entry (NABLA_CUDA_PROFILE=events), the third step at
  # batch 8, joined with the meta table entry by entry: with or without ncu (it is cheap)
  perf_run "bench_gpt2 --profile-events, batch 8" 90 "$logs/events-run.log" "$bin/bench_gpt2" \
    --bf16 --batch 8 --steps 2 --warmup 1 --profile-events "$logs/events.txt"
  local ncu
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
  if [ -n "$ncu" ]; then
    perf_run "ncu, one step at batch 8" 180 "$logs/ncu.csv" "$ncu" --clock-control none \
      --metrics gpu__time_duration.sum --csv --print-units base "$bin/bench_gpt2" --bf16 --batch 8 \
      --steps 1 --warmup 0
    python3 benchmarks/kernel_profile.py --ncu "$logs/ncu.csv" --meta "$logs/meta.log" >"$OUT/profile.txt" 2>&1
  else
    python3 benchmarks/kernel_profile.py --meta "$logs/meta.log" >"$OUT/profile.txt" 2>&1
    note "profile: ncu not found: CUDA events per backend entry beside the projection (profile.txt)"
  fi
  echo >>"$OUT/profile.txt"
  python3 benchmarks/kernel_profile.py --events "$logs/events.txt" --meta "$logs/meta.log" >>"$OUT/profile.txt" 2>&1 ||
    note "profile: no events profile ($(tail -1 "$logs/events-run.log" 2>/dev/null | cut -c1-120))"
  perf_pack
}

# 6. pack: the logs into one archive, so $OUT holds summary.txt, attention.txt,
# gpt2.txt, profile.txt and perf-logs.tar.gz
perf_pack() {
  local logs=$OUT/perf-logs
  [ -d "$logs" ] || return 0
  tar -czf "$OUT/perf-logs.tar.gz" -C "$OUT" perf-logs && rm -rf "$logs"
  note "perf: $(find "$OUT" -type f | wc -l) files under $OUT; the logs are in perf-logs.tar.gz"
  for f in attention gpt2 profile; do [ -f "$OUT/$f.txt" ] && { echo; cat "$OUT/$f.txt"; }; done
}

status=0
IFS=, read -ra list <<<"$phases"
for p in "${list[@]}"; do
  case $p in
    probe|build|test|sanitize|bench|cpu|dnnl|cpuddp|perf) note "== phase $p"; "phase_$p" || status=1 ;;
    *) echo "gpu_check: unknown phase $p (probe, build, test, sanitize, bench, cpu, dnnl, cpuddp, perf, all)" >&2; exit 2 ;;
  esac
done
echo; echo "== summary ($OUT/summary.txt)"; cat "$SUMMARY"
exit $status
