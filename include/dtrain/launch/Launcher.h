// The launcher behind `dtrain launch` (torchrun's agent, one per node): starts one process per
// local rank with torchrun's environment variables and prefixes each rank's output lines. The
// launchers of a job meet in the rendezvous store, which node 0's launcher hosts (its ranks
// connect to it too): they join each attempt together, keep a heartbeat there, and publish the
// first failure, so a rank or launcher failing on any node stops the ranks on every node within
// seconds, each launcher naming the failed node, rank and exit code or signal. With
// --max-restarts K the job is started again (up to K times) after a failure; training resumes
// from its newest checkpoint. With --nnodes MIN:MAX the job is elastic: node 0's launcher (the
// store's host) closes each attempt's rendezvous once MIN nodes have joined and no other came
// within the last call (or MAX have), numbering the others in the order they joined; a node
// that leaves costs a restart, one that arrives while the job runs below MAX makes the job
// restart at the new size (not counted), and training resumes by resharding its checkpoint.
#pragma once

#include <string>
#include <vector>

namespace dtrain::launch {

struct LaunchOptions {
  int nproc_per_node = 1;
  /// Nodes (the maximum when min_nodes > 0).
  int nnodes = 1;
  /// > 0: elastic (--nnodes MIN:MAX): an attempt starts with any number of nodes in
  /// [min_nodes, nnodes].
  int min_nodes = 0;
  /// This node's index; -1 = not given (0 on a single node; elastic nodes other than the host
  /// are numbered at each rendezvous).
  int node_rank = -1;
  std::string master_addr = "127.0.0.1";
  /// 0 = pick a free port (single node only).
  int master_port = 0;
  /// Threads per rank (0 = cores / nproc_per_node).
  int threads = 0;
  /// Seconds between SIGTERM and SIGKILL when stopping ranks.
  double grace_seconds = 3.0;
  /// A stop on request (the launcher's first SIGINT, SIGTERM or SIGUSR1): the signal forwarded to
  /// each rank (0: the one received; dtrain's own ranks get SIGUSR2, which they never take for
  /// a second request), and the seconds the ranks have to finish their step, save their
  /// checkpoint and exit before they are killed. A second signal stops them at once.
  int stop_signal = 0;
  double stop_timeout_seconds = 600;
  /// What the launcher's lines begin with ("dtrain train" when `dtrain train --nproc` runs it).
  std::string name = "dtrain launch";
  /// Said after a failure the job did not survive (not bad input), when it had no restarts and
  /// tolerated no failure: how it could have gone on.
  std::string failure_hint =
      "to go on after a failure, give --max-restarts N (each restart runs the ranks again)";
  /// Prefix every output line with "[rank N] ".
  bool prefix_output = true;
  /// Program and arguments (PATH is searched).
  std::vector<std::string> command;
  /// Extra environment variables ("NAME=value") for every rank.
  std::vector<std::string> extra_env;
  /// Network interface for the ranks' data plane (exported as GLOO_SOCKET_IFNAME; "" = the
  /// route to master_addr).
  std::string interface;
  /// A rank other than 0 failing does not stop the others (asynchronous workers such as
  /// Downpour's are independent; --fault-tolerance replicas): it is reported, written into the
  /// store for the others (ft/dead/RANK under the ranks' prefix) and the job goes on; rank 0
  /// failing still stops the job (unless replace_first_replica), and so does a rank that exits
  /// with code 2 (bad input: a replacement would fail the same way).
  bool tolerate_failures = false;
  /// With tolerate_failures: a failed rank (not 0) is started again, up to this many times per
  /// rank, as a replacement (DTRAIN_FT_REPLACEMENT=K in its environment) that joins the ranks
  /// still running: --fault-tolerance replicas admits it at a step's end and sends it the state.
  int max_replacements = 0;
  /// With tolerate_failures: ranks fail and are started again in replicas of this many
  /// consecutive ranks (a tensor-parallel group, on one node): when one fails, its launcher ends
  /// the replica's other ranks too; ranks 0..replica_size-1 failing stops the job.
  /// DTRAIN_REPLICA_SIZE in the ranks' environment.
  int replica_size = 1;
  /// With tolerate_failures: ranks 0..replica_size-1 failing do not stop the job either (they
  /// are left out and started again like the others: --fault-tolerance replicas, where the
  /// next replica present takes the lead).
  bool replace_first_replica = false;
  /// Restarts of the whole job after a failure (torchrun's --max-restarts).
  int max_restarts = 0;
  /// Seconds every node may take to join an attempt (and to connect to the store).
  double rendezvous_timeout_seconds = 300;
  /// Seconds without a heartbeat after which another node's launcher counts as failed.
  double heartbeat_timeout_seconds = 10;
  /// Elastic: seconds the host waits for more nodes once min_nodes have joined.
  double last_call_seconds = 10;
};

/// Parses --nnodes: "N" or "MIN:MAX" into options.min_nodes / options.nnodes (InputError
/// otherwise).
void parse_nnodes(const std::string& text, LaunchOptions& options);

/// Runs the ranks to completion. Returns 0 when all succeed; otherwise prints which rank failed
/// (exit code or signal) to stderr and returns that rank's exit code (128 + signal for a signal).
/// Stopped on request (SIGINT, SIGTERM, SIGUSR1; the ranks saved their work): 128 + the signal,
/// with "stopped on request" on stderr (dtrain/common/Signals.h).
int launch(const LaunchOptions& options);

/// Validates options (InputError naming the offending option, or the program when it cannot be
/// found: one error before any rank starts).
void validate(const LaunchOptions& options);

/// The path execvp would run for `name` (searched in PATH unless it contains '/'), or "" when
/// there is no such executable file.
std::string find_program(const std::string& name);

}  // namespace dtrain::launch
