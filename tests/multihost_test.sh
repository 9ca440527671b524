#!/usr/bin/env bash
# Two hosts on one machine: two network namespaces joined by a veth pair (10.231.0.1 and
# 10.231.0.2), a `dtrain launch` in each. Checks that training across them works with no
# interface given (the host name resolves to loopback here, as on Debian), that each node prints
# the address it chose, and that a rank killed on one host stops the other host within seconds,
# both launchers naming the failed node, rank and signal (also with experts, with DualPipe-V's
# pairs, and with each sequence split over the hosts, --context-parallel 2), and with --fault-tolerance replicas
# that the other host's replica goes on without it (and, with --max-replacements, that its
# replacement joins it; a replica of two ranks sharding its state, zero2 --replica-shards 2,
# replaced the same way, a pipeline of two stages too, and a replica of zero1 sharded across the
# replicas with buddy copies; a replica that hangs after the last step ended by its host's
# launcher); Downpour across the hosts against a
# token-guarded parameter-server shard, surviving a worker killed on one host; Sandblaster
# with its coordinator on one host and the shard on the other; federated learning with the
# server on one host and clients on both; and a network partition mid-round (host b's link
# down while its client trains: the round closes at its deadline without it, the client leaves
# the round at the same deadline rather than waiting on its call, and rejoins once the link is
# back); and asynchronous buffered aggregation (FedBuff) across the hosts with a client killed
# while it trains; a stop on request (SIGTERM) on one host stops both, saved and resumable.
# Exit 77 (skipped) where namespaces cannot be made.
# Usage: multihost_test.sh PATH/TO/dtrain
set -uo pipefail
dtrain=$1
skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAILED: $*"; for f in "$work"/*.log; do echo "--- $f"; cat "$f"; done; exit 1; }
[[ $(id -u) -eq 0 ]] || skip "creating network namespaces needs root"
command -v ip >/dev/null || skip "iproute2 (ip) is not installed"

id=$$
a=dtrain-a-$id
b=dtrain-b-$id
work=$(mktemp -d)
source "$(dirname "$0")/two_hosts.sh"
cleanup() {
  remove_two_hosts "$a" "$b"
  rm -rf "$work"
}
trap cleanup EXIT
two_hosts "$a" "$b" "v$id" 10.231.0

port=29731
job=(train --dataset synthetic --model mlp --hidden 32 --synthetic-examples 512 --batch-size 32
     --epochs 1 --no-progress --threads 1 --comm-timeout 60000)
launch() {  # NODE NAMESPACE [ENV=VALUE...]
  local node=$1 ns=$2
  shift 2
  ip netns exec "$ns" env "$@" timeout -s KILL 120 "$dtrain" launch --nnodes 2 \
    --nproc-per-node "${per_node:-1}" \
    --master-addr 10.231.0.1 --master-port $port --node-rank "$node" --grace 2 -- "$dtrain" "${job[@]}"
}

# `job` with host b's rank RANK (default 1) SIGKILLed at its step 3 (logs $work/{a,b}TAG.log):
# both launchers exit 137, host a's names the rank, within 30 s (in `seconds`).
# TAG [WHAT: prefix of failures] [RANK]
killed_on_b() {
  local tag=$1 what=${2:-} rank=${3:-1} start other code_a code_b
  start=$(date +%s)
  launch 1 "$b" DTRAIN_SIMULATE_FAILURE=$rank:3 > "$work/b$tag.log" 2>&1 &
  other=$!
  launch 0 "$a" > "$work/a$tag.log" 2>&1
  code_a=$?
  wait $other
  code_b=$?
  seconds=$(( $(date +%s) - start ))
  [[ $code_a -eq 137 && $code_b -eq 137 ]] ||
    fail "${what}exit codes $code_a / $code_b, expected 137 (signal 9) on both"
  grep -q "failed: node 1 rank $rank (pid [0-9]*) was killed by signal 9" "$work/a$tag.log" ||
    fail "${what}node 0 did not name the failed rank"
  (( seconds < 30 )) || fail "${what}took $seconds s to stop"
}

# `job` on both hosts (logs $work/{a,b}TAG.log): both exit 0 and host a's summary holds SUMMARY.
# TAG WHAT SUMMARY
trains_across() {
  local tag=$1 what=$2 summary=$3 other
  launch 1 "$b" > "$work/b$tag.log" 2>&1 &
  other=$!
  launch 0 "$a" > "$work/a$tag.log" 2>&1 || fail "node 0 did not train $what (exit $?)"
  wait $other || fail "node 1 did not train $what"
  grep -qF "$summary" "$work/a$tag.log" || fail "no summary $what: $(tail -3 "$work/a$tag.log")"
}

# 1. Training across the two hosts, no interface given.
launch 1 "$b" > "$work/b1.log" 2>&1 &
other=$!
launch 0 "$a" > "$work/a1.log" 2>&1 || fail "node 0 did not train (exit $?)"
wait $other || fail "node 1 did not train"
grep -q "reaches 10.231.0.1 from 10.231.0.2 on v${id}b" "$work/b1.log" || fail "node 1 did not name its address"
grep -q "trained 8 steps (global batch 64, 2 ranks, ddp)" "$work/a1.log" || fail "no training summary"
echo "ok: trained across two hosts"

# 1b. BatchNorm statistics across the hosts (--sync-batchnorm: a collective in every BatchNorm
#     layer's forward and backward, on top of the gradient buckets).
plain_job=("${job[@]}")
job=(train --dataset synthetic --model resnet --sync-batchnorm --synthetic-examples 256
     --batch-size 16 --max-steps 3 --no-progress --threads 1 --comm-timeout 60000)
launch 1 "$b" > "$work/b1s.log" 2>&1 &
other=$!
launch 0 "$a" > "$work/a1s.log" 2>&1 || fail "node 0 did not train with --sync-batchnorm (exit $?)"
wait $other || fail "node 1 did not train with --sync-batchnorm"
grep -q "trained 3 steps (global batch 32, 2 ranks, ddp)" "$work/a1s.log" || fail "no --sync-batchnorm summary"
job=("${plain_job[@]}")
echo "ok: BatchNorm statistics synchronized across two hosts"

# 1c. Experts over the two hosts (--expert-parallel 2: each MoE block's tokens go to their
#     experts' host and back by all-to-all, variable splits), then host b's rank killed at step 3
#     in the middle of those exchanges: host a stops within seconds, naming it.
job=(train --config "$(dirname "$0")/../configs/moe-tiny.toml" --dataset text --expert-parallel 2
     --batch-size 4 --max-steps 6 --no-progress --no-run-dir --threads 1 --comm-timeout 60000)
trains_across 1e "with --expert-parallel 2" \
  "trained 6 steps (global batch 8, 2 ranks, ddp, experts over 2 ranks)"
killed_on_b 1k "experts: "
echo "ok: experts over two hosts trained; a rank killed on host b stopped host a in ${seconds} s"

# 1d. A pipeline of two stages, one per host, each stage's experts over its host's two ranks
#     (PP x EP: the activations cross the hosts, the all-to-alls stay inside each), then host
#     b's rank 3 killed at step 3: host a stops within seconds, naming it.
job=(train --config "$(dirname "$0")/../configs/moe-tiny.toml" --dataset text --expert-parallel 2
     --pipeline-parallel 2 --micro-batches 2 --batch-size 4 --max-steps 6 --no-progress
     --no-run-dir --threads 1 --comm-timeout 60000)
per_node=2
trains_across 1p "a pipeline with experts" \
  "trained 6 steps (global batch 16, 4 ranks, 2-stage pipeline x ddp, experts over 2 ranks)"
killed_on_b 1pk "pipeline with experts: " 3
per_node=1
job=("${plain_job[@]}")
echo "ok: a pipeline with experts over two hosts trained; rank 3 killed on host b stopped host a in ${seconds} s"

# 1d2. DualPipe-V across the two hosts: one pipeline rank each holding both chunks of the V, the
#      experts split over the hosts (each pair's forward and backward on two threads, their
#      all-to-alls crossing the hosts on the expert group's two lanes), then host b's rank
#      killed at step 3: host a stops within seconds, naming it.
job=(train --config "$(dirname "$0")/../configs/moe-tiny.toml" --dataset text --expert-parallel 2
     --strategy pipeline --pipeline-parallel 1 --schedule dualpipev --micro-batches 4
     --batch-size 2 --max-steps 6 --no-progress --no-run-dir --threads 1 --comm-timeout 60000)
trains_across 1v "DualPipe-V with experts" "trained 6 steps (global batch 16, 2 ranks"
killed_on_b 1vk "DualPipe-V: "
job=("${plain_job[@]}")
echo "ok: DualPipe-V with experts over two hosts trained; a rank killed on host b stopped host a in ${seconds} s"

# 1e. Each sequence split over the two hosts (--context-parallel 2, the ring: every layer's keys
#     and values cross the hosts by send/recv while a block is computed, both ways in backward),
#     then host b's rank killed at step 3 in the middle of those transfers: host a stops within
#     seconds, naming it.
job=(train --model llama --dataset text --context 64 --layers 2 --width 32 --heads 4
     --context-parallel 2 --cp-method ring --batch-size 4 --max-steps 6 --no-progress --no-run-dir
     --threads 1 --comm-timeout 60000)
trains_across 1c "with --context-parallel 2" \
  "trained 6 steps (global batch 4, 2 ranks, ddp x context-parallel 2)"
killed_on_b 1ck "context parallel: "
job=("${plain_job[@]}")
echo "ok: sequences split over two hosts trained; a rank killed on host b stopped host a in ${seconds} s"

# 2. A rank killed on host b (SIGKILL at step 3): host a stops within seconds, naming it.
killed_on_b 2
echo "ok: a rank killed on host b stopped host a in ${seconds} s"

# 2b. The same kill with --fault-tolerance replicas (and the launchers' --tolerate-failures):
#     host a's replica goes on alone and finishes the epoch; host b's launcher ends cleanly.
ft_flags=(--master-port $((port + 10)))
ft_launch() {  # NODE NAMESPACE [ENV=VALUE...]; the launchers' flags in ft_flags
  local node=$1 ns=$2
  shift 2
  ip netns exec "$ns" env "$@" timeout -s KILL 120 "$dtrain" launch --nnodes 2 \
    --nproc-per-node "${per_node:-1}" \
    --master-addr 10.231.0.1 "${ft_flags[@]}" --node-rank "$node" --tolerate-failures \
    -- "$dtrain" "${job[@]}" --fault-tolerance replicas
}
ft_launch 1 "$b" DTRAIN_SIMULATE_FAILURE=1:3 > "$work/b2f.log" 2>&1 &
other=$!
ft_launch 0 "$a" > "$work/a2f.log" 2>&1 || fail "node 0 did not go on with --fault-tolerance replicas (exit $?)"
wait $other || fail "node 1's launcher failed after its replica was killed"
grep -q "rank 1 kills itself at step 3" "$work/b2f.log" || fail "the replica on host b was not killed"
grep -q "the other ranks go on" "$work/b2f.log" || fail "host b's launcher did not keep going"
grep -q "replica group: world rank(s) 1 left at step 4" "$work/a2f.log" || fail "host a did not leave rank 1 out"
grep -q "trained 8 steps (global batch 64, 2 ranks, ddp)" "$work/a2f.log" || fail "host a did not finish"
echo "ok: a replica killed on host b, host a went on (--fault-tolerance replicas)"
# 2c. The same with host b's launcher replacing its replica (--max-replacements 1): the
#     replacement joins host a's replica across the hosts, with rank 0's state, and both finish.
plain_job=("${job[@]}")
job=(train --dataset synthetic --model mlp --hidden 32 --synthetic-examples 4096 --batch-size 32
     --max-steps 60 --no-progress --threads 1 --comm-timeout 60000)
ft_flags=(--master-port $((port + 20)) --max-replacements 1)
ft_launch 1 "$b" DTRAIN_SIMULATE_SLOW_STEP_MS=100 DTRAIN_SIMULATE_FAILURE=1:3 > "$work/b2r.log" 2>&1 &
other=$!
ft_launch 0 "$a" DTRAIN_SIMULATE_SLOW_STEP_MS=100 > "$work/a2r.log" 2>&1 || fail "node 0 failed with a replacement (exit $?)"
wait $other || fail "node 1's launcher failed after replacing its replica"
grep -q "started rank 1 again (replacement 1 of at most 1" "$work/b2r.log" || fail "host b did not replace its replica"
grep -q "replica group: world rank(s) 1 joined after step" "$work/a2r.log" || fail "host a did not admit the replacement"
grep -q "world rank 1 joined after step [0-9]*, its state (.* MB) from world rank 0" "$work/b2r.log" || fail "the replacement did not get rank 0's state"
grep -q "trained 60 steps (global batch 64, 2 ranks, ddp)" "$work/a2r.log" || fail "host a did not finish"
echo "ok: a replica killed on host b was replaced and joined host a's (live recovery)"
# 2d-2f. Replicas of 2 ranks, one on each host; rank 3 (host b) is killed at step 3: host b's
#     launcher ends rank 2 too and starts both again, they join host a's replica with the state
#     of its rank at their position, and both hosts finish. replaced_pair TAG PORT_OFFSET WHAT
#     FLAGS...: the two launchers (logs $work/a2TAG.log and b2TAG.log) and what every case checks.
pair_launch() {  # NODE NAMESPACE PORT_OFFSET [ENV=VALUE...] -- [TRAINING FLAGS...]
  local node=$1 ns=$2 offset=$3
  shift 3
  local env=()
  while (($# > 0)) && [[ $1 != -- ]]; do env+=("$1"); shift; done
  shift
  ip netns exec "$ns" env "${env[@]}" timeout -s KILL 120 "$dtrain" launch --nnodes 2 \
    --nproc-per-node 2 --master-addr 10.231.0.1 --master-port $((port + offset)) \
    --node-rank "$node" --tolerate-failures --replica-size 2 --max-replacements 1 \
    -- "$dtrain" "${job[@]}" --fault-tolerance replicas "$@"
}
replaced_pair() {
  local tag=$1 offset=$2 what=$3
  shift 3
  pair_launch 1 "$b" "$offset" DTRAIN_SIMULATE_SLOW_STEP_MS=100 DTRAIN_SIMULATE_FAILURE=3:3 -- "$@" \
    > "$work/b2$tag.log" 2>&1 &
  local other=$!
  pair_launch 0 "$a" "$offset" DTRAIN_SIMULATE_SLOW_STEP_MS=100 -- "$@" > "$work/a2$tag.log" 2>&1 \
    || fail "node 0 failed with $what (exit $?)"
  wait $other || fail "node 1's launcher failed after replacing its $what replica"
  grep -q "ending rank 2 (pid [0-9]*) too: it is in rank 3's replica" "$work/b2$tag.log" \
    || fail "host b did not end rank 3's replica mate ($what)"
  grep -q "replica group: world rank(s) 2,3 joined after step" "$work/a2$tag.log" \
    || fail "host a did not admit host b's replacements ($what)"
  grep -q "world rank 3 joined after step [0-9]*, its state (.* MB) from world rank 1" \
    "$work/b2$tag.log" || fail "rank 3's replacement did not get rank 1's state ($what)"
}
# 2d. Hybrid sharding across the hosts (zero2 --replica-shards 2: a replica's two ranks shard
#     Adam's state and the gradients).
replaced_pair h 25 "hybrid sharding" --strategy zero2 --replica-shards 2
grep -q "replica group: world rank(s) 2,3 left at step 4" "$work/a2h.log" || fail "host a did not leave host b's replica out"
grep -q "trained 60 steps (global batch 128, 4 ranks, zero2)" "$work/a2h.log" || fail "host a did not finish"
echo "ok: a hybrid-sharded replica killed on host b was replaced and joined host a's"
# 2e. DiLoCo with an island per host (--island-size 2, an outer step every 5 steps): host a's
#     island goes on alone through the next outer step; host b's joins at an outer step.
replaced_pair d 30 "DiLoCo islands" --strategy diloco --island-size 2 --outer-steps 5
grep -q "replica group: world rank(s) 2,3 left at outer step 1" "$work/a2d.log" || fail "host a did not leave host b's island out"
grep -q "trained 60 steps (global batch 128, 4 ranks, diloco)" "$work/a2d.log" || fail "host a did not finish"
echo "ok: a DiLoCo island killed on host b was replaced and joined host a's"
# 2f. A pipeline per host (--pipeline-parallel 2: a replica is both stages, the ranks laid out
#     replica by replica; rank 3 is host b's last stage).
replaced_pair p 35 "pipeline replicas" --pipeline-parallel 2 --micro-batches 2
grep -q "replica group: world rank(s) 2,3 left at step 4" "$work/a2p.log" || fail "host a did not leave host b's pipeline out"
grep -q "trained 60 steps" "$work/a2p.log" || fail "host a did not finish"
echo "ok: a pipeline killed on host b was replaced and joined host a's"
# 2g. ZeRO-1 sharded across four replicas of one rank, two per host, each shard also kept by the
#     next replica (--shard-across-replicas): rank 3 (host b) is killed at step 3; its buddy,
#     rank 0 on host a, gives its shard out; the replacement takes its shard from rank 0 and its
#     copy of shard 2 from rank 2, across the hosts, and both hosts finish.
buddy_launch() {  # NODE NAMESPACE [ENV=VALUE...]
  local node=$1 ns=$2
  shift 2
  ip netns exec "$ns" env "$@" timeout -s KILL 120 "$dtrain" launch --nnodes 2 \
    --nproc-per-node 2 --master-addr 10.231.0.1 --master-port $((port + 40)) \
    --node-rank "$node" --tolerate-failures --max-replacements 1 \
    -- "$dtrain" "${job[@]}" --fault-tolerance replicas --strategy zero1 --optimizer adam \
    --lr 0.001 --shard-across-replicas
}
buddy_launch 1 "$b" DTRAIN_SIMULATE_SLOW_STEP_MS=100 DTRAIN_SIMULATE_FAILURE=3:3 > "$work/b2z.log" 2>&1 &
other=$!
buddy_launch 0 "$a" DTRAIN_SIMULATE_SLOW_STEP_MS=100 > "$work/a2z.log" 2>&1 \
  || fail "node 0 failed with replicas sharding the state across the hosts (exit $?)"
wait $other || fail "node 1's launcher failed after replacing its sharded replica"
grep -q "replica group: world rank(s) 3 left at step 4" "$work/a2z.log" || fail "host a did not leave rank 3 out"
grep -q "replica group: world rank(s) 3 joined after step" "$work/a2z.log" || fail "host a did not admit rank 3's replacement"
grep -q "world rank 3 took shard 3's optimizer state from world rank 0" "$work/b2z.log" \
  || fail "rank 3's replacement did not take its shard from its buddy on host a"
grep -q "world rank 3 took shard 2's optimizer state from world rank 2" "$work/b2z.log" \
  || fail "rank 3's replacement did not take its copy of shard 2 from rank 2"
grep -q "trained 60 steps (global batch 128, 4 ranks, zero1)" "$work/a2z.log" || fail "host a did not finish"
echo "ok: a replica sharding the state across the hosts (buddy copies) was killed on host b, replaced and joined"
# 2h. Host b's replica hangs after the last step (SIGSTOPped once step 20 committed): host a's
#     replica ends the job; host b's launcher, reading that from the store host a's launcher
#     keeps, ends its silent rank and both launchers exit 0 (the job's result stands).
job=(train --dataset synthetic --model mlp --hidden 32 --synthetic-examples 4096 --batch-size 32
     --max-steps 20 --no-progress --threads 1 --comm-timeout 60000 --replica-heartbeat-timeout 0.4)
ft_flags=(--master-port $((port + 50)))
start=$(date +%s)
ft_launch 1 "$b" DTRAIN_SIMULATE_FAILURE=1:20:stop > "$work/b2e.log" 2>&1 &
other=$!
ft_launch 0 "$a" > "$work/a2e.log" 2>&1 || fail "node 0 failed when host b's replica hung at the end (exit $?)"
wait $other || fail "node 1's launcher failed after its replica hung at the end"
seconds=$(( $(date +%s) - start ))
grep -q "rank 1 stops itself at step 20" "$work/b2e.log" || fail "the replica on host b did not stop"
grep -q "still runs after training ended, its heartbeat silent for" "$work/b2e.log" \
  || fail "host b's launcher did not end its hung rank"
grep -q "the job's result stands" "$work/b2e.log" || fail "host b's launcher did not keep the result"
grep -q "trained 20 steps" "$work/a2e.log" || fail "host a did not finish"
(( seconds < 60 )) || fail "took $seconds s to end after the hang"
job=("${plain_job[@]}")
echo "ok: a replica hung on host b after the last step was ended by its launcher in ${seconds} s"

# 2i. A rank's own bad input on host b (exit 2 at step 3, as a damaged file found mid-training):
#     host a's rank then fails on the closed connection (exit 1), yet both launchers report host
#     b's rank with its own message and exit 2 (a cause is published at once; a consequence
#     waits for it).
launch 1 "$b" DTRAIN_SIMULATE_FAILURE=1:3:input > "$work/b2i.log" 2>&1 &
other=$!
launch 0 "$a" > "$work/a2i.log" 2>&1
code_a=$?
wait $other
code_b=$?
[[ $code_a -eq 2 && $code_b -eq 2 ]] || fail "exit codes $code_a / $code_b after bad input, expected 2 on both"
for log in a2i b2i; do
  grep -q "failed: node 1 rank 1 (pid [0-9]*) exited with code 2: DTRAIN_SIMULATE_FAILURE: rank 1 met bad input at step 3" \
    "$work/$log.log" || fail "$log: the failure named is not host b's rank with its own message"
done
echo "ok: a rank's bad input on host b named on both hosts with its message, exit 2"
# 2j. A stop on request across the hosts: SIGTERM to host b's launcher while the ranks train.
#     Host b's rank is asked, both ranks agree on the step (the request rides on the step's
#     allreduce), rank 0 on host a saves there, and both launchers exit 143, "stopped on
#     request"; the run resumed on both hosts ends with the uninterrupted run's state, bytes.
stop_job=(train --dataset synthetic --model mlp --hidden 32 --synthetic-examples 512 --batch-size 16
          --max-steps 40 --log-every 1 --no-progress --threads 1 --comm-timeout 60000)
stop_launch() {  # NODE NAMESPACE PORT CHECKPOINTS [ENV=VALUE...]
  local node=$1 ns=$2 p=$3 dir=$4
  shift 4
  ip netns exec "$ns" env "$@" timeout -s KILL 120 "$dtrain" launch --nnodes 2 \
    --nproc-per-node "${per_node:-1}" \
    --master-addr 10.231.0.1 --master-port "$p" --node-rank "$node" --grace 2 -- "$dtrain" \
    "${stop_job[@]}" --checkpoint-dir "$dir" --metrics "$dir.jsonl"
}
stop_launch 1 "$b" $((port + 40)) "$work/straight" > "$work/b2j0.log" 2>&1 &
other=$!
stop_launch 0 "$a" $((port + 40)) "$work/straight" > "$work/a2j0.log" 2>&1 || fail "the uninterrupted run failed"
wait $other || fail "the uninterrupted run failed on host b"
stop_launch 1 "$b" $((port + 41)) "$work/stopped" DTRAIN_SIMULATE_SLOW_STEP_MS=30 > "$work/b2j.log" 2>&1 &
other=$!
stop_launch 0 "$a" $((port + 41)) "$work/stopped" DTRAIN_SIMULATE_SLOW_STEP_MS=30 > "$work/a2j.log" 2>&1 &
first=$!
for _ in $(seq 2400); do grep -q '"event":"step"' "$work/stopped.jsonl" 2>/dev/null && break; sleep 0.05; done
for pid in $(ip netns pids "$b"); do
  grep -q "launch" "/proc/$pid/cmdline" 2>/dev/null && [[ $(tr '\0' ' ' < "/proc/$pid/cmdline") == *"dtrain launch"* ]] && kill -TERM "$pid"
done
wait $first
code_a=$?
wait $other
code_b=$?
[[ $code_a -eq 143 && $code_b -eq 143 ]] || fail "exit codes $code_a / $code_b after SIGTERM on host b, expected 143 on both"
for log in a2j b2j; do
  grep -q "stopped on request (SIGTERM): the ranks finished their step and saved" "$work/$log.log" ||
    fail "$log: no 'stopped on request'"
done
grep -q "stopping on request (SIGTERM)" "$work/b2j.log" || fail "host b's launcher did not ask its rank to stop"
stopped_at=$(sed -n 's/.*stopped on request (SIGTERM) after step \([0-9]*\) of 40.*/\1/p' "$work/a2j.log")
[[ -n $stopped_at && $stopped_at -lt 40 ]] || fail "rank 0 did not say where it stopped"
stop_launch 1 "$b" $((port + 42)) "$work/stopped" > "$work/b2jr.log" 2>&1 &
other=$!
stop_launch 0 "$a" $((port + 42)) "$work/stopped" > "$work/a2jr.log" 2>&1 || fail "the resumed run failed"
wait $other || fail "the resumed run failed on host b"
grep -q "resumed from step $stopped_at" "$work/a2jr.log" || fail "the run did not resume from step $stopped_at"
cmp -s "$work/straight/step-00000040/state-0-of-1.pt" "$work/stopped/step-00000040/state-0-of-1.pt" ||
  fail "the resumed run ended with other weights or optimizer state than the uninterrupted one"
echo "ok: SIGTERM on host b stopped both hosts at step $stopped_at, saved; the resume equals the uninterrupted run"

# 3. Downpour across the hosts: a parameter-server shard on host a that requires a token,
#    workers on both hosts; the worker on host b is killed at its step 3 and the run completes.
printf 'multihost-token\n' > "$work/token"
ip netns exec "$a" timeout -s KILL 120 "$dtrain" ps serve --listen 10.231.0.1:29741 --shard 0/1 \
  --auth-token-file "$work/token" --report-every 0 > "$work/ps.log" 2>&1 &
shard=$!
job=(train --strategy downpour --ps 10.231.0.1:29741 --ps-auth-token-file "$work/token"
     --dataset synthetic --model mlp --hidden 32 --synthetic-examples 1024 --batch-size 32
     --epochs 1 --no-progress --threads 1 --ps-timeout-ms 10000)
ps_launch() {  # NODE NAMESPACE [ENV=VALUE...]
  local node=$1 ns=$2
  shift 2
  ip netns exec "$ns" env "$@" timeout -s KILL 120 "$dtrain" launch --nnodes 2 \
    --nproc-per-node "${per_node:-1}" \
    --master-addr 10.231.0.1 --master-port $((port + 1)) --node-rank "$node" --tolerate-failures \
    -- "$dtrain" "${job[@]}"
}
ps_launch 1 "$b" DTRAIN_SIMULATE_FAILURE=1:3 > "$work/b3.log" 2>&1 &
other=$!
ps_launch 0 "$a" > "$work/a3.log" 2>&1 || fail "downpour node 0 failed (exit $?)"
wait $other
kill -TERM $shard; wait $shard
grep -q "rank 1 kills itself at step 3" "$work/b3.log" || fail "the worker on host b was not killed"
grep -q "the other ranks go on" "$work/b3.log" || fail "host b's launcher did not keep going"
grep -q "trained 16 steps (global batch 64, 2 ranks, downpour)" "$work/a3.log" || fail "no downpour summary on host a"
grep -q "worker(s) 1 (quiet for" "$work/a3.log" || fail "host a did not name the worker that left"
echo "ok: downpour across two hosts with a token, a worker killed on host b"

# 4. Sandblaster across the hosts: the shard on host b (token), rank 0 and its coordinator on
#    host a (listening on every interface, reached as MASTER_ADDR), a worker on each host.
ip netns exec "$b" timeout -s KILL 120 "$dtrain" ps serve --listen 10.231.0.2:29742 --shard 0/1 \
  --auth-token-file "$work/token" --report-every 0 > "$work/ps4.log" 2>&1 &
shard=$!
job=(train --strategy sandblaster --ps 10.231.0.2:29742 --ps-auth-token-file "$work/token"
     --dataset synthetic --model linear --synthetic-examples 512 --max-steps 5 --work-units 8
     --no-progress --threads 1 --metrics "$work/m4.jsonl")
port=$((port + 2))
ps_launch 1 "$b" > "$work/b4.log" 2>&1 &
other=$!
ps_launch 0 "$a" > "$work/a4.log" 2>&1 || fail "sandblaster node 0 failed (exit $?)"
wait $other || fail "sandblaster node 1 failed"
kill -TERM $shard; wait $shard
grep -q "2 ranks, sandblaster)" "$work/a4.log" || fail "no sandblaster summary on host a"
grep -q '"worker1_units":[1-9]' "$work/m4.jsonl" || fail "the worker on host b did no work unit"
echo "ok: sandblaster across two hosts, the coordinator on host a, the shard on host b"

# 5. Federated learning across the hosts: the server on host a (per-client tokens, secure
#    aggregation), a client on each host; 2 rounds, each summing both clients' masked updates.
printf 'ca token-a\ncb token-b\n' > "$work/clients"
printf 'token-a\n' > "$work/token-a"
printf 'token-b\n' > "$work/token-b"
fl=(--dataset synthetic --synthetic-examples 512 --seed 1)
ip netns exec "$a" timeout -s KILL 120 "$dtrain" fl serve --listen 10.231.0.1:29751 --rounds 2 \
  --clients-per-round 2 --hidden 32 --secure-aggregation --client-tokens "$work/clients" \
  --no-progress --metrics "$work/fl.jsonl" "${fl[@]}" > "$work/fl-server.log" 2>&1 &
server=$!
ip netns exec "$b" timeout -s KILL 120 "$dtrain" fl client --server 10.231.0.1:29751 --client-id cb \
  --auth-token-file "$work/token-b" --partition 1/2 --threads 1 --wait-ms 1000 "${fl[@]}" \
  > "$work/fl-b.log" 2>&1 &
client_b=$!
ip netns exec "$a" timeout -s KILL 120 "$dtrain" fl client --server 10.231.0.1:29751 --client-id ca \
  --auth-token-file "$work/token-a" --partition 0/2 --threads 1 --wait-ms 1000 "${fl[@]}" \
  > "$work/fl-a.log" 2>&1 || fail "the federated client on host a failed (exit $?)"
wait $client_b || fail "the federated client on host b failed"
wait $server || fail "the federated server failed"
grep -q "fl client cb: 2 rounds trained" "$work/fl-b.log" || fail "the client on host b did not train 2 rounds"
[[ $(grep -c '"finished":2' "$work/fl.jsonl") -eq 2 ]] || fail "the rounds did not sum both clients"
echo "ok: federated learning across two hosts, securely aggregated"

# 6. A network partition mid-round: once the client on host b says it was selected for round
#    R (R >= 2), host b's link goes down (no reset reaches either side: the client is silent,
#    not gone) until round R is in the server's metrics. Round R must close at its deadline with
#    host a's client alone (--min-clients 1), the client on host b must leave round R at that
#    deadline (its download's or upload's call ends there, not at --rpc-timeout), and once the link is back it
#    must train again (the server waits up to 10 s for 2 clients). Tried for R = 2, 3, 4 in case
#    host b's upload got out before its link went down.
fl=(--dataset synthetic --synthetic-examples 4000 --seed 1)
ip netns exec "$a" timeout -s KILL 120 "$dtrain" fl serve --listen 10.231.0.1:29752 --rounds 8 \
  --clients-per-round 2 --min-clients 1 --round-timeout 5 --selection-timeout 10 \
  --local-epochs 20 --hidden 32 --no-progress --metrics "$work/p.jsonl" "${fl[@]}" \
  > "$work/p-server.log" 2>&1 &
server=$!
for side in a b; do
  ns=$a; [[ $side == b ]] && ns=$b
  ip netns exec "$ns" timeout -s KILL 120 "$dtrain" fl client --server 10.231.0.1:29752 \
    --client-id "p$side" --partition "$([[ $side == a ]] && echo 0 || echo 1)/2" --threads 1 \
    --wait-ms 1000 "${fl[@]}" > "$work/p-$side.log" 2>&1 &
  eval "client_$side=\$!"
done
cut_round=
for r in 2 3 4; do
  for _ in $(seq 1500); do grep -q "round $r: selected" "$work/p-b.log" && break; sleep 0.02; done
  grep -q "round $r: selected" "$work/p-b.log" || fail "the client on host b was not selected for round $r"
  ip -n "$b" link set "v${id}b" down
  for _ in $(seq 300); do grep -q "\"round\":$r," "$work/p.jsonl" && break; sleep 0.1; done
  sleep 1
  ip -n "$b" link set "v${id}b" up
  grep "\"round\":$r," "$work/p.jsonl" | grep -q '"dropped":1' && { cut_round=$r; break; }
done
[[ -n $cut_round ]] || fail "no round dropped the partitioned client (its uploads got out first)"
wait $client_a || fail "the client on host a failed during the partition (exit $?)"
wait $client_b || fail "the partitioned client on host b failed (exit $?)"
wait $server || fail "the server failed during the partition (exit $?)"
grep "\"round\":$cut_round," "$work/p.jsonl" | grep -q '"finished":1' ||
  fail "round $cut_round did not close with host a's client"
grep -q "fl server: 8 rounds" "$work/p-server.log" || fail "the run did not finish its 8 rounds"
# The link may go down before the model's download finished or after training (a loaded machine
# decides which); either call must end at the round's deadline.
grep -Eq "round $cut_round: left before (its update was sent: Upload|the model was downloaded: Download): the round's deadline passed" \
  "$work/p-b.log" || fail "the partitioned client did not leave round $cut_round at its deadline"
rejoined=$(sed -n 's/.*round \([0-9]*\): update sent.*/\1/p' "$work/p-b.log" | tail -1)
[[ ${rejoined:-0} -gt $cut_round ]] || fail "the client on host b did not train after the partition"
echo "ok: a partition of host b in round $cut_round: dropped at the deadline, rejoined in round $rejoined"

# 7. Asynchronous buffered aggregation (FedBuff) across the hosts: the server on host a applies
#    every 2 updates as they arrive (--buffer-size 2, at most 3 clients training). Client fk on
#    host b is killed (SIGKILL) while it trains its first update: its slot must expire at its
#    --round-timeout with the server saying so; then clients fa on host a and fb on host b
#    complete the 6 steps.
fl=(--dataset synthetic --synthetic-examples 3000 --seed 1)
ip netns exec "$a" timeout -s KILL 120 "$dtrain" fl serve --listen 10.231.0.1:29753 --rounds 6 \
  --buffer-size 2 --concurrency 3 --round-timeout 4 --local-epochs 20 --hidden 32 --no-progress \
  --metrics "$work/fb.jsonl" "${fl[@]}" > "$work/fb-server.log" 2>&1 &
server=$!
fb_client() {  # ID NAMESPACE PARTITION
  ip netns exec "$2" timeout -s KILL 120 "$dtrain" fl client --server 10.231.0.1:29753 \
    --client-id "$1" --partition "$3" --threads 1 --wait-ms 1000 "${fl[@]}" > "$work/fb-$1.log" 2>&1
}
fb_client fk "$b" 2/3 &
client_k=$!
for _ in $(seq 1500); do grep -q ": selected" "$work/fb-fk.log" && break; sleep 0.02; done
grep -q ": selected" "$work/fb-fk.log" || fail "the client fk on host b never started training"
pkill -KILL -f -- "--client-id fk " || fail "could not kill the client fk"
wait $client_k
grep -q "update sent" "$work/fb-fk.log" && fail "fk sent its update before it was killed"
expired="client 'fk' did not send its update from step 0 within --round-timeout 4 s"
for _ in $(seq 200); do grep -q "$expired" "$work/fb-server.log" && break; sleep 0.1; done
grep -q "$expired" "$work/fb-server.log" || fail "the server did not let the killed client's slot go"
fb_client fb "$b" 1/3 &
client_b=$!
fb_client fa "$a" 0/3 || fail "the buffered client on host a failed (exit $?)"
wait $client_b || fail "the buffered client on host b failed (exit $?)"
wait $server || fail "the buffered server failed (exit $?)"
grep -q "fl server: 6 rounds" "$work/fb-server.log" || fail "the buffered run did not apply its 6 steps"
[[ $(grep -c '"finished":2' "$work/fb.jsonl") -eq 6 ]] || fail "not every step applied 2 updates"
echo "ok: buffered aggregation across two hosts, a client killed on host b while it trained"
echo "7 passed, 0 failed"
