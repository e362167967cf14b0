#!/usr/bin/env bash
# Side by side in one run: weft against llama.cpp on a synthetic 1 B qwen3moe (64 experts,
# 8 active) at Q4_K_M, 1 and 2 threads, alternating for ROUNDS rounds; then EP=2 (plain and
# with 4 spare experts a group) and TP=2 on two pinned 1-core nodes against one. Prints the CPU model first: quote it with the
# figures. Needs llama.cpp's tools (WEFT_LLAMACPP_DIR, or .ci/llamacpp.sh builds them).
# Usage: scripts/moe-vs-llamacpp.sh [DIR] [ROUNDS]   (DIR keeps the 2 GB F16 and 0.6 GB model)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-/tmp/weft-moe1b}
rounds=${2:-2}
L=${WEFT_LLAMACPP_DIR:-$(.ci/llamacpp.sh | tail -n 1)}
cargo build --release --quiet
W=target/release/weft
mkdir -p "$dir"
M=$dir/moe1b-q4km.gguf
if [ ! -f "$M" ]; then
  $W synth "$dir/moe1b-f16.gguf" --type F16 --embd 1024 --layers 10 --heads 16 --heads-kv 4 \
    --head-dim 64 --ff 2816 --experts 64 --experts-used 8 --expert-ff 512 --seed 1
  "$L/llama-quantize" "$dir/moe1b-f16.gguf" "$M" Q4_K_M 2 >/dev/null 2>&1
fi
lscpu | grep "Model name"
for round in $(seq "$rounds"); do
  for t in 1 2; do
    echo "== round $round, $t thread(s)"
    "$L/llama-bench" -m "$M" -p 64 -n 32 -r 3 -t "$t" -o json 2>/dev/null | python3 -c "
import json, sys
for r in json.load(sys.stdin):
    kind = 'pp64' if r['n_prompt'] else 'tg32'
    print(f'llama.cpp {kind} {r[\"avg_ts\"]:.1f} tok/s')"
    $W bench --model "$M" -p 64 -n 32 -r 3 -t "$t" --no-bandwidth --json | python3 -c "
import json, sys
d = json.load(sys.stdin); m = d['moe']
print(f'weft pp64 {d[\"pp_tok_s\"]:.1f} tok/s')
print(f'weft tg32 {d[\"tg_tok_s\"]:.1f} tok/s')
print(f'weft MoE: {m[\"active_params\"]/1e9:.3f} B of {m[\"total_params\"]/1e9:.3f} B parameters active; '
      f'bytes per decoded token {m[\"measured_bytes_per_token\"]/1e6:.1f} MB read, '
      f'{m[\"active_bytes_per_token\"]/1e6:.1f} MB active, {m[\"total_bytes\"]/1e6:.1f} MB total')"
  done
done
echo "== EP=2, EP=2 with 4 spares a group and TP=2 on two pinned 1-core nodes against one pinned 1-core node"
$W bench --model "$M" --compare 1,ep2,ep2s4,tp2 --pin -p 64 -n 32 -r 3
