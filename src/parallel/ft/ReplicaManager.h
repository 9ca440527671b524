// A data-parallel group that outlives its members (torchft's Manager, for replicas of one rank
// or one tensor-parallel group each): every step the replicas present sum their gradients, and the
// step commits only once each of them has the sum. When a replica dies, its launcher writes so in
// the rendezvous store (dead_key); the survivors' pending collective is abandoned, they agree in
// the store on who is left (one key per step and group, set once: "commit", or "abort" with the
// survivors), regroup without the dead under a fresh store key and sum again from their own
// gradients. The store decides, so every survivor takes the same way through a failure. A replica
// that stops without dying (SIGSTOP, a machine that hangs) stops its heartbeat in the store: the
// others declare it dead once it has been silent for the heartbeat timeout, and its launcher,
// seeing that, kills it (fencing: it must not come back into a group that went on without it).
//
// A replica may be several ranks (its tensor-parallel group: replica_size consecutive world
// ranks): each position in it sums with the same position of the other replicas (a group per
// position), and one decision per step covers every position. A rank that dies or falls
// silent takes its whole replica out; its launcher ends the replica's other ranks and starts
// them all again, and they are admitted together.
//
// Live recovery: a process that replaces a failed member (its launcher starts it again)
// announces itself in the store (join_key) and waits. The decision of the next step that
// commits names it ("commit+R,..."), so every member takes it in at the same step's end: after
// the update they form the group with it under a fresh key, and the first member sends it the
// state. The member that admits it removes its predecessor's death mark first.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/Communicator.h"

namespace dtrain::parallel::ft {

/// What the launcher writes (under the job's store prefix) when a rank of a fault-tolerant job
/// dies: "1" at dead_key(rank), and one more at kDeathsKey.
std::string dead_key(int world_rank);
inline constexpr const char* kDeathsKey = "ft/deaths";
/// Where each replica's heartbeat counts (a tenth of the heartbeat timeout, 10-100 ms).
std::string heartbeat_key(int world_rank);
/// Where a replacement announces itself, and how many wait.
std::string join_key(int world_rank);
inline constexpr const char* kJoinsKey = "ft/joins";
/// Set by the leading replica when training ends (to its world rank): no replacement will be
/// admitted; the launcher then watches for ranks that hang at the end (launch/Attempt.cpp).
inline constexpr const char* kClosedKey = "ft/closed";
/// The heartbeat timeout in milliseconds (every member sets it): the launcher watches the
/// heartbeats once training has ended.
inline constexpr const char* kHeartbeatTimeoutKey = "ft/heartbeat_ms";

class ReplicaManager {
 public:
  /// The world's ranks in replicas of `replica_size` consecutive ranks (its backend must
  /// regroup: gloo). A member whose heartbeat is silent for `heartbeat_timeout` counts as dead.
  /// `replacement`: this process replaces a failed member; call join() first.
  explicit ReplicaManager(comm::CommunicatorPtr world,
                          std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(2),
                          bool replacement = false, int replica_size = 1);
  ~ReplicaManager();
  ReplicaManager(const ReplicaManager&) = delete;
  ReplicaManager& operator=(const ReplicaManager&) = delete;

  /// Sums `flat` over the replicas present, in place, the step committed on all of them;
  /// returns how many took part. A member that dies meanwhile is left out and the sum taken
  /// again over the others, from `refill(flat)` (what `flat` held on entry; without one, a copy
  /// of it is kept). Error when this rank has been left out; CommError after the world's timeout
  /// naming the members that neither finished nor were reported dead.
  int allreduce(at::Tensor flat, const std::function<void(at::Tensor&)>& refill = nullptr);
  /// The same in parts issued ahead (hybrid sharding: each gradient part as soon as it is
  /// reduced inside the replica): start() issues a part's sum over the replicas present, and
  /// sum() waits for the parts started this step and commits the step; after a failure it calls
  /// `restore` (every part as it was before its sum) and sums `parts` again over the others.
  /// Returns how many replicas took part.
  comm::WorkPtr start(const at::Tensor& part);
  int sum(const std::vector<at::Tensor>& parts, std::vector<comm::WorkPtr> works,
          const std::function<void()>& restore);
  /// After the step's sum committed, a collective of the same step over the replicas present
  /// (the parameters' all-gather of replicas that shard the state between them): `issue()`
  /// starts it over group(); when a member dies meanwhile the others regroup without it and
  /// issue it again (reading members() anew). Committed as a sum is; returns how many replicas
  /// took part. `issue` may return several works (one per bucket), or none alone.
  int collective(const std::function<std::vector<comm::WorkPtr>()>& issue,
                 const std::string& what = "parameter gather");
  /// The step's sum issued by the caller (a reduce-scatter, several collectives): as sum(),
  /// but after a failure `issue()` is called again over the others (reading members() anew)
  /// instead of the parts being summed again.
  int reduce(const std::function<std::vector<comm::WorkPtr>()>& issue);

  /// A replacement: announces itself and waits, up to the world's timeout, until the replicas
  /// present admit it (at the end of a committed step); it is then a member of their group.
  /// `root`: the group rank of the member that sends it the state; `steps`: what that member's
  /// caller passed to admit(). nullopt when the job finished first (kClosedKey).
  struct Admission {
    int root = 0;
    int64_t steps = 0;
    /// The replicas admitted with this one (itself among them), in order.
    std::vector<int> admitted;
  };
  /// `while_waiting` runs once, after the announcement (what the replacement can prepare).
  std::optional<Admission> join(const std::function<void()>& while_waiting = nullptr);

  /// The replicas that the last committed step admits (empty unless one waited).
  const std::vector<int>& admitting() const { return admitting_; }
  /// Every member, after the update of a step whose allreduce returned admitting() non-empty:
  /// forms the group with them; returns the group rank of the member that sends them the state
  /// (the first replica present, at this rank's position).
  /// `steps` is handed to them (join()).
  int admit(int64_t steps);
  /// When training ends (rank 0): replacements that still wait give up (join() returns nullopt).
  void close();

  /// The replicas present, in order; the group over them at this rank's position (world rank
  /// replica * replica_size + position).
  const std::vector<int>& members() const { return members_; }
  const comm::CommunicatorPtr& group() const { return group_; }
  /// This rank's replica is the first present (rank 0's until it fails, then the longest
  /// present); false on a replacement not admitted yet.
  bool leads() const { return !replacement_ && members_.front() == replica_; }
  /// This rank's position in its replica (its tensor-parallel rank).
  int position() const { return position_; }
  /// The world rank at this rank's position in `replica`.
  int world_rank_of(int replica) const { return replica * replica_size_ + position_; }
  /// Times the group was formed again (without a member, or with the replacements admitted).
  int64_t regroupings() const { return generation_; }
  /// The count of deaths the launcher reported (kDeathsKey), read from any thread.
  std::function<int64_t()> death_counter() const {
    return [store = store_] { return store->add(kDeathsKey, 0); };
  }
  /// What each sum is in messages: "step" (a training step's gradients), DiLoCo's "outer step".
  void name_sums(std::string name) { sum_name_ = std::move(name); }

 private:
  /// Waits for `work`; false when it failed or a member died meanwhile (it is then abandoned).
  bool finished(const comm::WorkPtr& work);
  /// The members with a rank reported dead.
  std::vector<int> dead_members();
  /// Every world rank of `replicas`, in order.
  std::vector<int> all_ranks_of(const std::vector<int>& replicas) const;
  /// The world ranks at this rank's position in `replicas`.
  std::vector<int> ranks_of(const std::vector<int>& replicas) const;
  /// The group at this rank's position over `members_`, under a fresh key.
  comm::CommunicatorPtr form_group();
  /// Declares dead the members whose heartbeat has been silent for the timeout (at most every
  /// 100 ms); true when it declared one.
  bool declare_silent();
  /// A death to act on: the store's count moved, or a member fell silent.
  bool death_reported();
  /// The store's decision on this step and group: "commit" or "abort:R,R,...".
  std::string decide(bool summed);
  /// Waits for `works` and the decision; after a failure regroups without the dead and waits
  /// for what `again()` issues over the new group, until a decision commits.
  int settle(std::vector<comm::WorkPtr> works,
             const std::function<std::vector<comm::WorkPtr>()>& again);
  /// A step's sum (sum(), reduce()): checks the last admission was taken in, names the step in
  /// messages, runs `settled` (a settle()) and counts the step.
  int step_sum(const std::function<int()>& settled);
  /// settle() over what `issue()` starts (a CommError while issuing: the decision says).
  int settle_issued(const std::function<std::vector<comm::WorkPtr>()>& issue);
  /// Deletes a decided step's keys (of this group).
  void forget(int64_t step);
  /// Keeps a group left behind after a failure until its collective `work` ends
  /// (drop_abandoned); destroying it before would wait for it.
  void abandon(comm::CommunicatorPtr group, comm::WorkPtr work);
  void drop_abandoned();
  /// The replicas waiting to join (not members, every rank announced), in order.
  std::vector<int> waiting();

  comm::CommunicatorPtr world_;
  comm::CommunicatorPtr group_;
  std::shared_ptr<comm::KeyValue> store_;
  int replica_size_ = 1;
  int me_ = 0;        // world rank
  int replica_ = 0;   // me_ / replica_size_
  int position_ = 0;  // me_ % replica_size_
  std::vector<int> members_;
  std::vector<int> admitting_;
  std::vector<std::pair<comm::CommunicatorPtr, comm::WorkPtr>> abandoned_;
  bool replacement_ = false;
  int generation_ = 0;
  int64_t step_ = 0;   // collectives decided (the store's keys)
  int64_t named_ = 0;  // sums committed (steps, in messages)
  std::string sum_name_ = "step";
  std::string doing_;  // the collective in progress, for messages ("step 4")
  bool gathering_ = false;
  int64_t deaths_seen_ = 0;
  std::chrono::milliseconds heartbeat_timeout_;
  std::chrono::milliseconds beat_every_;  // the heartbeat's period, and how often members look
  /// Each member's heartbeat count and when this rank last saw it change.
  std::map<int, std::pair<int64_t, std::chrono::steady_clock::time_point>> beats_;
  std::chrono::steady_clock::time_point next_beat_look_{};
  // When this rank's last look at the heartbeats ended (declare_silent).
  std::chrono::steady_clock::time_point last_look_{};
  std::thread heartbeat_;
  std::mutex heartbeat_mutex_;
  std::condition_variable heartbeat_stop_;
  bool stopping_ = false;
  bool issue_failed_ = false;  // a start() this step could not issue its part
};

}  // namespace dtrain::parallel::ft
