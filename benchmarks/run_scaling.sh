#!/usr/bin/env bash
# bench_scaling: weak scaling of the bundled models (MLP classifier, CNN,
# character-level GPT) over world sizes 1, 2, 4, ... up to --max-world
# (default 4), each rank its own batch. Runs bench_ddp --model M under nbrun
# for each world size, then prints throughput over all ranks, efficiency
# against world size 1 and the share of communication hidden behind
# backward, and writes an SVG plot of the efficiency (throughput over N
# ranks / N x throughput of 1 rank). Step time, wait and hidden share are
# medians over the timed steps. It warns when ranks x threads exceed the
# cores, and prints the load average before and after beside the table.
# The plot also draws, per model, the scaling model's PROJECTED efficiency
# (tools/nb_scale, from the world-1 run's step trace, one rank per node on
# --link LINK); the default link is "measured", fitted to bench_collectives
# --quick at 2 ranks run first, and the plot's title names the link.
#   benchmarks/run_scaling.sh [--max-world N] [--models "mlp cnn gpt"] [--out DIR] [--link LINK]
#                             [bench_ddp args...]
set -euo pipefail
bin=${NABLA_BIN:-$(dirname "$0")/../build/bin}
max="" models="mlp cnn gpt" out=. extra=() gpu=0 link=measured
while [ $# -gt 0 ]; do
  case $1 in
    --max-world) max=$2; shift 2 ;;
    --models) models=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --link) link=$2; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
mkdir -p "$out"
if [ -z "$max" ]; then
  max=4
  case " ${extra[*]-} " in *" --device cpu "*) ;; *)
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ "${gpus:-0}" -gt 0 ] && "$bin/train_gpt" --print-device 2>/dev/null | grep -q cuda; then max=$gpus gpu=1; fi ;;
  esac
fi
# One BLAS thread per rank at every world size (nbrun sets it only for two
# or more ranks), so that world size 1 is the same work on one core.
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# More ranks x threads than cores: the ranks take turns on the cores, and the
# efficiency measures the machine being full, not DDP (GPU runs use a GPU per rank).
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1) # nproc obeys OMP_NUM_THREADS
threads=${NABLA_NUM_THREADS:-$OMP_NUM_THREADS}
case " ${extra[*]-} " in *" --device cuda"*) gpu=1 ;; esac
if [ "$gpu" = 0 ] && [ $((max * threads)) -gt "$cores" ]; then
  echo "run_scaling: warning: up to $max ranks x $threads thread(s) = $((max * threads)) on $cores core(s):" \
       "the rows past $((cores / threads > 0 ? cores / threads : 1)) rank(s) share cores and say little about scaling" \
       "(--max-world $((cores / threads > 0 ? cores / threads : 1)) stays within them)" >&2
fi
load() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || uptime | sed 's/.*average[s]*: //'; }
load_before=$(load)
lines=$(mktemp "${TMPDIR:-/tmp}/nabla_scaling.XXXXXX")
trap 'rm -f "$lines"' EXIT
for m in $models; do
  n=1
  while [ "$n" -le "$max" ]; do
    trace=()
    [ "$n" = 1 ] && trace=(--trace "$out/trace_$m.txt")
    "$bin/nbrun" --nproc-per-node "$n" --master-port 0 "$bin/bench_ddp" --model "$m" --machine "${trace[@]}" \
      ${extra[@]+"${extra[@]}"} | sed 's/^\[rank 0\] //' | tee -a "$lines"
    n=$((n * 2))
  done
done
if [ "$max" -gt 1 ]; then
  if [ "$link" = measured ]; then
    "$bin/nbrun" --nproc-per-node 2 --master-port 0 "$bin/bench_collectives" --quick | sed 's/^\[rank 0\] //' \
      > "$out/collectives.txt"
    link="measured:$out/collectives.txt"
  fi
  for m in $models; do  # "model=M mode=projected world=W efficiency=E link=L" lines for the plot
    if proj=$("$bin/nb_scale" "$out/trace_$m.txt" --per-node 1 --intra "$link" --inter "$link" --max-world "$max"); then
      awk -v m="$m" -v l="${link%%:*}" '$3 == "x" { sub("%", "", $9); printf "model=%s mode=projected world=%s efficiency=%s link=%s\n", m, $1, $9 / 100, l }' \
        <<<"$proj" >> "$lines"
    else
      echo "run_scaling: no projected curve for $m (the message above says why)" >&2
    fi
  done
fi
echo
"$bin/bench_ddp" --plot-scaling "$lines" "$out/scaling.svg"
# The load beside the table: other work on the machine moves these figures.
echo "load average (1, 5, 15 min): $load_before before, $(load) after; $cores core(s)"
