#!/usr/bin/env bash
# DDP overhead and weak scaling on the CPU: bench_ddp without DDP, with DDP
# at world size 1, then at 2 and 4 ranks (each rank its own batch). Extra
# arguments go to bench_ddp (e.g. --steps 50 --width 1024).
set -euo pipefail
bin=${NABLA_BIN:-$(dirname "$0")/../build/bin}
"$bin/bench_ddp" --header
"$bin/nbrun" --nproc-per-node 1 --master-port 0 "$bin/bench_ddp" --no-ddp "$@" | sed 's/^\[rank 0\] //'
for n in 1 2 4; do
  "$bin/nbrun" --nproc-per-node "$n" --master-port 0 "$bin/bench_ddp" "$@" | sed 's/^\[rank 0\] //'
done
