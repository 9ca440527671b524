// Communicator: the one interface every strategy uses to talk to other ranks (DESIGN.md,
// src/comm). Async by default: every op returns a Work. Ops a backend lacks natively
// (reduce_scatter, uneven allgather, bfloat16 reductions) are implemented here once, as ring
// algorithms over the backend's point-to-point ops, so every backend offers the full set.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/Options.h"
#include "dtrain/comm/Work.h"

namespace dtrain::comm {

class Communicator;
using CommunicatorPtr = std::shared_ptr<Communicator>;

/// Where the members of a group report how many collectives they have issued (the rendezvous
/// store), so that a timed-out collective can name the ranks that did not arrive (NCCL's desync
/// report). Backends without a store have none.
class ProgressBoard {
 public:
  virtual ~ProgressBoard() = default;
  virtual void publish(const std::string& key, const std::string& value) = 0;
  /// The value at `key`, or nullopt (does not wait).
  virtual std::optional<std::string> read(const std::string& key) = 0;
};

struct ProgressState;

/// The rendezvous store's keys under the job's prefix, for protocols above the collectives (the
/// replica quorum of parallel/ft). Every call is bounded by the store's timeout.
class KeyValue {
 public:
  virtual ~KeyValue() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  /// The value at `key`, or nullopt (does not wait).
  virtual std::optional<std::string> read(const std::string& key) = 0;
  /// Adds `delta` to the integer at `key` (0 if absent) and returns the sum; add(key, 0) reads.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  /// Sets `key` to `value` unless it holds one; returns what it holds afterwards (one winner).
  virtual std::string set_if_absent(const std::string& key, const std::string& value) = 0;
  /// Deletes `key` (nothing when absent).
  virtual void remove(const std::string& key) = 0;
};

/// A group of ranks that can run collectives together. Every member must issue the same
/// sequence of collectives (as with MPI/c10d).
class Communicator {
 public:
  Communicator(int rank, int size, std::string name, std::vector<int> global_ranks,
               Milliseconds timeout);
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// Human-readable group name used in errors ("world", "dp", ...).
  const std::string& name() const { return name_; }
  /// global_ranks()[i] is the world rank of this group's rank i.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  Milliseconds timeout() const { return timeout_; }
  virtual std::string backend_name() const = 0;

  /// In-place allreduce of `tensor` (any layout; contiguous is fastest).
  virtual WorkPtr allreduce(at::Tensor tensor, const AllreduceOptions& options = {}) = 0;
  /// In-place broadcast from options.root.
  virtual WorkPtr broadcast(at::Tensor tensor, const BroadcastOptions& options = {}) = 0;
  /// Gathers every rank's `input` into the flat `output` in rank order (ring algorithm:
  /// each rank sends and receives (size-1)/size of the output).
  virtual WorkPtr allgather(at::Tensor output, at::Tensor input,
                            const AllgatherOptions& options = {});
  /// Reduces the flat `input` across ranks and leaves share `rank()` in `output` (ring
  /// algorithm: each rank sends (size-1)/size of the input, as a ring reduce-scatter does).
  virtual WorkPtr reduce_scatter(at::Tensor output, at::Tensor input,
                                 const ReduceScatterOptions& options = {});
  /// Every rank sends a part of `input` to every rank and receives one from each into `output`
  /// (AllToAllOptions; the expert dispatch of a mixture of experts). Each rank posts all its
  /// sends and receives at once (the pairwise exchange of gloo's alltoallv), so each sends
  /// exactly what leaves it.
  virtual WorkPtr all_to_all(at::Tensor output, at::Tensor input,
                             const AllToAllOptions& options = {});
  virtual WorkPtr send(at::Tensor tensor, int dst, const P2POptions& options = {});
  virtual WorkPtr recv(at::Tensor tensor, int src, const P2POptions& options = {});
  virtual WorkPtr barrier(const BarrierOptions& options = {}) = 0;

  /// Collective over this communicator: all members call it with the same `ranks` (ranks of
  /// this group). Returns the new group for members and nullptr for the others.
  virtual CommunicatorPtr new_group(const std::vector<int>& ranks, const std::string& name) = 0;
  /// Collective: ranks with equal `color` form a group, ordered by (key, rank). A negative
  /// color means "no group" (returns nullptr).
  CommunicatorPtr split(int color, int key, const std::string& name);

  /// The store this group met through, under its job's prefix (null: the backend has none).
  virtual std::shared_ptr<KeyValue> key_value() const { return nullptr; }
  /// Not collective over this group: the world ranks `world_ranks` (this rank among them) form
  /// a new group through the store under `key` (one no group used before), the others left out:
  /// how the survivors of a failed member regroup (they cannot run new_group with it). CommError
  /// where the backend cannot.
  virtual CommunicatorPtr regroup(const std::vector<int>& world_ranks, const std::string& key,
                                  const std::string& name);
  /// False for a group that never formed: a replacement replica's world (--fault-tolerance
  /// replicas) and the groups new_group cuts from it, whose collectives fail naming why (only
  /// groups formed with regroup() carry its traffic).
  virtual bool formed() const { return true; }

  /// Total bytes this rank has sent through point-to-point ops (ring algorithms included).
  int64_t bytes_sent() const { return bytes_sent_.load(); }

  /// Bytes this rank has sent on this group and on every group related to it by new_group or
  /// split (the world and all its subgroups share one count): each collective's ring_wire_bytes
  /// plus user point-to-point sends. StepRunner reports its growth per step ("wire_bytes").
  int64_t wire_bytes() const { return wire_family_->load(); }

  /// Collectives this rank issued on this group of more than one rank, by op ("allreduce",
  /// "broadcast", "allgather", "reduce_scatter", "all_to_all"): how many, and their elements
  /// (the tensor's for allreduce and broadcast, the gathered output's or the scattered input's,
  /// the input's for all_to_all). For tests and reports of what a strategy communicates.
  struct Tally {
    int64_t count = 0;
    int64_t elements = 0;
    /// Those elements' bytes, and what a bandwidth-optimal (ring) algorithm sends of them from
    /// each rank: 2 (n-1)/n of the bytes for allreduce, (n-1)/n for the others; for all_to_all
    /// the bytes sent to the other ranks.
    int64_t bytes = 0;
    int64_t wire_bytes = 0;
  };
  std::map<std::string, Tally> tally() const;
  void reset_tally();

 protected:
  /// Backend point-to-point with an unchecked tag (internal algorithms use tags above the
  /// user range).
  virtual WorkPtr send_tagged(at::Tensor tensor, int dst, int tag, Milliseconds timeout) = 0;
  virtual WorkPtr recv_tagged(at::Tensor tensor, int src, int tag, Milliseconds timeout) = 0;

  /// Runs `body` on this communicator's op thread, in issue order; returns its Work.
  WorkPtr run_async(std::string description, Milliseconds timeout, std::function<void()> body);
  /// Ring reduce-scatter / allgather / allreduce bodies (run on the op thread).
  void ring_reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                           const std::vector<int64_t>& counts, ReduceOp op, int64_t sequence,
                           Milliseconds timeout, const std::string& what,
                           bool input_is_scratch = false);
  void ring_allgather(const at::Tensor& output, const at::Tensor& input,
                      const std::vector<int64_t>& counts, int64_t sequence, Milliseconds timeout,
                      const std::string& what, int step_base = 0);
  WorkPtr ring_allreduce(at::Tensor tensor, ReduceOp op, Milliseconds timeout,
                         const std::string& what);

  /// Backends with a store call this once: this rank's count of issued collectives is published
  /// there about once a second under `key_prefix` + rank.
  void track_progress(std::shared_ptr<ProgressBoard> board, const std::string& key_prefix);
  /// Counts a collective as issued (call once where the backend starts it) and attaches the
  /// who-did-not-arrive report to its Work's timeout error.
  void note_collective(const std::string& op_and_args, Work& work);

  /// With DTRAIN_CHECK_COLLECTIVES=1 in the environment (dtrain train --check-collectives; as
  /// PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL): before each collective the members compare
  /// what they are about to call (op, element count, dtype, root: `op_and_args`) by a small
  /// allgather of its hash; where they differ, CommError naming the group, the collective's
  /// index on it and each rank's call. A member that skipped its last collective leaves the
  /// others in this check: its timeout names the op and the ranks that did not arrive. A no-op
  /// without the variable. Backends call it first in each collective of more than one rank.
  void check_matching(const std::string& op_and_args);
  /// The check's own allgather (a ring over point-to-point), waited for.
  void check_gather(const at::Tensor& output, const at::Tensor& input, std::vector<int64_t> counts,
                    const std::string& label);

  Milliseconds resolve(Milliseconds timeout) const;
  /// "allreduce(sum, 4 x Float) on group 'world' (world ranks [0,1]) at rank 0".
  std::string describe(const std::string& op_and_args) const;
  int64_t next_sequence() { return sequence_++; }
  void count_sent(int64_t bytes) { bytes_sent_ += bytes; }
  /// A group made from `parent` (new_group) adds to the parent's wire_bytes count.
  void share_wire_count(const Communicator& parent) { wire_family_ = parent.wire_family_; }
  /// Counts a collective of `elements` x `element_size` bytes in the tally and in
  /// wire_bytes().
  /// `wire_bytes` >= 0: what leaves this rank, where ring_wire_bytes does not say (all_to_all).
  void count_collective(const char* op, int64_t elements, int64_t element_size,
                        int64_t wire_bytes = -1);
  /// The checks and counts of an all_to_all, before the backend starts it: the counts resolved
  /// (even shares where empty), checked against the tensors, matched across ranks under
  /// DTRAIN_CHECK_COLLECTIVES (each rank's sends against its peers' receives), tallied.
  struct AllToAllCounts {
    std::vector<int64_t> send, recv;
  };
  AllToAllCounts prepare_all_to_all(const at::Tensor& output, const at::Tensor& input,
                                    const AllToAllOptions& options, const std::string& what);

 private:
  void op_thread_main();
  void exchange(const at::Tensor& send_buf, const at::Tensor& recv_buf, int64_t sequence, int step,
                Milliseconds timeout, const std::string& what);

  int rank_;
  int size_;
  std::string name_;
  std::vector<int> global_ranks_;
  Milliseconds timeout_;
  bool check_collectives_ = false;
  int64_t checked_ = 0;  // collectives checked on this group
  int64_t sequence_ = 0;
  std::atomic<int64_t> bytes_sent_{0};
  std::shared_ptr<std::atomic<int64_t>> wire_family_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<ProgressState> progress_;
  mutable std::mutex tally_mutex_;
  std::map<std::string, Tally> tally_;

  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread op_thread_;
};

/// What each rank sends in a bandwidth-optimal (ring) `op` ("allreduce", "broadcast",
/// "allgather", "reduce_scatter") of `bytes` over `ranks` ranks.
int64_t ring_wire_bytes(const std::string& op, int64_t bytes, int ranks);

/// How to join the world. Defaults suit one machine.
struct InitOptions {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// Default timeout of every op and of rendezvous.
  Milliseconds timeout{std::chrono::seconds(120)};
  /// "gloo" (CPU) or "nccl" (CUDA builds of LibTorch only).
  std::string backend = "gloo";
  /// Network interface for the data plane ("" = $GLOO_SOCKET_IFNAME, else the local address
  /// from which master_addr is reached: its route).
  std::string interface;
  /// The rendezvous store is hosted by the launcher (`dtrain launch`), not by rank 0.
  bool store_hosted_by_launcher = false;
  /// Prefix of this job's keys in the store (a launcher's restarts each use their own).
  std::string store_prefix;
  /// Backend worker threads per communicator.
  int backend_threads = 2;
};

/// Joins the world described by `options` (rank 0 hosts the TCP rendezvous store unless the
/// launcher does).
CommunicatorPtr init(const InitOptions& options);

/// Element size-aware description helper: "1024 x BFloat16".
std::string shape_string(const at::Tensor& tensor);

/// Every member's `text` in rank order, on every member (two allgathers: lengths, then the
/// padded bytes). For small reports such as trace fragments, not for bulk data.
std::vector<std::string> allgather_strings(Communicator& comm, const std::string& text);

/// Lanes. While a LaneScope lives on a thread, on_lane(group) gives that thread's substitute for
/// `group` (a group of the same ranks made for the purpose), else `group` itself. Two threads of
/// a rank that issue collectives at once must not share a group: its ops would meet their peers'
/// in another order. DualPipe-V's backward thread issues its collectives on the second lanes of
/// the expert, tensor-parallel and context groups (ProcessGrid::add_lanes), so that each lane
/// sees its ops in one order on every rank while both threads run. Every op issued inside a
/// pair's computation asks on_lane for its group (nn/tensor/Mappings.cpp, the context attention,
/// the MoE layer, the vocabulary-parallel loss).
class LaneScope {
 public:
  explicit LaneScope(std::vector<std::pair<const Communicator*, CommunicatorPtr>> substitutes);
  ~LaneScope();
  LaneScope(const LaneScope&) = delete;
  LaneScope& operator=(const LaneScope&) = delete;

 private:
  std::vector<std::pair<const Communicator*, CommunicatorPtr>> saved_;
};
const CommunicatorPtr& on_lane(const CommunicatorPtr& group);

}  // namespace dtrain::comm
