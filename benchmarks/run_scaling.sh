#!/usr/bin/env bash
# bench_scaling: weak scaling of the bundled models (MLP classifier, CNN,
# character-level GPT) over world sizes 1, 2, 4, ... up to --max-world
# (default 4), each rank its own batch. Runs bench_ddp --model M under nbrun
# for each world size, then prints throughput over all ranks, efficiency
# against world size 1 and the share of communication hidden behind
# backward, and writes an SVG plot of the efficiency (throughput over N
# ranks / N x throughput of 1 rank).
#   benchmarks/run_scaling.sh [--max-world N] [--models "mlp cnn gpt"] [--out DIR] [bench_ddp args...]
set -euo pipefail
bin=${NABLA_BIN:-$(dirname "$0")/../build/bin}
max="" models="mlp cnn gpt" out=. extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --max-world) max=$2; shift 2 ;;
    --models) models=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
mkdir -p "$out"
if [ -z "$max" ]; then
  max=4
  case " ${extra[*]-} " in *" --device cpu "*) ;; *)
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ "${gpus:-0}" -gt 0 ] && "$bin/train_gpt" --print-device 2>/dev/null | grep -q cuda; then max=$gpus; fi ;;
  esac
fi
# One BLAS thread per rank at every world size (nbrun sets it only for two
# or more ranks), so that world size 1 is the same work on one core.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
lines=$(mktemp "${TMPDIR:-/tmp}/nabla_scaling.XXXXXX")
trap 'rm -f "$lines"' EXIT
for m in $models; do
  n=1
  while [ "$n" -le "$max" ]; do
    "$bin/nbrun" --nproc-per-node "$n" --master-port 0 "$bin/bench_ddp" --model "$m" --machine ${extra[@]+"${extra[@]}"} \
      | sed 's/^\[rank 0\] //' | tee -a "$lines"
    n=$((n * 2))
  done
done
echo
"$bin/bench_ddp" --plot-scaling "$lines" "$out/scaling.svg"
