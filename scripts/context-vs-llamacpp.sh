#!/usr/bin/env bash
# Side by side in one run: weft against llama.cpp after a context already in the cache
# (llama-bench's -d, weft bench's --depth): decode (tg32) and prefill (pp512) at each
# depth, so attention's cost at long context shows. Each cell runs both tools back to
# back and prints their ratio. Prints the CPU model first: quote it with the figures.
# The model's trained context must hold the deepest run. Needs llama.cpp's llama-bench
# (WEFT_LLAMACPP_DIR). llama-bench runs its defaults (an f16 KV cache); weft's cache is
# WEFT_CACHE_TYPE (f32 unless set; f16 compares like for like).
# Usage: scripts/context-vs-llamacpp.sh MODEL.gguf [THREADS] [DEPTHS] [PREFILL]
#   defaults: 2 threads, depths 0,1024,4096, prefill 512 (0: decode only)
set -euo pipefail
cd "$(dirname "$0")/.."
L=${WEFT_LLAMACPP_DIR:?set WEFT_LLAMACPP_DIR to llama.cpp build/bin with llama-bench}
m=${1:?usage: scripts/context-vs-llamacpp.sh MODEL.gguf [THREADS] [DEPTHS] [PREFILL]}
t=${2:-2}
depths=${3:-0,1024,4096}
p=${4:-512}
cache=${WEFT_CACHE_TYPE:-f32}
cargo build --release --quiet
W=target/release/weft
lscpu | grep "Model name"
echo "weft KV cache: $cache; llama.cpp: its default (f16)"
for d in ${depths//,/ }; do
  echo "== $(basename "$m"), $t thread(s), depth $d"
  llama=$("$L/llama-bench" -m "$m" -p "$p" -n 32 -d "$d" -r 2 -t "$t" -o json 2>/dev/null | python3 -c "
import json, sys
print(' '.join(f'{r[\"avg_ts\"]:.2f}' for r in json.load(sys.stdin)))")
  weft=$($W bench --model "$m" -p "$p" -n 32 -d "$d" -r 2 -t "$t" --no-bandwidth --cache-type "$cache" --json | python3 -c "
import json, sys
r = json.load(sys.stdin)
print(f'{r[\"pp_tok_s\"]:.2f} {r[\"tg_tok_s\"]:.2f}' if $p > 0 else f'{r[\"tg_tok_s\"]:.2f}')")
  python3 - "$p" "$d" "$llama" "$weft" <<'PY'
import sys
p, d = int(sys.argv[1]), int(sys.argv[2])
llama, weft = [list(map(float, a.split())) for a in sys.argv[3:5]]
names = ([f"pp{p}"] if p > 0 else []) + ["tg32"]
for name, l, w in zip(names, llama, weft):
    print(f"{name} @ d{d}: weft {w:.1f} tok/s, llama.cpp {l:.1f} tok/s, {w / l:.2f}x")
PY
done
