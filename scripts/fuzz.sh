#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets, bodies in crates/weft-fuzz) under cargo-fuzz
# on the nightly toolchain without AddressSanitizer (the paths fuzzed are safe Rust; it
# costs a factor of eight in speed), RUNS executions each, one after another (the machine has
# two cores), growing fuzz/corpus/TARGET. A crash stops the run and is kept in
# fuzz/artifacts/TARGET; fix it, add the input to the corpus, and `cargo test -p
# weft-fuzz` replays it on stable from then on.
# Usage: scripts/fuzz.sh [RUNS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-1000000}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf frame handshake control request template)
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
lscpu | grep "Model name"
for t in "${targets[@]}"; do
  echo "== $t: $runs executions"
  start=$(date +%s)
  log=$(mktemp)
  if ! cargo +nightly fuzz run -O -s none "$t" "fuzz/corpus/$t" -- -runs="$runs" -max_len=65536 \
    -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
    grep -E "panicked|ERROR|SUMMARY|Test unit written" "$log" || tail -20 "$log"
    echo "== $t: crashed; the input is under fuzz/artifacts/$t"
    exit 1
  fi
  grep -E "stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb" "$log"
  rm -f "$log"
  echo "== $t: $(( $(date +%s) - start )) s"
done
