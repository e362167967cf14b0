#!/usr/bin/env bash
# Shard sharing over real links: the coordinator in the root namespace, two nodes each in
# its own network namespace (veth pairs on a bridge, 10.79.0.0/24) with an empty weft home.
# Reports, in one run:
#   1. the link's TCP bandwidth (one stream, 1 GiB, Python sockets, the bytes dropped),
#      the rate at which a plain receiver stores the model file sent over it, and the
#      rate at which a node fetched its shard (the whole model, one node) over the same
#      link, alternated ROUNDS times (default 5), the median ratio reported;
#   2. the time to the first token of a cold two-node cluster (TP=2, each node fetching
#      only its shard) beside one whose nodes first copy the whole file over the same
#      links (both copies at once, as a user would start them) and then load it.
# Usage: scripts/share-bench.sh MODEL.gguf   (needs root: ip netns)
# LINK_RATE=10gbit (any tc rate) shapes the links to a real network's rate. Unshaped, a
# veth pair moves bytes as fast as the CPUs copy them, so on a small machine the link
# test and the fetch compete for the same cores and the link is the CPU, not a network.
set -euo pipefail
MODEL=${1:?usage: $0 MODEL.gguf}
WEFT=${WEFT:-$(dirname "$0")/../target/release/weft}
SECRET=share-bench-secret-0f1e2d3c4b5a69788796a5b4c3d2e1f0
# The nodes' homes (their shard caches) live here: a disk by default, as on real nodes;
# SHARE_BENCH_DIR=/dev/shm keeps them in memory, to see the transport alone.
WORK=$(mktemp -d "${SHARE_BENCH_DIR:-/tmp}/share-bench.XXXX")
BR=wsbr0
stop_nodes() { for i in 1 2; do ip netns pids wsn$i 2>/dev/null | xargs -r kill 2>/dev/null || true; done; sleep 0.5; }
cleanup() {
  stop_nodes
  for i in 1 2; do ip netns del wsn$i 2>/dev/null || true; ip link del wsv$i 2>/dev/null || true; done
  ip link del $BR 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
ip link add $BR type bridge && ip addr add 10.79.0.1/24 dev $BR && ip link set $BR up
for i in 1 2; do
  ip netns add wsn$i
  ip link add wsv$i type veth peer name eth0 netns wsn$i
  ip link set wsv$i master $BR up
  ip netns exec wsn$i ip addr add 10.79.0.$((i + 1))/24 dev eth0
  ip netns exec wsn$i ip link set eth0 up
  ip netns exec wsn$i ip link set lo up
  # LINK_RATE=10gbit shapes each link (a token bucket on the bridge's side, toward the
  # node) to a real network's rate; unset, the veth runs as fast as the CPUs copy.
  [ -n "${LINK_RATE:-}" ] && tc qdisc add dev wsv$i root tbf rate "$LINK_RATE" burst 4mb latency 100ms
done
CAL="${WEFT_HOME:-$HOME/.cache/weft}/calibration"
home() { mkdir -p "$WORK/$1/calibration"; cp -r "$CAL"/. "$WORK/$1/calibration/" 2>/dev/null || true; echo "$WORK/$1"; }
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p')"
echo "model: $MODEL ($(stat -c %s "$MODEL") bytes); links: ${LINK_RATE:-unshaped veth}"

# 1. Link bandwidth: 1 GiB over one TCP stream into namespace 1.
cat > "$WORK/sink.py" <<'EOF'
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
c, _ = s.accept(); n = 0
out = open(sys.argv[3], "wb") if len(sys.argv) > 3 else None
# One reused buffer: recv() would allocate (and fault in) a fresh megabyte per call,
# which on this VM costs more than the link and made the link look slower than it is.
buf = memoryview(bytearray(1 << 20))
while True:
    k = c.recv_into(buf)
    if not k: break
    n += k
    if out: out.write(buf[:k])
print(n)
EOF
cat > "$WORK/send.py" <<'EOF'
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
t = time.time()
if sys.argv[3] == "zeros":
    buf = bytes(1 << 20); n = 0
    while n < (1 << 30): c.sendall(buf); n += len(buf)
else:
    buf = memoryview(bytearray(1 << 20))
    with open(sys.argv[3], "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k: break
            c.sendall(buf[:k])
c.shutdown(socket.SHUT_WR); c.recv(1)
print(time.time() - t)
EOF
node() { # NS HOME -> address
  ip netns exec wsn$1 env WEFT_HOME="$2" "$WEFT" node --listen 10.79.0.$(($1 + 1)):7411 --no-mdns \
    --threads 1 --secret $SECRET > "$2/node.log" 2>&1 &
  for _ in $(seq 100); do grep -q "listening on" "$2/node.log" 2>/dev/null && break; sleep 0.1; done
  echo 10.79.0.$(($1 + 1)):7411
}
run() { # PEERS LAYOUT... -> JSON
  local peers=$1; shift
  WEFT_HOME=$(home coord) "$WEFT" run --model "$MODEL" --peers "$peers" --secret $SECRET \
    --prompt "The quick brown fox" -n 4 --temperature 0 --json "$@"
}
link() {
  ip netns exec wsn1 python3 "$WORK/sink.py" 10.79.0.2 9000 > /dev/null &
  sleep 0.5
  local secs; secs=$(python3 "$WORK/send.py" 10.79.0.2 9000 zeros)
  wait
  python3 -c "print(f'{(1<<30)/$secs/1e6:.0f}')"
}
# The same link carrying the model file to a plain receiver that only stores it on the
# node's disk (no protocol, no hashing): what storing alone leaves of the link's rate.
plain_store() {
  ip netns exec wsn1 python3 "$WORK/sink.py" 10.79.0.2 9002 "$WORK/plain.bin" > /dev/null &
  sleep 0.5
  local secs; secs=$(python3 "$WORK/send.py" 10.79.0.2 9002 "$MODEL")
  wait
  rm -f "$WORK/plain.bin"; sync
  python3 -c "print(f'{$(stat -c %s "$MODEL")/$secs/1e6:.0f}')"
}

# 1. Link bandwidth (1 GiB, one TCP stream into namespace 1) and one node fetching the
# whole model over it from an empty cache, alternated ROUNDS times (default 5); the
# median of the ratios is the figure. Each round's cache is deleted before the next, so
# every round writes into memory the system has had before (on a VM, pages touched for
# the first time cost the host a fault each, which no real machine pays).
RATIOS=(); PLAINS=()
for round in $(seq "${ROUNDS:-5}"); do
  LINK=$(link)
  PLAIN=$(plain_store)
  A=$(node 1 "$(home solo)")
  OUT=$(run "$A" --tp 1)
  R=$(echo "$OUT" | python3 -c "
import json, sys
f = json.load(sys.stdin)['fetched'][0]
mb = f['fetched_bytes'] / f['seconds'] / 1e6
print(f\"{100 * mb / $LINK:.1f} {100 * mb / $PLAIN:.1f} round $round: link $LINK MB/s, plain store $PLAIN MB/s; fetch {f['fetched_bytes']} bytes in {f['seconds']:.2f}s = {mb:.0f} MB/s, {100 * mb / $LINK:.0f} % of the link, {100 * mb / $PLAIN:.0f} % of the plain store\")")
  R1=${R#* }
  echo "${R1#* }"
  RATIOS+=("${R%% *}")
  PLAINS+=("${R1%% *}")
  stop_nodes
  # The next round starts on a quiet disk: this round's dirty pages written back first.
  rm -rf "$WORK/solo"; sync
done
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
echo "fetch/link over ${#RATIOS[@]} rounds: median $(median "${RATIOS[@]}") %, best $(printf '%s\n' "${RATIOS[@]}" | sort -n | tail -1) %"
echo "fetch/plain store over ${#PLAINS[@]} rounds: median $(median "${PLAINS[@]}") %"

# 2a. Cold TP=2: each node fetches only its shard. Wall time of the whole run, and setup.
A=$(node 1 "$(home cold1)"); B=$(node 2 "$(home cold2)")
T0=$(date +%s.%N)
OUT=$(run "$A,$B" --tp 2)
T1=$(date +%s.%N)
echo "$OUT" | python3 -c "
import json, sys
r = json.load(sys.stdin)
fs = r['fetched']
for f in fs:
    print(f\"  node fetched {f['fetched_bytes']} of its {f['shard_bytes']}-byte shard in {f['seconds']:.2f}s: \" + ', '.join(f\"{s['bytes']} from {s['name']}\" for s in f['sources']))
print(f\"cold TP=2: setup {r['setup_s']:.2f}s (fetched {sum(f['fetched_bytes'] for f in fs)} bytes, shards {[f['shard_bytes'] for f in fs]}), first token at {r['setup_s'] + len(r['prompt_ids']) / r['prefill_tok_s']:.2f}s\")"
echo "cold TP=2: whole run $(python3 -c "print(f'{$T1 - $T0:.2f}')")s"
stop_nodes

# 2b. Copy the whole file to each node first (both copies at once), then the same run.
C1=$(home copy1); C2=$(home copy2); mkdir -p "$C1/models" "$C2/models"
T0=$(date +%s.%N)
ip netns exec wsn1 python3 "$WORK/sink.py" 10.79.0.2 9001 "$C1/models/m.gguf" > /dev/null &
ip netns exec wsn2 python3 "$WORK/sink.py" 10.79.0.3 9001 "$C2/models/m.gguf" > /dev/null &
sleep 0.5
python3 "$WORK/send.py" 10.79.0.2 9001 "$MODEL" > /dev/null &
python3 "$WORK/send.py" 10.79.0.3 9001 "$MODEL" > /dev/null &
wait
T1=$(date +%s.%N)
ip netns exec wsn1 env WEFT_HOME="$C1" "$WEFT" node --listen 10.79.0.2:7411 --no-mdns --threads 1 \
  --secret $SECRET --model "$C1/models/m.gguf" > "$C1/node.log" 2>&1 &
ip netns exec wsn2 env WEFT_HOME="$C2" "$WEFT" node --listen 10.79.0.3:7411 --no-mdns --threads 1 \
  --secret $SECRET --model "$C2/models/m.gguf" > "$C2/node.log" 2>&1 &
for _ in $(seq 100); do grep -q "listening on" "$C1/node.log" "$C2/node.log" 2>/dev/null && break; sleep 0.1; done
sleep 0.5
OUT=$(run 10.79.0.2:7411,10.79.0.3:7411 --tp 2)
T2=$(date +%s.%N)
echo "$OUT" | python3 -c "
import json, sys
r = json.load(sys.stdin)
copy = $T1 - $T0
print(f\"copy-first TP=2: copying the file to both nodes {copy:.2f}s, then setup {r['setup_s']:.2f}s, first token at {copy + r['setup_s'] + len(r['prompt_ids']) / r['prefill_tok_s']:.2f}s\")"
echo "copy-first TP=2: whole run (copy + run) $(python3 -c "print(f'{$T2 - $T0:.2f}')")s"
