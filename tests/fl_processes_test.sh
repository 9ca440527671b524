#!/usr/bin/env bash
# `dtrain fl serve` and three `dtrain fl client` processes on 127.0.0.1: the server is killed
# (SIGKILL) once round 1 is in its metrics and restarted on the same port; it resumes from its
# checkpoint, the same client processes reconnect (retrying with back-off) and the run completes
# round 4, every client told the training is over. Then 2 rounds with secure aggregation over
# 3 client processes (one with its own data, testing its personalized model on a held-out quarter). Bad flags and a damaged checkpoint exit
# non-zero with the flag or file named (the checkpoint left as it was).
# Usage: fl_processes_test.sh PATH/TO/dtrain
set -uo pipefail
dtrain=$1
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAILED: $*"; for f in "$work"/*.log; do echo "--- $f"; cat "$f"; done; exit 1; }

data="--dataset synthetic --synthetic-examples 3000 --seed 1"
# The port a server wrote to its log ("(port N)"), waiting for it (bounded).
port_of() {
  local p=
  for _ in $(seq 100); do
    p=$(sed -n 's/.*(port \([0-9]*\)).*/\1/p' "$1" | head -1)
    [[ -n $p ]] && break
    sleep 0.1
  done
  echo "$p"
}
serve() {
  "$dtrain" fl serve --listen "127.0.0.1:$1" --rounds 4 --clients-per-round 3 --hidden 64 \
    --local-epochs 3 --local-batch 10 --compression topk:0.1 $data --checkpoint-dir "$work/ck" \
    --metrics "$work/m.jsonl" --round-timeout 30 --no-progress >>"$work/server.log" 2>&1 &
  server=$!
  pids+=("$server")
}
serve 0
port=$(port_of "$work/server.log")
[[ -n $port ]] || fail "the server did not say its port"
for i in 0 1 2; do
  "$dtrain" fl client --server "127.0.0.1:$port" --partition "$i/3" --client-id "dev$i" $data \
    --threads 1 --wait-ms 1000 >"$work/client$i.log" 2>&1 &
  clients[$i]=$!
  pids+=("${clients[$i]}")
done
# Kill the server once round 1 is recorded (bounded wait).
for _ in $(seq 600); do
  grep -q "\"round\":1," "$work/m.jsonl" 2>/dev/null && break
  sleep 0.1
done
grep -q "\"round\":1," "$work/m.jsonl" || fail "round 1 never finished"
kill -9 "$server"
wait "$server" 2>/dev/null
killed_at=$(grep -c '"event":"round"' "$work/m.jsonl")
[[ $killed_at -lt 4 ]] || fail "the run was over before the server could be killed"
sleep 1
serve "$port"
for i in 0 1 2; do
  wait "${clients[$i]}" || fail "client $i exited with $?"
  grep -q "the last round is over" "$work/client$i.log" || fail "client $i was not told the run is over"
done
wait "$server" || fail "the restarted server exited with $?"
grep -q "resumed at round [123]" "$work/server.log" || fail "the restarted server did not resume"
grep -q "fl server: 4 rounds" "$work/server.log" || fail "the restarted server did not finish round 4"
tail -1 "$work/m.jsonl" | grep -q '"round":4,' || fail "the metrics do not end with round 4"

# Secure aggregation across processes: 2 rounds of 3 clients, the server sees only sums.
"$dtrain" fl serve --listen 127.0.0.1:0 --rounds 2 --clients-per-round 3 --hidden 32 $data \
  --secure-aggregation --metrics "$work/secure.jsonl" --no-progress >"$work/secure-server.log" 2>&1 &
server=$!
pids+=("$server")
port=$(port_of "$work/secure-server.log")
[[ -n $port ]] || fail "the secure server did not say its port"
# Client s2 brings all of its own examples (no --partition), holds out a quarter and tests
# its personalized model on them.
own=("--partition 0/3" "--partition 1/3" "--local-test-fraction 0.25 --personalize-epochs 1")
for i in 0 1 2; do
  "$dtrain" fl client --server "127.0.0.1:$port" ${own[$i]} --client-id "s$i" $data \
    --threads 1 --wait-ms 1000 >"$work/secure-client$i.log" 2>&1 &
  clients[$i]=$!
  pids+=("${clients[$i]}")
done
for i in 0 1 2; do wait "${clients[$i]}" || fail "secure client $i exited with $?"; done
wait "$server" || fail "the secure server exited with $?"
grep -q "fl server: 2 rounds" "$work/secure-server.log" || fail "secure aggregation did not finish 2 rounds"
[[ $(grep -c '"finished":3' "$work/secure.jsonl") -eq 2 ]] || fail "secure rounds did not count 3 clients each"
grep -q "personalized (1 epochs): local test accuracy [01]\.[0-9]*, the global model's [01]\.[0-9]*" \
  "$work/secure-client2.log" || fail "the client with its own data did not test its personalized model"

# Bad input: one clear error, non-zero exit, nothing lost.
out=$("$dtrain" fl serve --compression zip 2>&1) && fail "a bad --compression was taken"
grep -q -- "--compression 'zip'" <<<"$out" || fail "bad --compression not named: $out"
out=$("$dtrain" fl client --server 127.0.0.1:1 --partition 5/4 $data 2>&1) && fail "a bad --partition was taken"
grep -q -- "--partition '5/4'" <<<"$out" || fail "bad --partition not named: $out"
out=$("$dtrain" fl client --server 127.0.0.1:1 --rpc-timeout 0 $data 2>&1) && fail "a zero --rpc-timeout was taken"
grep -q -- "--rpc-timeout 0" <<<"$out" || fail "bad --rpc-timeout not named: $out"
out=$("$dtrain" fl client --server 127.0.0.1:1 --available 25:00-01:00 $data 2>&1) && fail "a bad --available was taken"
grep -q -- "--available '25:00-01:00'" <<<"$out" || fail "bad --available not named: $out"
out=$("$dtrain" fl client --server 127.0.0.1:1 --local-test-fraction 1 $data 2>&1) && fail "--local-test-fraction 1 was taken"
grep -q -- "--local-test-fraction must be in \[0, 1), got 1" <<<"$out" || fail "bad --local-test-fraction not named: $out"
head -c 100 "$work/ck/server.pt" >"$work/damaged.pt"
mkdir -p "$work/bad" && cp "$work/damaged.pt" "$work/bad/server.pt"
out=$("$dtrain" fl serve --listen 127.0.0.1:0 $data --hidden 64 --checkpoint-dir "$work/bad" 2>&1) &&
  fail "a damaged checkpoint was taken"
grep -q "$work/bad/server.pt" <<<"$out" || fail "the damaged checkpoint was not named: $out"
cmp -s "$work/damaged.pt" "$work/bad/server.pt" || fail "the damaged checkpoint was changed"
echo "FederatedProcesses: passed (server killed after $killed_at rounds, resumed, 4 rounds done; secure aggregation over processes)"
