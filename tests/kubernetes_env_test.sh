#!/usr/bin/env bash
# Kubernetes' training operators, as their pods see them: two "pods" made of two network
# namespaces (10.235.0.1 and 10.235.0.2), each with its pod's host name (a UTS namespace) and
# the cluster DNS's names for the pods (/etc/netns/NAME/hosts, which `ip netns exec` mounts over
# /etc/hosts), and the environment each operator writes:
#   1. Kubeflow's PyTorchJob v1 (master + worker): MASTER_ADDR=<job>-master-0, MASTER_PORT,
#      WORLD_SIZE and RANK counting pods; the container runs `dtrain train`: the float32 losses
#      of the same job under `dtrain launch` on one host.
#   2. The same with nprocPerNode: 2 (PET_NPROC_PER_NODE=2; WORLD_SIZE counting pods before
#      operator 1.8, pods x 2 since, with PET_NNODES and PET_NODE_RANK): `dtrain train` as the
#      container's command is refused on both pods, exit 2, naming it; `dtrain launch -- dtrain
#      train` runs two ranks per pod (node rank from PET_NODE_RANK, or RANK).
#   3. PyTorchJob with an elastic policy: PET_RDZV_ENDPOINT=<job>-worker-0:PORT,
#      PET_NNODES=MIN:MAX, PET_MAX_RESTARTS: the pod the endpoint names hosts the rendezvous.
#   4. Trainer v2's TrainJob (JobSet): PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
#      PET_MASTER_ADDR=<job>-node-0-0.<job>, PET_MASTER_PORT; then PET_NPROC_PER_NODE=auto (the
#      cores of a pod without GPUs, as torchrun).
# Exit 77 (skipped) where namespaces cannot be made.
# Usage: kubernetes_env_test.sh PATH/TO/dtrain
set -uo pipefail
dtrain=$(realpath "$1")
skip() { echo "SKIPPED: $*"; exit 77; }
fail() { echo "FAILED: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -20 "$f"; done; exit 1; }
[[ $(id -u) -eq 0 ]] || skip "creating network namespaces needs root"
command -v ip >/dev/null && command -v unshare >/dev/null || skip "iproute2 or unshare missing"

id=$$
a=dtrain-pod-a-$id
b=dtrain-pod-b-$id
work=$(mktemp -d)
source "$(dirname "$0")/two_hosts.sh"
cleanup() {
  remove_two_hosts "$a" "$b"
  rm -rf "/etc/netns/$a" "/etc/netns/$b" "$work"
}
trap cleanup EXIT
two_hosts "$a" "$b" "k$id" 10.235.0
# The cluster's DNS: each job's pods by the names its operator gives them.
for ns in "$a" "$b"; do
  mkdir -p "/etc/netns/$ns"
  cat > "/etc/netns/$ns/hosts" <<HOSTS
127.0.0.1 localhost
10.235.0.1 ptj-master-0 elastic-worker-0 tj-node-0-0.tj
10.235.0.2 ptj-worker-0 elastic-worker-1 tj-node-1-0.tj
HOSTS
done

job=(--dataset synthetic --model mlp --hidden 32 --synthetic-examples 512 --batch-size 32
     --max-steps 8 --log-every 1 --warmup-steps 2 --no-progress --threads 1 --comm-timeout 60000)
# pod NAMESPACE HOSTNAME LOG [VAR=VALUE...] -- COMMAND...: runs COMMAND as that pod would.
pod() {
  local ns=$1 host=$2 log=$3
  shift 3
  local vars=()
  while [[ $1 != -- ]]; do vars+=("$1"); shift; done
  shift
  ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$host" \
    env "${vars[@]}" timeout -s KILL 120 "$@" > "$work/$log.log" 2>&1
}
# Two pods at once; both must exit with CODE (default 0).
pods() {  # TAG CODE "A-VARS" "B-VARS" COMMAND... (VARS: space-separated VAR=VALUE)
  local tag=$1 code=$2 va=$3 vb=$4 other ca cb
  shift 4
  # shellcheck disable=SC2086
  pod "$a" "$host_a" "a$tag" $va -- "$@" &
  other=$!
  # shellcheck disable=SC2086
  pod "$b" "$host_b" "b$tag" $vb -- "$@"
  cb=$?
  wait $other
  ca=$?
  [[ $ca -eq $code && $cb -eq $code ]] || fail "$tag: the pods exited $ca / $cb, expected $code"
}
losses() { python3 -c "
import json
for l in open('$1'):
    r = json.loads(l)
    if r.get('event') == 'step': print(r['step'], repr(r['loss']))"; }

"$dtrain" launch --nproc-per-node 2 -- "$dtrain" train "${job[@]}" --metrics "$work/reference.jsonl" \
  > "$work/reference.log" 2>&1 || fail "the reference run failed"

# 1. PyTorchJob v1: one rank per pod, `dtrain train` as the command (the operator since 1.8 adds
#    PET_NNODES and PET_NODE_RANK, which dtrain train leaves to a launcher).
host_a=ptj-master-0 host_b=ptj-worker-0
ptj="MASTER_ADDR=ptj-master-0 MASTER_PORT=23456 WORLD_SIZE=2 PYTHONUNBUFFERED=1 PET_NNODES=2"
pods 1 0 "$ptj RANK=0 PET_NODE_RANK=0" "$ptj RANK=1 PET_NODE_RANK=1" "$dtrain" train "${job[@]}" \
  --metrics "$work/ptj.jsonl"
grep -q "trained 8 steps (global batch 64, 2 ranks, ddp)" "$work/a1.log" || fail "1: no summary"
diff <(losses "$work/ptj.jsonl") <(losses "$work/reference.jsonl") > /dev/null ||
  fail "1: the PyTorchJob's losses differ from dtrain launch's"
echo "ok: PyTorchJob (master + worker, RANK/WORLD_SIZE counting pods): losses equal dtrain launch's"

# 2. nprocPerNode: 2, as the operator before 1.8 wrote it (WORLD_SIZE counting pods, no
#    PET_NODE_RANK) and as it does since (WORLD_SIZE = pods x nprocPerNode, PET_NODE_RANK): dtrain
#    train alone is refused in both pods; dtrain launch runs two ranks in each.
old_ptj="MASTER_ADDR=ptj-master-0 MASTER_PORT=23456 WORLD_SIZE=2 PET_NPROC_PER_NODE=2"
new_ptj="MASTER_ADDR=ptj-master-0 MASTER_PORT=23456 WORLD_SIZE=4 PET_NPROC_PER_NODE=2 PET_NNODES=2"
for operator in old new; do
  if [[ $operator == old ]]; then va="$old_ptj RANK=0" vb="$old_ptj RANK=1"
  else va="$new_ptj RANK=0 PET_NODE_RANK=0" vb="$new_ptj RANK=1 PET_NODE_RANK=1"; fi
  pods 2r$operator 2 "$va" "$vb" "$dtrain" train "${job[@]}" --no-run-dir
  for log in a2r$operator b2r$operator; do
    grep -q "numbers a PyTorchJob's pods while PET_NPROC_PER_NODE=2 asks for that many ranks" \
      "$work/$log.log" || fail "2 ($operator operator): $log did not say why"
  done
  pods 2$operator 0 "$va" "$vb" "$dtrain" launch -- "$dtrain" train "${job[@]}" --no-run-dir
  grep -q "from kubernetes (PET_\*): --nnodes 2 --nproc-per-node 2 --node-rank 1 --master-addr ptj-master-0 --master-port 23456" \
    "$work/b2$operator.log" || fail "2 ($operator operator): dtrain launch did not take the pod's node"
  grep -q "trained 8 steps (global batch 128, 4 ranks, ddp)" "$work/a2$operator.log" ||
    fail "2 ($operator operator): no summary"
done
echo "ok: PyTorchJob with nprocPerNode 2 (before and since operator 1.8): dtrain train refused in both pods (exit 2); dtrain launch ran 4 ranks"

# 3. Elastic PyTorchJob: the rendezvous on the pod PET_RDZV_ENDPOINT names.
host_a=elastic-worker-0 host_b=elastic-worker-1
el="PET_RDZV_ENDPOINT=elastic-worker-0:23457 PET_RDZV_BACKEND=c10d PET_NNODES=2:2 PET_NPROC_PER_NODE=1 PET_MAX_RESTARTS=3"
pods 3 0 "$el" "$el" "$dtrain" launch -- "$dtrain" train "${job[@]}" --no-run-dir
grep -q -- "--node-rank 0 --master-addr elastic-worker-0 --master-port 23457 --max-restarts 3" "$work/a3.log" ||
  fail "3: the endpoint's pod did not host the rendezvous"
grep -q -- "--node-rank" "$work/b3.log" && fail "3: the other pod took a node rank of its own"
grep -q "trained 8 steps (global batch 64, 2 ranks, ddp)" "$work/a3.log" "$work/b3.log" ||
  fail "3: no summary"
# ... and an endpoint given as an address: the pod holding that address hosts it.
el_ip="PET_RDZV_ENDPOINT=10.235.0.1:23459 PET_NNODES=2:2 PET_NPROC_PER_NODE=1"
pods 3ip 0 "$el_ip" "$el_ip" "$dtrain" launch -- "$dtrain" train "${job[@]}" --no-run-dir
grep -q -- "--node-rank 0 --master-addr 10.235.0.1 --master-port 23459" "$work/a3ip.log" ||
  fail "3: the pod holding the endpoint's address did not host the rendezvous"
grep -q -- "--node-rank" "$work/b3ip.log" && fail "3: the other pod took a node rank (address)"
echo "ok: elastic PyTorchJob: the endpoint's pod (by name, and by address) hosted the rendezvous, 2 ranks trained"

# 4. TrainJob (Trainer v2 on JobSet).
host_a=tj-node-0-0 host_b=tj-node-1-0
tj="PET_NNODES=2 PET_MASTER_ADDR=tj-node-0-0.tj PET_MASTER_PORT=23458"
pods 4 0 "$tj PET_NPROC_PER_NODE=1 PET_NODE_RANK=0" "$tj PET_NPROC_PER_NODE=1 PET_NODE_RANK=1" \
  "$dtrain" launch -- "$dtrain" train "${job[@]}" --metrics "$work/tj.jsonl"
diff <(losses "$work/tj.jsonl") <(losses "$work/reference.jsonl") > /dev/null ||
  fail "4: the TrainJob's losses differ from dtrain launch's"
ranks=$(( 2 * $(nproc) ))
pods 4a 0 "$tj PET_NPROC_PER_NODE=auto PET_NODE_RANK=0" "$tj PET_NPROC_PER_NODE=auto PET_NODE_RANK=1" \
  "$dtrain" launch -- "$dtrain" train "${job[@]}" --no-run-dir
grep -q "trained 8 steps (global batch $(( 32 * ranks )), $ranks ranks, ddp)" "$work/a4a.log" ||
  fail "4: PET_NPROC_PER_NODE=auto did not run a rank per core"
echo "ok: TrainJob: losses equal dtrain launch's; nproc auto ran $ranks ranks"
