#!/bin/sh
# The run behind `make demo`: trains a small character-level GPT on the
# shipped Jane Austen novels with DDP, on every local GPU when the build
# computes on CUDA and a GPU is visible, else on 2 CPU processes, for about
# a minute on a 2-core machine. It prints the command it runs, the falling
# loss, a sample of generated text, and where the checkpoint, metrics and
# plot went.
#
#   examples/run_demo.sh BUILD_DIR [train_gpt flags...]
#
# Flags given after BUILD_DIR override the demo's (the last one wins), e.g.
# `--steps 20` for a quick check. NABLA_DEMO_DIR sets the output directory
# (default BUILD_DIR/demo).
set -eu
if [ $# -lt 1 ]; then
  echo "usage: $0 BUILD_DIR [train_gpt flags...]" >&2
  exit 2
fi
build=$1
shift
bin=$build/bin
out=${NABLA_DEMO_DIR:-$build/demo}
for p in nbrun train_gpt; do
  if [ ! -x "$bin/$p" ]; then
    echo "demo: $bin/$p was not built" >&2
    exit 1
  fi
done

device=$("$bin/train_gpt" --print-device)
case $device in
  cuda*) nproc=gpu; where="every local GPU" ;;
  *) nproc=2; where="2 CPU processes (this build computes on the CPU)" ;;
esac
echo "demo: a character-level GPT on Jane Austen's novels, DDP on $where"
set -- "$bin/nbrun" --nproc-per-node "$nproc" "$bin/train_gpt" \
  --layers 3 --heads 4 --width 96 --seq-len 64 --batch-size 16 \
  --steps 800 --warmup 50 --lr 3e-3 --eval-interval 200 --log-interval 100 \
  --sample-len 300 --prompt "Elizabeth" \
  --ckpt-dir "$out" --metrics "$out/metrics.jsonl" --plot "$out/loss.svg" "$@"
# The plot train_gpt writes: the last --plot, else the last --metrics with
# .svg (the last of a repeated flag wins), as train_gpt decides it.
plot="" metrics="" steps="" prev=""
for a in "$@"; do
  case $prev in --plot) plot=$a ;; --metrics) metrics=$a ;; --steps) steps=$a ;; esac
  case $a in --plot=*) plot=${a#--plot=} ;; --metrics=*) metrics=${a#--metrics=} ;; esac
  prev=$a
done
if [ -z "$plot" ] && [ -n "$metrics" ]; then
  case ${metrics##*/} in *.*) plot=${metrics%.*}.svg ;; *) plot=$metrics.svg ;; esac
fi
# the whole command, each argument quoted where it needs it, so it can be copied
printf 'demo:'
for a in "$@"; do
  case $a in
    *[!A-Za-z0-9_./=:,+-]*|"") printf " '%s'" "$(printf '%s' "$a" | sed "s/'/'\\\\''/g")" ;;
    *) printf ' %s' "$a" ;;
  esac
done
printf '\n'
"$@"
if [ -n "$plot" ] && [ -f "$plot" ]; then
  echo "demo: done. The loss curves are in $plot (open it in a browser)."
else
  echo "demo: done."
fi
case $steps in
  ''|*[!0-9]*) more=1600 ;;
  *) more=$((steps * 2)) ;;
esac
echo "demo: to train further from the checkpoint: make demo DEMO_ARGS=\"--resume --steps $more\""
