#include "parallel/ft/ReplicaManager.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <sstream>
#include <thread>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::ft {

namespace {

using Clock = std::chrono::steady_clock;

std::string joined(const std::vector<int>& ranks) {
  std::string text;
  for (const int r : ranks) text += concat(text.empty() ? "" : ",", r);
  return text;
}

// A group left behind whose collective never finished by the end (the process's): destroying
// it would wait for that collective, so it is kept.
void keep_forever(comm::CommunicatorPtr group) {
  static std::mutex mutex;
  static auto* kept = new std::vector<comm::CommunicatorPtr>();
  std::lock_guard<std::mutex> lock(mutex);
  kept->push_back(std::move(group));
}

std::vector<int> parsed(const std::string& text) {
  std::vector<int> ranks;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) ranks.push_back(std::stoi(item));
  }
  return ranks;
}

}  // namespace

std::string dead_key(int world_rank) { return concat("ft/dead/", world_rank); }
std::string heartbeat_key(int world_rank) { return concat("ft/beat/", world_rank); }
std::string join_key(int world_rank) { return concat("ft/join/", world_rank); }

namespace {
std::string admit_key(int world_rank) { return concat("ft/admit/", world_rank); }
}  // namespace

ReplicaManager::ReplicaManager(comm::CommunicatorPtr world,
                               std::chrono::milliseconds heartbeat_timeout, bool replacement,
                               int replica_size)
    : world_(std::move(world)),
      group_(world_),
      store_(world_->key_value()),
      replica_size_(replica_size),
      replacement_(replacement),
      heartbeat_timeout_(heartbeat_timeout),
      beat_every_(std::clamp(heartbeat_timeout / 10, std::chrono::milliseconds(10),
                             std::chrono::milliseconds(100))) {
  DTRAIN_CHECK_INPUT(store_ != nullptr,
                     "--fault-tolerance replicas needs a backend that meets through a store "
                     "(gloo); group '",
                     world_->name(), "' (", world_->backend_name(), ") has none");
  DTRAIN_CHECK(replica_size_ >= 1 && world_->size() % replica_size_ == 0,
               "replica group: world of ", world_->size(), " ranks in replicas of ", replica_size_);
  me_ = world_->global_ranks()[world_->rank()];
  replica_ = me_ / replica_size_;
  position_ = me_ % replica_size_;
  for (int r = 0; r < world_->size() / replica_size_; ++r) members_.push_back(r);
  deaths_seen_ = store_->add(kDeathsKey, 0);
  store_->set(kHeartbeatTimeoutKey, std::to_string(heartbeat_timeout_.count()));
  // A group of its own, not the world (which lives as long as the process): the group a
  // failure leaves behind is destroyed once its collective ended (drop_abandoned).
  if (!replacement_) group_ = form_group();
  const int me = me_;
  // (The store serializes its calls: a beat waits at most for one of the training thread's.)
  heartbeat_ = std::thread([this, me, store = world_->key_value()] {
    std::unique_lock<std::mutex> lock(heartbeat_mutex_);
    while (!stopping_) {
      try {
        store->add(heartbeat_key(me), 1);
      } catch (const CommError&) {
        // The store is gone (the launcher ended): the training thread hears of it too.
      }
      heartbeat_stop_.wait_for(lock, beat_every_);
    }
  });
}

ReplicaManager::~ReplicaManager() {
  for (auto& [group, work] : abandoned_) {
    if (!work || !work->is_completed()) keep_forever(std::move(group));
  }
  {
    std::lock_guard<std::mutex> lock(heartbeat_mutex_);
    stopping_ = true;
  }
  heartbeat_stop_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
}

std::vector<int> ReplicaManager::all_ranks_of(const std::vector<int>& replicas) const {
  std::vector<int> ranks;
  for (const int m : replicas) {
    for (int p = 0; p < replica_size_; ++p) ranks.push_back(m * replica_size_ + p);
  }
  return ranks;
}

std::vector<int> ReplicaManager::ranks_of(const std::vector<int>& replicas) const {
  std::vector<int> ranks;
  for (const int m : replicas) ranks.push_back(world_rank_of(m));
  return ranks;
}

comm::CommunicatorPtr ReplicaManager::form_group() {
  return world_->regroup(ranks_of(members_), concat("ft/g", generation_, "/p", position_),
                         "replicas");
}

bool ReplicaManager::declare_silent() {
  const auto now = Clock::now();
  if (now < next_beat_look_) return false;
  next_beat_look_ = now + beat_every_;
  const int me = me_;
  bool declared = false;
  // Time this rank could not look is no evidence of another's silence: a store that stalled
  // (a rank stopped halfway through a request blocks c10d 1.13's store server until its launcher
  // ends it) held every heartbeat back. After such a gap, or a read that took half the timeout,
  // each silence counts from now.
  const auto stall = heartbeat_timeout_ / 2;
  bool stalled =
      last_look_ != Clock::time_point{} && now - last_look_ > std::max(stall, beat_every_ * 4);
  std::vector<std::pair<int, int64_t>> read;
  for (const int r : all_ranks_of(members_)) {
    if (r == me) continue;
    const auto before = Clock::now();
    read.emplace_back(r, store_->add(heartbeat_key(r), 0));
    stalled = stalled || Clock::now() - before > stall;
  }
  last_look_ = Clock::now();
  for (const auto& [r, beat] : read) {
    auto seen = beats_.find(r);
    if (seen == beats_.end() || seen->second.first != beat || stalled) {
      beats_[r] = {beat, stalled ? last_look_ : now};
      continue;
    }
    if (now - seen->second.second < heartbeat_timeout_) continue;
    // Silent: whoever notices first declares it (once), as its launcher would.
    const std::string mine =
        concat("silent for ", heartbeat_timeout_.count(), " ms (seen by ", me, ")");
    if (store_->set_if_absent(dead_key(r), mine) == mine) {
      store_->add(kDeathsKey, 1);
      std::fprintf(stderr,
                   "dtrain: replica group: world rank %d's heartbeat has been silent for %lld "
                   "ms: counted as dead\n",
                   r, static_cast<long long>(heartbeat_timeout_.count()));
      std::fflush(stderr);
    }
    declared = true;
  }
  return declared;
}

bool ReplicaManager::death_reported() {
  declare_silent();
  return store_->add(kDeathsKey, 0) > deaths_seen_ && !dead_members().empty();
}

std::vector<int> ReplicaManager::dead_members() {
  std::vector<int> dead;
  for (const int m : members_) {
    for (const int r : all_ranks_of({m})) {
      if (store_->read(dead_key(r))) {
        dead.push_back(m);
        break;
      }
    }
  }
  return dead;
}

bool ReplicaManager::finished(const comm::WorkPtr& work) {
  const auto deadline = Clock::now() + world_->timeout();
  auto next_look = Clock::now() + std::chrono::milliseconds(10);
  // Asleep between looks, from 50 us up to 1 ms: on a machine with more ranks than cores a rank
  // that wakes often takes the core from the ranks still computing. (A timed wait on the work
  // would throw at each slice, and building LibTorch's error records a backtrace: measured,
  // the sum took 1.2 s a step so.)
  auto pause = std::chrono::microseconds(50);
  while (!work->is_completed()) {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
    const auto now = Clock::now();
    if (now >= deadline) return false;  // the decision's wait names who is missing
    if (now < next_look) continue;
    next_look = now + std::chrono::milliseconds(10);
    // A member reported dead (or silent): the collective may never end here (a peer that did
    // reach it waits on this rank's ring neighbour, not on the dead); leave it.
    if (death_reported()) return false;
  }
  try {
    work->wait(std::chrono::milliseconds(1));
    return true;
  } catch (const CommError&) {
    return false;  // a peer's connection broke: the decision says what happens
  }
}

void ReplicaManager::forget(int64_t step) {
  const std::string base = concat("ft/g", generation_, "/t", step, "/");
  store_->remove(base + "decision");
  store_->remove(base + "summed");
  for (const int r : all_ranks_of(members_)) store_->remove(concat(base, "summed/", r));
}

std::string ReplicaManager::decide(bool summed) {
  const std::string base = concat("ft/g", generation_, "/t", step_, "/");
  const int me = me_;
  const int64_t everyone = static_cast<int64_t>(members_.size()) * replica_size_;
  int64_t count = 0;
  if (summed) {
    store_->set(concat(base, "summed/", me), "1");
    count = store_->add(base + "summed", 1);
  }
  const auto deadline = Clock::now() + world_->timeout();
  // The rank whose sum completes the count decides; the others read the decision, asleep
  // between reads (from 100 us up to 1 ms: a store round trip per read), and look for deaths
  // every 10 ms (each look costs a few round trips).
  auto pause = std::chrono::microseconds(100);
  auto next_look = Clock::now() + std::chrono::milliseconds(10);
  while (true) {
    if (count == everyone) {
      // Replacements waiting are admitted at this step's end: the decision names them, so
      // every member takes them in at the same step.
      const std::vector<int> joining =
          store_->add(kJoinsKey, 0) > 0 ? waiting() : std::vector<int>{};
      return store_->set_if_absent(base + "decision",
                                   joining.empty() ? "commit" : "commit+" + joined(joining));
    }
    if (auto decision = store_->read(base + "decision")) return *decision;
    const auto now = Clock::now();
    if (now >= next_look) {
      next_look = now + std::chrono::milliseconds(10);
      count = store_->add(base + "summed", 0);
      if (count == everyone) continue;
      declare_silent();
      if (store_->add(kDeathsKey, 0) > deaths_seen_) {
        const std::vector<int> dead = dead_members();
        if (!dead.empty()) {
          std::vector<int> survivors;
          for (const int r : members_) {
            if (std::find(dead.begin(), dead.end(), r) == dead.end()) survivors.push_back(r);
          }
          return store_->set_if_absent(base + "decision", "abort:" + joined(survivors));
        }
      }
      if (now >= deadline) {
        std::vector<int> missing;
        for (const int r : all_ranks_of(members_)) {
          if (!store_->read(concat(base, "summed/", r))) missing.push_back(r);
        }
        DTRAIN_THROW(CommError, "replica group: ", doing_, gathering_ ? "" : "'s sum",
                     " did not finish on ", "world rank(s) ", joined(missing), " within ",
                     world_->timeout().count(),
                     " ms, and none of them was reported dead (members: world ranks ",
                     joined(all_ranks_of(members_)), ")");
      }
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

void ReplicaManager::abandon(comm::CommunicatorPtr group, comm::WorkPtr work) {
  abandoned_.emplace_back(std::move(group), std::move(work));
}

void ReplicaManager::drop_abandoned() {
  // A group that a failure left behind goes once its collective ended (a peer's connection
  // broke, or its timeout ran out): its connections to the dead would otherwise stay in the
  // backend's event loop, which spins on them (measured: most of a core after a few failures).
  // Destroying it earlier would wait for that collective.
  for (auto it = abandoned_.begin(); it != abandoned_.end();) {
    if (!it->second || it->second->is_completed()) {
      it = abandoned_.erase(it);
    } else {
      ++it;
    }
  }
}

int ReplicaManager::allreduce(at::Tensor flat, const std::function<void(at::Tensor&)>& refill) {
  const at::Tensor mine = refill ? at::Tensor() : flat.clone();
  std::vector<comm::WorkPtr> works = {start(flat)};
  return sum({flat}, std::move(works), [&] {
    if (refill) {
      refill(flat);
    } else {
      flat.copy_(mine);
    }
  });
}

comm::WorkPtr ReplicaManager::start(const at::Tensor& part) {
  if (group_->size() == 1) return nullptr;
  try {
    return group_->allreduce(part);
  } catch (const CommError&) {
    issue_failed_ = true;  // a peer's connection broke: the decision says what happens
    return nullptr;
  }
}

int ReplicaManager::step_sum(const std::function<int()>& settled) {
  DTRAIN_CHECK(admitting_.empty(), "replica group: ", sum_name_, " ", named_ + 1,
               " began before the replacements the previous step admitted were taken in "
               "(admit)");
  doing_ = concat(sum_name_, " ", named_ + 1);
  gathering_ = false;
  const int replicas = settled();
  ++named_;
  return replicas;
}

int ReplicaManager::sum(const std::vector<at::Tensor>& parts, std::vector<comm::WorkPtr> works,
                        const std::function<void()>& restore) {
  return step_sum([&] {
    return settle(std::move(works), [&] {
      restore();
      std::vector<comm::WorkPtr> again;
      for (const auto& part : parts) again.push_back(start(part));
      return again;
    });
  });
}

int ReplicaManager::collective(const std::function<std::vector<comm::WorkPtr>()>& issue,
                               const std::string& what) {
  // (Replacements the step's sum admitted are still to be taken in: this is the same step.)
  doing_ = concat(sum_name_, " ", named_, "'s ", what);
  gathering_ = true;
  return settle_issued(issue);
}

int ReplicaManager::reduce(const std::function<std::vector<comm::WorkPtr>()>& issue) {
  return step_sum([&] { return settle_issued(issue); });
}

int ReplicaManager::settle_issued(const std::function<std::vector<comm::WorkPtr>()>& issue) {
  auto issued = [&]() -> std::vector<comm::WorkPtr> {
    try {
      return issue();
    } catch (const CommError&) {
      issue_failed_ = true;  // a peer's connection broke: the decision says what happens
      return {};
    }
  };
  return settle(issued(), issued);
}

int ReplicaManager::settle(std::vector<comm::WorkPtr> works,
                           const std::function<std::vector<comm::WorkPtr>()>& again) {
  drop_abandoned();
  const int me = me_;
  while (true) {
    bool summed = !issue_failed_;
    issue_failed_ = false;
    for (const auto& work : works) {
      if (summed && work) summed = finished(work);
    }
    const std::string decision = decide(summed);
    if (decision.rfind("commit", 0) == 0) {
      admitting_ = decision.size() > 6 ? parsed(decision.substr(7)) : std::vector<int>{};
      // Every member has passed the previous step's decision (each summed this one): its keys
      // go, so the store holds a few keys per member whatever the run's length.
      if (me == world_rank_of(members_.front()) && position_ == 0 && step_ > 0) {
        forget(step_ - 1);
      }
      ++step_;
      return static_cast<int>(members_.size());
    }
    const auto started = Clock::now();
    const std::vector<int> survivors = parsed(decision.substr(decision.find(':') + 1));
    DTRAIN_CHECK(std::find(survivors.begin(), survivors.end(), replica_) != survivors.end(),
                 "replica group: world rank ", me, " was left out at ", doing_,
                 " (the others go on as world ranks ", joined(all_ranks_of(survivors)), ")");
    std::vector<int> lost;
    for (const int r : members_) {
      if (std::find(survivors.begin(), survivors.end(), r) == survivors.end()) lost.push_back(r);
    }
    // (The group goes once each of its collectives ended.)
    for (auto& work : works) abandon(group_, std::move(work));
    if (works.empty()) abandon(group_, nullptr);
    group_.reset();
    members_ = survivors;
    ++generation_;
    deaths_seen_ = store_->add(kDeathsKey, 0);
    group_ = form_group();
    works = again();
    if (me == world_rank_of(members_.front()) && position_ == 0) {
      std::fprintf(stderr,
                   "dtrain: replica group: world rank(s) %s left at %s; %zu replica(s) go on "
                   "(regrouped in %.0f ms)\n",
                   joined(all_ranks_of(lost)).c_str(), doing_.c_str(), members_.size(),
                   std::chrono::duration<double, std::milli>(Clock::now() - started).count());
      std::fflush(stderr);
    }
  }
}

std::vector<int> ReplicaManager::waiting() {
  std::vector<int> replicas;
  for (int m = 0; m < world_->size() / replica_size_; ++m) {
    if (std::find(members_.begin(), members_.end(), m) != members_.end()) continue;
    // (A replacement that announced itself before the members left its predecessor out waits
    // for a later step; so does a replica until all its ranks have.)
    bool all = true;
    for (const int r : all_ranks_of({m})) all = all && store_->read(join_key(r)).has_value();
    if (all) replicas.push_back(m);
  }
  return replicas;
}

int ReplicaManager::admit(int64_t steps) {
  DTRAIN_CHECK(!admitting_.empty(), "replica group: admit() without replacements to admit");
  const auto started = Clock::now();
  const int sender = members_.front();
  // One member writes the admissions (the others form the group with what they know).
  const bool writes = replica_ == sender && position_ == 0;
  // The admitted go last: the first member stays the longest present (it leads: evaluates,
  // checkpoints and writes the run's outputs, and sends the state).
  std::vector<int> next = members_;
  next.insert(next.end(), admitting_.begin(), admitting_.end());
  ++generation_;
  if (writes) {
    // Its predecessor's death mark goes first (the launcher fences a marked process), then the
    // admission it waits for: generation, step key, the caller's steps, the sender, the members
    // (replicas), the sums committed, the replicas admitted together.
    const std::string admission = concat(generation_, " ", step_, " ", steps, " ", sender, " ",
                                         joined(next), " ", named_, " ", joined(admitting_));
    for (const int r : all_ranks_of(admitting_)) {
      store_->remove(dead_key(r));
      store_->remove(join_key(r));
      store_->add(kJoinsKey, -1);
      store_->set(admit_key(r), admission);
    }
  }
  const std::vector<int> admitted = admitting_;
  admitting_.clear();
  members_ = next;
  deaths_seen_ = store_->add(kDeathsKey, 0);
  // (The previous group finished its last collective: it can go.)
  group_ = form_group();
  if (writes) {
    std::fprintf(stderr,
                 "dtrain: replica group: world rank(s) %s joined after step %lld; %zu replica(s) "
                 "(regrouped in %.0f ms)\n",
                 joined(all_ranks_of(admitted)).c_str(), static_cast<long long>(steps),
                 members_.size(),
                 std::chrono::duration<double, std::milli>(Clock::now() - started).count());
    std::fflush(stderr);
  }
  return static_cast<int>(std::find(members_.begin(), members_.end(), sender) - members_.begin());
}

std::optional<ReplicaManager::Admission> ReplicaManager::join(
    const std::function<void()>& while_waiting) {
  DTRAIN_CHECK(replacement_, "replica group: join() on a replica that is not a replacement");
  const int me = me_;
  store_->set(join_key(me), "1");
  store_->add(kJoinsKey, 1);
  if (while_waiting) while_waiting();
  const auto deadline = Clock::now() + world_->timeout();
  std::string admission;
  while (true) {
    if (auto found = store_->read(admit_key(me))) {
      admission = *found;
      store_->remove(admit_key(me));
      break;
    }
    if (store_->read(kClosedKey)) {
      store_->remove(join_key(me));
      store_->add(kJoinsKey, -1);
      return std::nullopt;
    }
    DTRAIN_CHECK_T(CommError, Clock::now() < deadline, "replica group: world rank ", me,
                   " (a replacement) was not admitted within ", world_->timeout().count(),
                   " ms: no step of the replicas present committed meanwhile");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::stringstream in(admission);
  int64_t steps = 0;
  int sender = 0;
  std::string members, admitted;
  in >> generation_ >> step_ >> steps >> sender >> members >> named_ >> admitted;
  members_ = parsed(members);
  DTRAIN_CHECK(
      !in.fail() && std::find(members_.begin(), members_.end(), replica_) != members_.end(),
      "replica group: world rank ", me, " got a malformed admission '", admission, "'");
  deaths_seen_ = store_->add(kDeathsKey, 0);
  group_ = form_group();
  replacement_ = false;
  Admission result;
  result.root =
      static_cast<int>(std::find(members_.begin(), members_.end(), sender) - members_.begin());
  result.steps = steps;
  result.admitted = parsed(admitted);
  return result;
}

void ReplicaManager::close() { store_->set(kClosedKey, std::to_string(world_->rank())); }

}  // namespace dtrain::parallel::ft
