#!/bin/sh
# Builds fuzz/fuzz_store.c with clang's libFuzzer, ASan and UBSan, seeds a
# corpus with a few valid messages, and fuzzes the store's message handling.
#   fuzz/run_store.sh [seconds]      (default 300)
# Output in build-fuzz/; crashes are written there as crash-*.
set -eu
cd "$(dirname "$0")/.."
secs=${1:-300}
out=build-fuzz
cc=${CLANG:-clang-14}
mkdir -p "$out/corpus-store"
"$cc" -g -O1 -std=c11 -D_POSIX_C_SOURCE=200809L -DNABLA_HAVE_CUDA=0 -DNABLA_HAVE_GLOO=0 \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I include -I . fuzz/fuzz_store.c distributed/store_proto.c distributed/store_kv.c tensor/error.c \
  -o "$out/fuzz_store"

# Seeds: HELLO (run "run-a", rank -1, a nonce of 32 zeros), then one request each.
hello='\072\000\000\000\001NBS2\005\000\000\000run-a\377\377\377\377\377\377\377\377\040\000\000\000'
hello="$hello$(printf '%.0s\\000' $(seq 32))"
seed() { printf "$hello$2" > "$out/corpus-store/$1"; }
seed set   '\013\000\000\000\002\001\000\000\000k\001\000\000\000v'
seed get   '\013\000\000\000\002\001\000\000\000k\001\000\000\000v\016\000\000\000\004\001\000\000\000k\000\000\000\000\000\000\000\000'
seed add   '\016\000\000\000\006\001\000\000\000n\005\000\000\000\000\000\000\000'
seed cas   '\020\000\000\000\007\001\000\000\000c\000\000\000\000\000\001\000\000\000x'
seed wait  '\027\000\000\000\005\002\000\000\000\001\000\000\000a\001\000\000\000b\000\000\000\000\000\000\000\000'
seed mget  '\012\000\000\000\011\001\000\000\000\001\000\000\000a'
seed del   '\006\000\000\000\010\001\000\000\000k'
seed bye   '\001\000\000\000\012'

"$out/fuzz_store" -max_total_time="$secs" -max_len=4096 -print_final_stats=1 "$out/corpus-store"
