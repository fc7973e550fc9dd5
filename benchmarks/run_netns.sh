#!/usr/bin/env bash
# DDP across two "machines" on a link of limited bandwidth: bench_ddp under
# `nbrun --nnodes 2`, one node in each of two network namespaces joined by a
# veth pair (10.213.0.1 and 10.213.0.2, only inside them), the link shaped
# with tc's token bucket filter (tbf) on both ends, and one table row per
# rate: step time, backward, the wait for buckets after backward, the share
# of all-reduce time hidden behind backward, the bytes the veth carried per
# step and what they take on the wire at that rate, and beside the measured
# step the scaling model's projection (tools/nb_scale, a PROJECTION) from
# rank 0's step trace of the same run (bench_ddp --trace: its forward,
# backward alone, optimizer and gradient-ready times), with the link given
# as 50 us of latency (assumed) and the tbf rate, and the ratio projected /
# measured: a check of the model's communication, the compute being the
# run's own. The projection is of a flat ring over all the ranks (nb_scale
# --per-node 1), as Gloo runs it: its ring crosses the veth in each
# direction whatever the ranks per node. With --fit the link is instead the "measured" one (nb_scale's
# measured:FILE) fitted to bench_collectives --quick run on the same
# shaped link with the same ranks just before, and its fitted latency and
# bandwidth are printed above the row. With bench_ddp --text the row ends
# with rank 0's training loss (the mean of the last 10 steps).
#
#   benchmarks/run_netns.sh                                   # unlimited, 1gbit, 100mbit
#   benchmarks/run_netns.sh --rates "1gbit 10mbit" --nproc-per-node 2 -- --model gpt --steps 20
#   benchmarks/run_netns.sh --fit --rates 100mbit -- --model cnn --steps 10
#
# Options before `--` are the script's; what follows goes to bench_ddp
# (default: --model wide, 4 x 512, batch 64, 30 steps). Needs root (ip netns,
# tc). Everything it makes is deleted on exit, even on failure or Ctrl-C.
# tbf's queue is sized for 100 ms at the rate (latency) and its burst for
# 1 ms (at least 16 KiB); netem (delay, loss) is not needed for this. The
# burst was 2 ms and at least 64 KiB: tokens saved while a rank computes
# then let most of a small all-reduce (the CNN's 96 KB) through at the
# veth's own speed, a link that neither the fitted one nor nb_scale has;
# once Gloo groups sent their steps on blocking connections (2026-12-02;
# the CNN's step at world 2 on 100mbit from 46.8 to 8.3 ms) the CNN ran 1.28
# and 1.66 times faster than projected at world 2 and 4, and 0.91 and 1.08
# with this burst (benchmarks/RESULTS.md). Every
# rank computes on one thread (OPENBLAS_NUM_THREADS=1, NABLA_NUM_THREADS=1).
# Both "nodes" run on this one machine's CPUs, so neither nbrun binds its
# ranks (--cpu-bind none): each would bind its local rank r to the same
# CPU r as if it owned the machine (Note [CPU binding]), putting one rank of
# each node on every CPU, which no real pair of nodes does. With that
# binding the CNN's step at world 4 on 100mbit mostly ran 14.0-14.2 ms against
# 14.6-15.1 unbound and test_scale_netns missed its 15% on it in 3 of 4
# runs on a quiet 2-vCPU machine (2026-12-02).
set -euo pipefail
bin=${NABLA_BIN:-$(dirname "$0")/../build/bin}
rates="unlimited 1gbit 100mbit"
nproc=1
port=29615
run_s=300
fit=0
while [ $# -gt 0 ]; do
  case "$1" in
    --rates) rates=$2; shift 2 ;;
    --nproc-per-node) nproc=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --fit) fit=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "run_netns.sh: needs root (ip netns, tc)" >&2; exit 1; }

ns=(nbbn$$a nbbn$$b)
veth=(nbbv$$a nbbv$$b)
addr=(10.213.0.1 10.213.0.2)
cleanup() {
  for n in "${ns[@]}"; do
    for p in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$n" 2>/dev/null || true
  done
}
trap 'cleanup; rm -f "${trace:-}" "${table:-}"' EXIT
trap 'exit 130' INT TERM

ip netns add "${ns[0]}"
ip netns add "${ns[1]}"
ip link add "${veth[0]}" type veth peer name "${veth[1]}"
for i in 0 1; do
  ip link set "${veth[i]}" netns "${ns[i]}"
  ip -n "${ns[i]}" addr add "${addr[i]}/24" dev "${veth[i]}"
  ip -n "${ns[i]}" link set lo up
  ip -n "${ns[i]}" link set "${veth[i]}" up
done

bits() {  # 1gbit -> 1000000000
  local r=$1 n=${1%%[a-z]*}
  case "${r#"$n"}" in
    gbit) echo $((n * 1000000000)) ;;
    mbit) echo $((n * 1000000)) ;;
    kbit) echo $((n * 1000)) ;;
    bit|"") echo "$n" ;;
    *) echo "run_netns.sh: rate $r: use gbit, mbit or kbit" >&2; exit 2 ;;
  esac
}
tx() { ip -n "${ns[$1]}" -s -j link show "${veth[$1]}" | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["stats64"]["tx"]["bytes"])'; }

bench=("$@")
steps=30
psgd=() plain=()  # plain: the arguments without --powersgd, for the run without DDP below
for ((k = 0; k < ${#bench[@]}; k++)); do
  [ "${bench[k]}" = --steps ] && steps=${bench[k + 1]}
  if [ "${bench[k]}" = --powersgd ]; then psgd=(--powersgd "${bench[k + 1]}"); k=$((k + 1)); continue; fi
  plain+=("${bench[k]}")
done
params=$("$bin/bench_ddp" --no-ddp --machine "${plain[@]}" --steps 1 | sed -n 's/.*params=\([0-9]*\).*/\1/p')
world=$((2 * nproc))
# both nodes' store secret (nbrun --nnodes needs one): random, for this run only
export NABLA_STORE_SECRET=${NABLA_STORE_SECRET:-$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')}
trace=$(mktemp /tmp/nb_netns_trace.XXXXXX)
table=$(mktemp /tmp/nb_netns_coll.XXXXXX)
# runs "$@" (a program and its arguments) on both nodes under nbrun; rank 0's output, prefix removed
on_both() {
  local id=$1; shift
  env NABLA_RUN_ID="$id" OPENBLAS_NUM_THREADS=1 NABLA_NUM_THREADS=1 NABLA_PG_TIMEOUT=120 \
    timeout "$run_s" ip netns exec "${ns[1]}" "$bin/nbrun" --nnodes 2 --node-rank 1 --nproc-per-node "$nproc" --cpu-bind none \
    --master-addr "${addr[0]}" --master-port "$port" "$@" >/dev/null &
  local other=$!
  env NABLA_RUN_ID="$id" OPENBLAS_NUM_THREADS=1 NABLA_NUM_THREADS=1 NABLA_PG_TIMEOUT=120 \
    timeout "$run_s" ip netns exec "${ns[0]}" "$bin/nbrun" --nnodes 2 --node-rank 0 --nproc-per-node "$nproc" --cpu-bind none \
    --master-addr "${addr[0]}" --master-port "$port" "$@" | sed -n 's/^\[rank 0\] //p'
  wait "$other"
}
echo "bench_ddp ${bench[*]:-(defaults)} on 2 nodes x $nproc (world $world): $params parameters," \
     "$((params * 4)) bytes of gradients per step"
printf '%-10s %9s %10s %10s %8s %13s %9s %9s %9s\n' link ms/step backward wait hidden "veth B/step" "wire ms" \
  "proj ms" "proj/meas"
for rate in $rates; do
  for i in 0 1; do
    if [ "$rate" = unlimited ]; then
      tc -n "${ns[i]}" qdisc del dev "${veth[i]}" root 2>/dev/null || true
    else
      b=$(bits "$rate")
      burst=$((b / 8 / 1000)); [ "$burst" -ge 16384 ] || burst=16384
      tc -n "${ns[i]}" qdisc replace dev "${veth[i]}" root tbf rate "$rate" burst "$burst" latency 100ms
    fi
  done
  if [ "$fit" = 1 ] && [ "$rate" != unlimited ]; then
    on_both "netns-coll-$$-$rate" "$bin/bench_collectives" --quick >"$table"
  fi
  before=$(tx 0)
  row=$(on_both "netns-bench-$$-$rate" "$bin/bench_ddp" --machine --trace "$trace" "${bench[@]}")
  sent=$(( ($(tx 0) - before) / (steps + 3) ))
  # bench_ddp --machine: key=value fields
  field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<" $row"; }
  ms=$(printf '%.2f' "$(field ms)") bw=$(printf '%.2f' "$(field ddp_backward_ms)")
  wt=$(printf '%.2f' "$(field wait_ms)") hid=$(awk -v h="$(field hidden)" 'BEGIN { printf "%.0f%%", 100 * h }')
  if [ "$rate" = unlimited ]; then wire=-; else wire=$(awk -v s="$sent" -v b="$(bits "$rate")" 'BEGIN { printf "%.1f", 8e3 * s / b }'); fi
  proj=- ratio=-
  if [ "$rate" != unlimited ]; then
    link="50,$(awk -v b="$(bits "$rate")" 'BEGIN { printf "%.6g", b / 8e9 }')"
    if [ "$fit" = 1 ]; then
      link="measured:$table"
      "$bin/nb_scale" "$trace" --per-node 1 --inter "$link" --max-world 1 |
        sed -n 's/^  between nodes: measured (\(.*\); fitted.*/# '"$rate"': fitted link \1/p'
    fi
    proj=$("$bin/nb_scale" "$trace" --per-node 1 --inter "$link" --max-world "$world" "${psgd[@]}" |
      awk -v w="$world" '$1 == w && $3 == "x" { print $6 }')
    ratio=$(awk -v p="$proj" -v m="$ms" 'BEGIN { printf "%.2f", p / m }')
  fi
  loss=$(field loss)
  printf '%-10s %9s %10s %10s %8s %13s %9s %9s %9s%s\n' "$rate" "$ms" "$bw ms" "$wt ms" "$hid" "$sent" "$wire" \
    "$proj" "$ratio" "${loss:+   loss $loss}"
done
