#!/usr/bin/env bash
# A real Slurm cluster on one machine: Debian's slurmctld and two slurmd, each node in a network
# namespace of its own (n1 at 10.234.0.1 with the controller, n2 at 10.234.0.2; the node names
# resolve nowhere: dtrain finds the first node's NodeAddr through scontrol), no munge
# (auth/none). examples/slurm/train.sbatch is submitted as a user would, and checked to:
#   1. train over both nodes with `srun dtrain train` (one task per rank), float32 losses equal
#      to the same job under `dtrain launch` on one host;
#   2. the same with `srun dtrain launch` once per node (MODE=launch);
#   3. take `scancel --signal=USR1` (preemption, or --signal's warning before the time limit):
#      save, requeue itself, and resume to the end with the uninterrupted run's losses;
#   4. stop cleanly on `scancel` (SIGTERM): a checkpoint at the step it stopped, which
#      `dtrain status` reads from the run folder;
#   5. fail as on the launcher when n2's rank is killed: named, the job FAILED;
#   6. refuse a job step without --ntasks-per-node, naming it, exit 2 on every rank;
#   7. the same for a --tensorboard folder that cannot be made.
# The daemons are stopped by their pids and the namespaces removed at the end.
# Exit 77 (skipped) where Slurm is not installed or namespaces cannot be made.
# Usage: slurm_test.sh PATH/TO/dtrain PATH/TO/examples/slurm/train.sbatch
set -uo pipefail
dtrain=$(realpath "$1")
sbatch_file=$(realpath "$2")
skip() { echo "SKIPPED: $*"; exit 77; }
fail() {
  echo "FAILED: $*"
  for f in "$work"/*.out "$work"/*.log "$work"/slurm/*.log; do
    [[ -f $f ]] && { echo "--- $f"; tail -40 "$f"; }
  done
  exit 1
}
[[ $(id -u) -eq 0 ]] || skip "creating network namespaces needs root"
for tool in ip nsenter slurmctld slurmd sbatch srun scontrol squeue; do
  command -v $tool >/dev/null || skip "$tool is not installed (scripts/setup installs slurm-wlm)"
done

id=$$
a=dtrain-slurm-a-$id
b=dtrain-slurm-b-$id
work=$(mktemp -d)
state=$work/slurm
source "$(dirname "$0")/two_hosts.sh"
cleanup() {
  # The daemons by their pids (slurmctld, then each slurmd), then anything left in the nodes.
  for pidfile in "$state"/slurmctld.pid "$state"/slurmd.n1.pid "$state"/slurmd.n2.pid; do
    [[ -f $pidfile ]] && kill "$(cat "$pidfile")" 2>/dev/null
  done
  for _ in $(seq 50); do
    [[ -z $(ip netns pids "$a" 2>/dev/null)$(ip netns pids "$b" 2>/dev/null) ]] && break
    sleep 0.1
  done
  remove_two_hosts "$a" "$b"
  rm -rf "$work"
}
trap cleanup EXIT
two_hosts "$a" "$b" "s$id" 10.234.0

# Only the network is the node's own (nsenter --net, unlike `ip netns exec`, keeps /sys and its
# cgroups, which slurmd reads).
on() { local ns=$1; shift; nsenter --net="/run/netns/$ns" "$@"; }
mkdir -p "$state/state" "$state/spool/n1" "$state/spool/n2"
export SLURM_CONF=$state/slurm.conf
cat > "$SLURM_CONF" <<CONF
ClusterName=dtraintest
SlurmctldHost=$(hostname -s)(10.234.0.1)
AuthType=auth/none
CredType=cred/none
# A requeued job waits for its revoked credential to expire (120 s by default) before it starts
# again: 5 s here.
AuthInfo=cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$state/state
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.%n.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
NodeName=n1 NodeAddr=10.234.0.1 CPUs=2 State=UNKNOWN
NodeName=n2 NodeAddr=10.234.0.2 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
# A daemon that cannot start here (a machine's cgroups or privileges: nothing of dtrain's) skips
# the test, saying why.
daemon_fails() { echo "--- $state/$2.log"; tail -5 "$state/$2.log" 2>/dev/null; skip "$1 cannot run here"; }
on "$a" slurmctld -i || daemon_fails slurmctld slurmctld
on "$a" slurmd -N n1 || daemon_fails "slurmd -N n1" slurmd.n1
on "$b" slurmd -N n2 || daemon_fails "slurmd -N n2" slurmd.n2
for _ in $(seq 300); do
  [[ $(on "$a" sinfo -h -N -o %T 2>/dev/null | grep -c idle) -eq 2 ]] && break
  sleep 0.1
done
[[ $(on "$a" sinfo -h -N -o %T | grep -c idle) -eq 2 ]] || fail "the two nodes did not come up"
echo "ok: a cluster of two nodes ($(on "$a" sinfo -h -o '%N %T'))"

# JOB's state once it has ended (COMPLETED, FAILED, CANCELLED...); fails after 180 s.
job_state() { on "$a" scontrol show job "$1" | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
wait_job() {
  local job=$1 s
  for _ in $(seq 1800); do
    s=$(job_state "$job")
    case $s in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) echo "$s"; return;; esac
    sleep 0.1
  done
  fail "job $job did not end in 180 s (state $s)"
}
# Waits until RUN folder's metrics hold a step record at or after STEP (180 s at most).
wait_step() {
  local run=$1 step=$2
  for _ in $(seq 1800); do
    [[ -f $run/metrics.jsonl ]] &&
      python3 -c "import json,sys; sys.exit(0 if any(json.loads(l).get('step',0) >= $step for l in open('$run/metrics.jsonl')) else 1)" 2>/dev/null &&
      return
    sleep 0.1
  done
  fail "$run did not reach step $step"
}
# The train records' losses, one per line: "STEP LOSS" as written.
losses() { python3 -c "
import json
for l in open('$1/metrics.jsonl'):
    r = json.loads(l)
    if r.get('event') == 'step': print(r['step'], repr(r['loss']))"; }
submit() {  # NAME [VAR=VALUE,...] -- [training options]; prints the job id
  local name=$1 extra=
  shift
  [[ $1 != -- ]] && { extra=,$1; shift; }
  shift
  on "$a" sbatch --parsable --chdir="$work" --output="$work/$name.out" \
    --export="ALL,DTRAIN=$dtrain,RUN_DIR=$work/$name$extra" "$sbatch_file" "$@"
}

job=(--dataset synthetic --model mlp --hidden 32 --synthetic-examples 512 --batch-size 32
     --max-steps 16 --log-every 1 --warmup-steps 2 --no-progress --threads 1
     --comm-timeout 60000)

# The reference: the same job under `dtrain launch`, two ranks on this host.
"$dtrain" launch --nproc-per-node 2 -- "$dtrain" train "${job[@]}" --run-dir "$work/reference" \
  > "$work/reference.log" 2>&1 || fail "the reference run failed"
losses "$work/reference" > "$work/reference.losses"
[[ $(wc -l < "$work/reference.losses") -eq 16 ]] || fail "the reference logged no 16 losses"

# 1. srun dtrain train: one task per rank.
id1=$(submit srun -- "${job[@]}") || fail "sbatch refused the job"
[[ $(wait_job "$id1") == COMPLETED ]] || fail "the srun job did not complete"
grep -q "trained 16 steps (global batch 64, 2 ranks, ddp)" "$work/srun.out" || fail "no summary"
grep -q "rank 1 reaches 10.234.0.1 from 10.234.0.2" "$work/srun.out" ||
  fail "rank 1 did not reach the first node's NodeAddr"
diff <(losses "$work/srun") "$work/reference.losses" > /dev/null ||
  fail "srun's losses differ from dtrain launch's: $(diff <(losses "$work/srun") "$work/reference.losses" | head -4)"
[[ -f $work/srun/config.toml && -d $work/srun/checkpoints ]] || fail "no run folder from srun"
echo "ok: srun dtrain train over two nodes, its 16 float32 losses equal dtrain launch's"

# ... and with no MASTER_ADDR from the script: dtrain asks scontrol for n1's NodeAddr itself.
id1b=$(on "$a" sbatch --parsable --chdir="$work" --output="$work/own.out" --nodes=2 \
  --ntasks-per-node=1 --wrap "srun $dtrain train ${job[*]} --max-steps 2 --no-run-dir") ||
  fail "sbatch refused the --wrap job"
[[ $(wait_job "$id1b") == COMPLETED ]] || fail "the job without MASTER_ADDR did not complete"
grep -q "rank 1 reaches 10.234.0.1 from 10.234.0.2" "$work/own.out" ||
  fail "without MASTER_ADDR, rank 1 did not reach n1's NodeAddr"
echo "ok: without MASTER_ADDR the ranks meet at the first node's NodeAddr"

# 2. srun dtrain launch, once per node.
id2=$(submit launch MODE=launch,NPROC_PER_NODE=1 -- "${job[@]}") || fail "sbatch refused the launch job"
[[ $(wait_job "$id2") == COMPLETED ]] || fail "the launch job did not complete"
grep -q "from slurm: --nnodes 2 --node-rank 1 --master-addr 10.234.0.1" "$work/launch.out" ||
  fail "dtrain launch did not take its node from Slurm"
diff <(losses "$work/launch") "$work/reference.losses" > /dev/null ||
  fail "srun dtrain launch's losses differ from dtrain launch's"
echo "ok: srun dtrain launch per node, the same 16 losses"

# 3. Preemption: SIGUSR1 mid-run; the job saves, requeues itself and resumes.
slow=DTRAIN_SIMULATE_SLOW_STEP_MS=250
id3=$(submit preempt $slow -- "${job[@]}") || fail "sbatch refused"
wait_step "$work/preempt" 4
on "$a" scancel --signal=USR1 "$id3"
# Back in the queue (its first run's end may show a moment first), then started again by Slurm
# once its revoked credential expired.
for _ in $(seq 1800); do
  on "$a" scontrol show job "$id3" | grep -q "Restarts=1" && break
  sleep 0.1
done
on "$a" scontrol show job "$id3" | grep -q "Restarts=1" || fail "the job was not requeued"
state3=$(wait_job "$id3")
[[ $state3 == COMPLETED ]] || fail "the requeued job did not complete ($state3: $(on "$a" scontrol show job "$id3" | tr "\n" " "))"
grep -q "stopped on request (SIGUSR1) after step" "$work/preempt.out" || fail "no save on SIGUSR1"
grep -q "requeueing job $id3" "$work/preempt.out" || fail "the script did not requeue"
grep -q "job $id3 (restart 1)" "$work/preempt.out" || fail "no second start"
grep -q "dtrain: resumed from step" "$work/preempt.out" || fail "the requeued job did not resume"
diff <(losses "$work/preempt" | sort -n -u) "$work/reference.losses" > /dev/null ||
  fail "the preempted and resumed run's losses differ from the uninterrupted run's"
echo "ok: scancel --signal=USR1: saved, requeued, resumed, losses as uninterrupted"

# 4. scancel: the ranks finish their step and save before Slurm's KillWait.
id4=$(submit cancel $slow -- "${job[@]}") || fail "sbatch refused"
wait_step "$work/cancel" 4
on "$a" scancel "$id4"
[[ $(wait_job "$id4") == CANCELLED ]] || fail "scancel did not cancel the job"
grep -q "stopped on request (SIGTERM) after step" "$work/cancel.out" || fail "no save on scancel"
stopped=$(sed -n 's/.*stopped on request (SIGTERM) after step \([0-9]*\).*/\1/p' "$work/cancel.out" | head -1)
[[ -d $work/cancel/checkpoints/step-$(printf %08d "$stopped") ]] ||
  fail "no checkpoint at step $stopped after scancel"
# ... and `dtrain status` says so from the run folder alone.
"$dtrain" status "$work/cancel" > "$work/status.log" 2>&1 || fail "dtrain status failed"
grep -q "stopped on request (signal 15; resumable), step $stopped of 16" "$work/status.log" &&
  grep -q "last checkpoint: step $stopped" "$work/status.log" &&
  grep -q "ranks: 2 (DP 2 x PP 1 x TP 1, ddp)" "$work/status.log" ||
  fail "dtrain status did not tell where the cancelled run is: $(cat "$work/status.log")"
echo "ok: scancel stopped the job at step $stopped with a checkpoint there (dtrain status says so)"

# 5. n2's rank killed at its step 3 (MODE=launch: as on the launcher, the node and rank named).
id5=$(submit killed MODE=launch,DTRAIN_SIMULATE_FAILURE=1:3 -- "${job[@]}") || fail "sbatch refused"
[[ $(wait_job "$id5") == FAILED ]] || fail "the job with a killed rank did not fail"
grep -q "failed: node 1 rank 1 (pid [0-9]*) was killed by signal 9" "$work/killed.out" ||
  fail "the killed rank was not named"
# ... and under srun alone: Slurm names the task, rank 0 names the peer's address.
id5b=$(submit killed-srun DTRAIN_SIMULATE_FAILURE=1:3 -- "${job[@]}") || fail "sbatch refused"
[[ $(wait_job "$id5b") == FAILED ]] || fail "the srun job with a killed rank did not fail"
grep -q "n2: task 1: Killed" "$work/killed-srun.out" || fail "srun did not name task 1"
grep -q "a peer rank is gone.*10.234.0.2" "$work/killed-srun.out" || fail "rank 0 did not name the peer"
echo "ok: a rank killed on n2 is named (dtrain launch: node 1 rank 1; srun: task 1 on n2)"

# 6. A step over two nodes without --ntasks-per-node: every rank refuses, exit 2, at once.
id6=$(on "$a" sbatch --parsable --chdir="$work" --output="$work/uneven.out" --nodes=2 --ntasks=2 \
  --wrap "srun $dtrain train ${job[*]} --no-run-dir") || fail "sbatch refused the uneven job"
[[ $(wait_job "$id6") == FAILED ]] || fail "a step without --ntasks-per-node did not fail"
[[ $(grep -c "without --ntasks-per-node" "$work/uneven.out") -eq 2 ]] ||
  fail "not every rank named --ntasks-per-node"
on "$a" scontrol show job "$id6" | grep -q "ExitCode=2:0" || fail "the job's exit code is not 2"
echo "ok: a step without --ntasks-per-node refused by every rank, exit 2"

# 7. A TensorBoard folder that cannot be made: every rank says so before joining, exit 2.
id7=$(submit board -- "${job[@]}" --tensorboard /proc/dtrain-tensorboard) || fail "sbatch refused"
[[ $(wait_job "$id7") == FAILED ]] || fail "a bad --tensorboard did not fail the job"
[[ $(grep -c -- "--tensorboard /proc/dtrain-tensorboard: cannot create it" "$work/board.out") -eq 2 ]] ||
  fail "not every rank named the --tensorboard folder"
on "$a" scontrol show job "$id7" | grep -q "ExitCode=2:0" || fail "the job's exit code is not 2"
echo "ok: a --tensorboard folder that cannot be made refused by every rank, exit 2"
