#!/usr/bin/env bash
# `weft simulate`'s predictions for this machine against `weft bench`'s measurements of the
# same runs: one node, TP=2 and PP=2 on two pinned 1-core nodes, at injected link delays.
# The simulation measures this machine first (kernel rates, cached; the rate while two
# nodes share it); the bench then runs every layout side by side. Prints the CPU model:
# quote it with the figures.
# Usage: scripts/simulate-vs-bench.sh [MODEL] [DELAYS] [REPS]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-${WEFT_HOME:-$HOME/.cache/weft}/models/gemma-3-270m-q4_k_m.gguf}
delays=${2:-0,3,300,1000}
reps=${3:-5}
cargo build --release --quiet
W=target/release/weft
lscpu | grep "Model name"
sim=$(mktemp) bench=$(mktemp)
trap 'rm -f "$sim" "$bench"' EXIT
$W simulate --model "$model" --hardware this --threads 1 --same-machine --link shm \
  --nodes 1,2 --layout tp,pp --delay-us "$delays" --prompt 128 --measure --json >"$sim"
$W bench --model "$model" --compare 1,tp2,pp2 --delays "$delays" --pin -p 128 -n 64 \
  -r "$reps" --json >"$bench"
python3 - "$sim" "$bench" <<'PY'
import json, sys
sim = json.load(open(sys.argv[1]))["rows"]
runs = json.load(open(sys.argv[2]))["runs"]
pred = {(r["name"], r["delay_us"]): r for r in sim}
print(f'{"layout":<8} {"delay µs":>8} {"decode sim":>10} {"bench":>7} {"error":>7}'
      f' {"prefill sim":>11} {"bench":>7} {"error":>7}')
within = total = 0
for b in runs:
    p = pred[(b["layout"], b["link_delay_us"])]
    d = p["decode_tok_s"] / b["tg_tok_s"] - 1
    f = p["prefill_tok_s"] / b["pp_tok_s"] - 1
    total += 1
    within += abs(d) <= 0.2
    print(f'{b["layout"]:<8} {b["link_delay_us"]:>8g} {p["decode_tok_s"]:>10.1f} '
          f'{b["tg_tok_s"]:>7.1f} {100*d:>6.0f}% {p["prefill_tok_s"]:>11.1f} '
          f'{b["pp_tok_s"]:>7.1f} {100*f:>6.0f}%')
print(f"decode: {within} of {total} predictions within ±20 %")
PY
