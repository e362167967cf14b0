#!/usr/bin/env bash
# Side by side in one run: weft against llama.cpp on the kernel issue's models: decode
# (tg32) and prefill (pp128, pp512) at 1 and 2 threads, and 8 sequences of batched decode
# at 2 threads. Each cell runs both tools back to back. Prints the CPU first (name, family
# and model: "AMD EPYC" names both Zen 3 and Zen 4): quote it with the figures. Needs
# llama.cpp's llama-bench and llama-batched-bench (WEFT_LLAMACPP_DIR) and the models given
# as arguments (default: the real model).
# Usage: scripts/kernels-vs-llamacpp.sh [MODEL.gguf ...]
set -euo pipefail
cd "$(dirname "$0")/.."
L=${WEFT_LLAMACPP_DIR:?set WEFT_LLAMACPP_DIR to llama.cpp build/bin with llama-bench}
cargo build --release --quiet
W=target/release/weft
models=("$@")
[ ${#models[@]} -gt 0 ] || models=("${WEFT_HOME:-$HOME/.cache/weft}/models/gemma-3-270m-q4_k_m.gguf")
lscpu | grep -E "^(Model name|CPU family|Model):"
"$L/llama-bench" -m "${models[0]}" -p 0 -n 1 -r 1 -t 1 -v 2>&1 | grep -o "AVX512[A-Z_0-9]* = 1" | tr '\n' ' ' || true
echo
for m in "${models[@]}"; do
  for t in 1 2; do
    for p in 128 512; do
      echo "== $(basename "$m"), $t thread(s), pp$p / tg32"
      "$L/llama-bench" -m "$m" -p "$p" -n 32 -r 3 -t "$t" -o json 2>/dev/null | python3 -c "
import json, sys
for r in json.load(sys.stdin):
    kind = f'pp{r[\"n_prompt\"]}' if r['n_prompt'] else 'tg32'
    print(f'llama.cpp {kind} {r[\"avg_ts\"]:.1f} tok/s')"
      $W bench --model "$m" -p "$p" -n 32 -r 3 -t "$t" --no-bandwidth --json | python3 -c "
import json, sys
r = json.load(sys.stdin)
print(f'weft pp$p {r[\"pp_tok_s\"]:.1f} tok/s')
print(f'weft tg32 {r[\"tg_tok_s\"]:.1f} tok/s')"
    done
  done
  echo "== $(basename "$m"), 8 sequences batched, 2 threads"
  "$L/llama-batched-bench" -m "$m" -npp 16 -ntg 64 -npl 8 -t 2 -c 1024 2>/dev/null |
    awk -F'|' '/^\|/ && $2 ~ /[0-9]/ { gsub(/ /, "", $9); print "llama.cpp batched S_TG " $9 " tok/s" }'
  $W bench --model "$m" --batch 8 -p 16 -n 64 -r 3 -t 2 --no-bandwidth --json | python3 -c "
import json, sys
r = json.load(sys.stdin)
print(f'weft batched {r[\"batch_tg_tok_s\"]:.1f} tok/s')"
done
