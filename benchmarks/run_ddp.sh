#!/usr/bin/env bash
# DDP overhead and weak scaling on the CPU, as one table: bench_ddp without
# DDP, with DDP at world size 1, then at 2 and 4 ranks (each rank its own
# batch). Extra arguments go to bench_ddp (e.g. --model gpt, --steps 50,
# --width 1024); docs/benchmarks.md explains the columns.
set -euo pipefail
bin=${NABLA_BIN:-$(dirname "$0")/../build/bin}
# the first run prints the line naming the model and the header, the others their row alone
"$bin/nbrun" --nproc-per-node 1 --master-port 0 "$bin/bench_ddp" --no-ddp "$@" | sed 's/^\[rank 0\] //'
for n in 1 2 4; do
  "$bin/nbrun" --nproc-per-node "$n" --master-port 0 "$bin/bench_ddp" --no-header "$@" | sed 's/^\[rank 0\] //'
done
