// Communicator base: the op thread, and the ring algorithms (reduce-scatter, allgather, and
// allreduce for dtypes the backend cannot reduce) built on point-to-point ops, so that every
// backend supports every op with ring-optimal traffic.
#include "dtrain/comm/Communicator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include "dtrain/common/Error.h"

namespace dtrain::comm {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "?";
}

std::string shape_string(const at::Tensor& tensor) {
  return concat(tensor.numel(), " x ", tensor.scalar_type());
}

std::vector<std::string> allgather_strings(Communicator& comm, const std::string& text) {
  at::Tensor length = at::tensor({static_cast<int64_t>(text.size())}, at::kLong);
  at::Tensor lengths = at::empty({comm.size()}, at::kLong);
  comm.allgather(lengths, length)->wait();
  const int64_t longest = std::max<int64_t>(lengths.max().item<int64_t>(), 1);
  at::Tensor padded = at::zeros({longest}, at::kByte);
  std::memcpy(padded.data_ptr(), text.data(), text.size());
  at::Tensor all = at::empty({longest * comm.size()}, at::kByte);
  comm.allgather(all, padded)->wait();
  std::vector<std::string> out;
  for (int r = 0; r < comm.size(); ++r) {
    const char* base = reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * longest;
    out.emplace_back(base, static_cast<size_t>(lengths[r].item<int64_t>()));
  }
  return out;
}

// ---- progress board: how many collectives each rank has issued -------------------------------

struct ProgressState {
  std::shared_ptr<ProgressBoard> board;
  std::string key_prefix;
  int rank = 0;
  std::vector<int> global_ranks;
  std::atomic<int64_t> issued{0};
  std::mutex mutex;
  std::string last_op;  // guarded by mutex

  static int64_t now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  void publish_now() {
    std::string op;
    {
      std::lock_guard<std::mutex> lock(mutex);
      op = last_op;
    }
    board->publish(concat(key_prefix, rank), concat(issued.load(), "|", now_ms(), "|", op));
  }
  // Which ranks have not issued collective #index (this rank's timed-out one).
  std::string diagnose(int64_t index) {
    publish_now();
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // the others' next report
    std::string missing, arrived;
    for (int r = 0; r < static_cast<int>(global_ranks.size()); ++r) {
      if (r == rank) continue;
      const auto value = board->read(concat(key_prefix, r));
      const std::string who = concat("rank ", r, " (world rank ", global_ranks[r], ")");
      if (!value) {
        missing += concat(missing.empty() ? "" : "; ", who,
                          " has reported no progress (not started, or died before its first "
                          "report)");
        continue;
      }
      const auto bar1 = value->find('|');
      const auto bar2 = value->find('|', bar1 + 1);
      const int64_t count = std::atoll(value->substr(0, bar1).c_str());
      const double age =
          (now_ms() - std::atoll(value->substr(bar1 + 1, bar2 - bar1 - 1).c_str())) / 1e3;
      if (count >= index) {
        arrived += concat(arrived.empty() ? "" : ", ", r);
        continue;
      }
      const std::string last = bar2 == std::string::npos ? "" : value->substr(bar2 + 1);
      missing += concat(missing.empty() ? "" : "; ", who, " has issued ", count,
                        " collectives on this group, this one is #", index,
                        last.empty() ? "" : concat(" (its last: ", last, ")"), ", reported ",
                        std::max(0.0, age), " s ago");
    }
    if (missing.empty()) {
      return "; every rank of the group issued this collective (so a transport problem, not a "
             "rank that did not arrive)";
    }
    return concat("; did not arrive: ", missing,
                  arrived.empty() ? "" : concat("; arrived: ranks ", arrived));
  }
};

namespace {

// One thread per process publishes every tracked group's count about once a second, also when
// the ranks' own threads are stuck. Deliberately never destroyed: it may be inside a store call
// at exit.
class ProgressPublisher {
 public:
  static ProgressPublisher& instance() {
    static auto* publisher = new ProgressPublisher;
    return *publisher;
  }
  void add(const std::shared_ptr<ProgressState>& state) {
    std::lock_guard<std::mutex> lock(mutex_);
    states_.push_back(state);
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();
    }
  }

 private:
  void run() {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      std::vector<std::shared_ptr<ProgressState>> live;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        std::vector<std::weak_ptr<ProgressState>> kept;
        for (const auto& weak : states_) {
          if (auto state = weak.lock()) {
            live.push_back(state);
            kept.push_back(weak);
          }
        }
        states_.swap(kept);
      }
      for (const auto& state : live) {
        try {
          state->publish_now();
        } catch (...) {  // the store is gone (the job is ending): nothing to report to
        }
      }
    }
  }
  std::mutex mutex_;
  std::vector<std::weak_ptr<ProgressState>> states_;
  bool started_ = false;
};

}  // namespace

void Communicator::track_progress(std::shared_ptr<ProgressBoard> board,
                                  const std::string& key_prefix) {
  auto state = std::make_shared<ProgressState>();
  state->board = std::move(board);
  state->key_prefix = key_prefix;
  state->rank = rank_;
  state->global_ranks = global_ranks_;
  progress_ = state;
  ProgressPublisher::instance().add(state);
}

std::map<std::string, Communicator::Tally> Communicator::tally() const {
  std::lock_guard<std::mutex> lock(tally_mutex_);
  return tally_;
}

void Communicator::reset_tally() {
  std::lock_guard<std::mutex> lock(tally_mutex_);
  tally_.clear();
}

int64_t ring_wire_bytes(const std::string& op, int64_t bytes, int ranks) {
  if (ranks <= 1) return 0;
  const int64_t share = bytes * (ranks - 1) / ranks;
  return op == "allreduce" ? 2 * share : share;
}

void Communicator::count_collective(const char* op, int64_t elements, int64_t element_size,
                                    int64_t wire_bytes) {
  const int64_t bytes = elements * element_size;
  const int64_t wire = wire_bytes >= 0 ? wire_bytes : ring_wire_bytes(op, bytes, size_);
  *wire_family_ += wire;
  std::lock_guard<std::mutex> lock(tally_mutex_);
  Tally& entry = tally_[op];
  entry.count += 1;
  entry.elements += elements;
  entry.bytes += bytes;
  entry.wire_bytes += wire;
}

void Communicator::note_collective(const std::string& op_and_args, Work& work) {
  if (!progress_) return;
  const int64_t index = ++progress_->issued;
  {
    std::lock_guard<std::mutex> lock(progress_->mutex);
    progress_->last_op = op_and_args;
  }
  work.set_timeout_diagnosis([state = progress_, index] { return state->diagnose(index); });
}

namespace {

bool checks_collectives() {
  const char* value = std::getenv("DTRAIN_CHECK_COLLECTIVES");
  return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
}

uint64_t fnv1a(const std::string& text) {
  uint64_t hash = 1469598103934665603ULL;
  for (unsigned char c : text) hash = (hash ^ c) * 1099511628211ULL;
  return hash;
}

}  // namespace

Communicator::Communicator(int rank, int size, std::string name, std::vector<int> global_ranks,
                           Milliseconds timeout)
    : rank_(rank),
      size_(size),
      name_(std::move(name)),
      global_ranks_(std::move(global_ranks)),
      timeout_(timeout),
      check_collectives_(checks_collectives()) {
  DTRAIN_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "invalid rank ", rank_, " of ", size_);
  DTRAIN_CHECK_EQ(static_cast<int>(global_ranks_.size()), size_, "group '", name_, "'");
}

Communicator::~Communicator() {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (op_thread_.joinable()) op_thread_.join();
}

Milliseconds Communicator::resolve(Milliseconds timeout) const {
  return timeout.count() > 0 ? timeout : timeout_;
}

std::string Communicator::describe(const std::string& op_and_args) const {
  std::string ranks;
  for (size_t i = 0; i < global_ranks_.size(); ++i) {
    ranks += (i ? "," : "") + std::to_string(global_ranks_[i]);
  }
  return concat(op_and_args, " on group '", name_, "' (world ranks [", ranks, "]) at rank ", rank_,
                " (world rank ", global_ranks_[rank_], ")");
}

WorkPtr Communicator::run_async(std::string description, Milliseconds timeout,
                                std::function<void()> body) {
  auto work = std::make_shared<PromiseWork>(std::move(description), timeout);
  note_collective(work->description().substr(0, work->description().find(" on group '")), *work);
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    DTRAIN_CHECK(!stopping_, "communicator '", name_, "' is shutting down");
    if (!op_thread_.joinable()) op_thread_ = std::thread([this] { op_thread_main(); });
    queue_.emplace_back([work, body = std::move(body)] {
      try {
        body();
        work->finish();
      } catch (...) {
        work->finish(std::current_exception());
      }
    });
  }
  queue_cv_.notify_one();
  return work;
}

void Communicator::op_thread_main() {
  // Communication moves values; it is never part of an autograd graph (and grad mode is
  // per thread: a caller's no-grad views must stay writable here).
  at::NoGradGuard no_grad;
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(queue_mutex_);
      queue_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

namespace {

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) offsets[i + 1] = offsets[i] + counts[i];
  return offsets;
}

std::vector<int64_t> even_counts(int64_t numel, int parts) {
  std::vector<int64_t> counts(parts, numel / parts);
  for (int64_t i = 0; i < numel % parts; ++i) counts[i] += 1;
  return counts;
}

at::ScalarType accumulation_type(at::ScalarType type) {
  return (type == at::kBFloat16 || type == at::kHalf) ? at::kFloat : type;
}

void accumulate(at::Tensor& into, const at::Tensor& incoming, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      into.add_(incoming);
      break;
    case ReduceOp::Max:
      at::maximum_out(into, into, incoming);
      break;
    case ReduceOp::Min:
      at::minimum_out(into, into, incoming);
      break;
  }
}

}  // namespace

void Communicator::exchange(const at::Tensor& send_buf, const at::Tensor& recv_buf,
                            int64_t sequence, int step, Milliseconds timeout,
                            const std::string& what) {
  const int right = (rank_ + 1) % size_;
  const int left = (rank_ - 1 + size_) % size_;
  const int64_t span = INT_MAX - kMaxUserTag;
  const int tag = kMaxUserTag + static_cast<int>((sequence * 2 * size_ + step) % span);
  auto fail = [&](const char* direction, int peer, const std::exception& e) {
    DTRAIN_THROW(CommError, describe(what), ": step ", step, " ", direction, " rank ", peer,
                 " (world rank ", global_ranks_[peer], ") failed: ", e.what());
  };
  WorkPtr receive, transmit;
  try {
    if (recv_buf.defined() && recv_buf.numel() > 0) {
      receive = recv_tagged(recv_buf, left, tag, timeout);
    }
  } catch (const std::exception& e) {
    fail("receiving from", left, e);
  }
  try {
    if (send_buf.defined() && send_buf.numel() > 0) {
      transmit = send_tagged(send_buf, right, tag, timeout);
      count_sent(send_buf.numel() * send_buf.element_size());
    }
  } catch (const std::exception& e) {
    fail("sending to", right, e);
  }
  try {
    if (receive) receive->wait(timeout);
  } catch (const std::exception& e) {
    fail("receiving from", left, e);
  }
  try {
    if (transmit) transmit->wait(timeout);
  } catch (const std::exception& e) {
    fail("sending to", right, e);
  }
}

void Communicator::ring_reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                       const std::vector<int64_t>& counts, ReduceOp op,
                                       int64_t sequence, Milliseconds timeout,
                                       const std::string& what, bool input_is_scratch) {
  const auto offsets = offsets_of(counts);
  auto chunk = [&](const at::Tensor& flat, int index) {
    return flat.narrow(0, offsets[index], counts[index]);
  };
  const auto wire_type = input.scalar_type();
  const bool in_place =
      input_is_scratch && input.is_contiguous() && accumulation_type(wire_type) == wire_type;
  at::Tensor acc = in_place ? input.view({-1})
                            : input.reshape({-1}).to(accumulation_type(wire_type),
                                                     /*non_blocking=*/false, /*copy=*/true);
  for (int step = 0; step < size_ - 1; ++step) {
    const int send_index = ((rank_ - step - 1) % size_ + size_) % size_;
    const int recv_index = ((rank_ - step - 2) % size_ + size_) % size_;
    at::Tensor send_buf = chunk(acc, send_index).to(wire_type).contiguous();
    at::Tensor recv_buf = at::empty({counts[recv_index]}, input.options());
    exchange(send_buf, recv_buf, sequence, step, timeout, what);
    at::Tensor target = chunk(acc, recv_index);
    accumulate(target, recv_buf.to(acc.scalar_type()), op);
  }
  at::Tensor mine = chunk(acc, rank_);
  if (op == ReduceOp::Avg) mine.div_(size_);
  output.reshape({-1}).copy_(mine);
}

void Communicator::ring_allgather(const at::Tensor& output, const at::Tensor& input,
                                  const std::vector<int64_t>& counts, int64_t sequence,
                                  Milliseconds timeout, const std::string& what, int step_base) {
  const auto offsets = offsets_of(counts);
  at::Tensor flat = output.is_contiguous() ? output.view({-1}) : output.reshape({-1}).clone();
  auto chunk = [&](int index) { return flat.narrow(0, offsets[index], counts[index]); };
  chunk(rank_).copy_(input.reshape({-1}));
  for (int step = 0; step < size_ - 1; ++step) {
    const int send_index = ((rank_ - step) % size_ + size_) % size_;
    const int recv_index = ((rank_ - step - 1) % size_ + size_) % size_;
    exchange(chunk(send_index), chunk(recv_index), sequence, step_base + step, timeout, what);
  }
  if (!output.is_contiguous()) output.copy_(flat.view(output.sizes()));
}

void Communicator::check_gather(const at::Tensor& output, const at::Tensor& input,
                                std::vector<int64_t> counts, const std::string& label) {
  const int64_t sequence = next_sequence();
  run_async(describe(label), timeout_, [=, this] {
    ring_allgather(output, input, counts, sequence, timeout_, label);
  })->wait();
}

void Communicator::check_matching(const std::string& what) {
  if (!check_collectives_ || size_ <= 1) return;
  const int64_t index = checked_++;
  const std::string label = concat("the collective check before ", what);
  auto gather = [&](const at::Tensor& out, const at::Tensor& in, std::vector<int64_t> counts) {
    check_gather(out, in, std::move(counts), label);
  };
  const at::Tensor mine = at::tensor({index, static_cast<int64_t>(fnv1a(what))}, at::kLong);
  const at::Tensor all = at::empty({2 * size_}, at::kLong);
  gather(all, mine, std::vector<int64_t>(size_, 2));
  const int64_t* seen = all.data_ptr<int64_t>();
  bool same = true;
  for (int r = 1; r < size_; ++r)
    same = same && seen[2 * r] == seen[0] && seen[2 * r + 1] == seen[1];
  if (same) return;
  // Every member saw the difference: they tell each other what they call.
  const at::Tensor length = at::tensor({static_cast<int64_t>(what.size())}, at::kLong);
  const at::Tensor lengths = at::empty({size_}, at::kLong);
  gather(lengths, length, std::vector<int64_t>(size_, 1));
  const std::vector<int64_t> counts(lengths.data_ptr<int64_t>(),
                                    lengths.data_ptr<int64_t>() + size_);
  at::Tensor text = at::empty({static_cast<int64_t>(what.size())}, at::kByte);
  std::memcpy(text.data_ptr(), what.data(), what.size());
  const at::Tensor texts = at::empty({offsets_of(counts).back()}, at::kByte);
  gather(texts, text, counts);
  // Ranks calling the same thing together: "ranks 0, 2 call X; rank 1 calls Y".
  std::vector<std::pair<std::string, std::vector<int>>> calls;
  const auto* bytes = reinterpret_cast<const char*>(texts.data_ptr());
  int64_t offset = 0;
  for (int r = 0; r < size_; ++r) {
    const std::string call(bytes + offset, static_cast<size_t>(counts[r]));
    offset += counts[r];
    auto it =
        std::find_if(calls.begin(), calls.end(), [&](const auto& c) { return c.first == call; });
    if (it == calls.end()) {
      calls.push_back({call, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::string differ;
  for (const auto& [call, ranks] : calls) {
    std::string who;
    for (size_t i = 0; i < ranks.size(); ++i) who += concat(i ? ", " : "", ranks[i]);
    differ += concat(differ.empty() ? "" : "; ", ranks.size() > 1 ? "ranks " : "rank ", who,
                     ranks.size() > 1 ? " call " : " calls ", call);
  }
  DTRAIN_THROW(CommError, "collectives differ on group '", name_, "' at its collective #", index,
               " (DTRAIN_CHECK_COLLECTIVES): ", differ);
}

WorkPtr Communicator::allgather(at::Tensor output, at::Tensor input,
                                const AllgatherOptions& options) {
  std::vector<int64_t> counts = options.counts;
  if (counts.empty()) counts.assign(size_, input.numel());
  const std::string what = concat("allgather(", shape_string(input), ")");
  DTRAIN_CHECK(static_cast<int>(counts.size()) == size_, describe(what), ": counts has ",
               counts.size(), " entries for ", size_, " ranks");
  DTRAIN_CHECK(input.numel() == counts[rank_], describe(what), ": input has ", input.numel(),
               " elements but counts[", rank_, "] = ", counts[rank_]);
  DTRAIN_CHECK(output.numel() == offsets_of(counts).back(), describe(what), ": output has ",
               output.numel(), " elements, expected ", offsets_of(counts).back());
  DTRAIN_CHECK(output.scalar_type() == input.scalar_type(), describe(what), ": output dtype ",
               output.scalar_type(), " != input dtype ", input.scalar_type());
  const auto timeout = resolve(options.timeout);
  check_matching(what);
  if (size_ > 1) count_collective("allgather", output.numel(), output.element_size());
  const int64_t sequence = next_sequence();
  return run_async(describe(what), timeout,
                   [=] { ring_allgather(output, input, counts, sequence, timeout, what); });
}

WorkPtr Communicator::reduce_scatter(at::Tensor output, at::Tensor input,
                                     const ReduceScatterOptions& options) {
  const std::string what =
      concat("reduce_scatter(", to_string(options.op), ", ", shape_string(input), ")");
  std::vector<int64_t> counts = options.counts;
  if (counts.empty()) {
    DTRAIN_CHECK(input.numel() % size_ == 0, describe(what), ": input of ", input.numel(),
                 " elements does not split evenly over ", size_,
                 " ranks; pass options.counts for uneven shares");
    counts.assign(size_, input.numel() / size_);
  }
  DTRAIN_CHECK(static_cast<int>(counts.size()) == size_, describe(what), ": counts has ",
               counts.size(), " entries for ", size_, " ranks");
  DTRAIN_CHECK(input.numel() == offsets_of(counts).back(), describe(what), ": input has ",
               input.numel(), " elements but counts add up to ", offsets_of(counts).back());
  DTRAIN_CHECK(output.numel() == counts[rank_], describe(what), ": output has ", output.numel(),
               " elements, expected counts[", rank_, "] = ", counts[rank_]);
  DTRAIN_CHECK(output.scalar_type() == input.scalar_type(), describe(what), ": output dtype ",
               output.scalar_type(), " != input dtype ", input.scalar_type());
  DTRAIN_CHECK(options.op != ReduceOp::Avg || at::isFloatingType(input.scalar_type()),
               describe(what), ": avg needs a floating-point tensor");
  const auto timeout = resolve(options.timeout);
  check_matching(what);
  if (size_ > 1) count_collective("reduce_scatter", input.numel(), input.element_size());
  const int64_t sequence = next_sequence();
  return run_async(describe(what), timeout, [=] {
    ring_reduce_scatter(output, input, counts, options.op, sequence, timeout, what,
                        options.input_is_scratch);
  });
}

WorkPtr Communicator::ring_allreduce(at::Tensor tensor, ReduceOp op, Milliseconds timeout,
                                     const std::string& what) {
  const int64_t sequence = next_sequence();
  return run_async(describe(what), timeout, [=] {
    at::Tensor flat = tensor.is_contiguous() ? tensor.view({-1}) : tensor.reshape({-1}).clone();
    const auto counts = even_counts(flat.numel(), size_);
    at::Tensor mine = at::empty({counts[rank_]}, flat.options());
    ring_reduce_scatter(mine, flat, counts, op, sequence, timeout, what);
    ring_allgather(flat, mine, counts, sequence, timeout, what + " [allgather phase]",
                   /*step_base=*/size_);
    if (!tensor.is_contiguous()) tensor.copy_(flat.view(tensor.sizes()));
  });
}

Communicator::AllToAllCounts Communicator::prepare_all_to_all(const at::Tensor& output,
                                                              const at::Tensor& input,
                                                              const AllToAllOptions& options,
                                                              const std::string& what) {
  auto resolve_counts = [&](std::vector<int64_t> counts, const at::Tensor& t, const char* side) {
    if (counts.empty()) {
      DTRAIN_CHECK(t.numel() % size_ == 0, describe(what), ": ", side, " of ", t.numel(),
                   " elements does not split evenly over ", size_, " ranks; pass options.", side,
                   "_counts");
      counts.assign(size_, t.numel() / size_);
    }
    DTRAIN_CHECK(static_cast<int>(counts.size()) == size_, describe(what), ": ", side,
                 "_counts has ", counts.size(), " entries for ", size_, " ranks");
    for (int64_t c : counts) {
      DTRAIN_CHECK(c >= 0, describe(what), ": ", side, "_counts holds ", c);
    }
    DTRAIN_CHECK(t.numel() == offsets_of(counts).back(), describe(what), ": ", side, " has ",
                 t.numel(), " elements but ", side, "_counts add up to ",
                 offsets_of(counts).back());
    return counts;
  };
  AllToAllCounts counts{resolve_counts(options.send_counts, input, "send"),
                        resolve_counts(options.recv_counts, output, "recv")};
  DTRAIN_CHECK(output.scalar_type() == input.scalar_type(), describe(what), ": output dtype ",
               output.scalar_type(), " != input dtype ", input.scalar_type());
  DTRAIN_CHECK(counts.send[rank_] == counts.recv[rank_], describe(what), ": sends ",
               counts.send[rank_], " elements to itself but receives ", counts.recv[rank_]);
  check_matching(what);
  if (check_collectives_ && size_ > 1) {
    // Every rank's sends and receives, so that all see any pair that disagrees (and all stop).
    std::vector<int64_t> both = counts.send;
    both.insert(both.end(), counts.recv.begin(), counts.recv.end());
    const at::Tensor mine = at::tensor(both, at::kLong);
    const at::Tensor all = at::empty({2 * size_ * size_}, at::kLong);
    check_gather(all, mine, std::vector<int64_t>(size_, 2 * size_),
                 concat("the collective check before ", what));
    const int64_t* seen = all.data_ptr<int64_t>();
    std::string differ;
    for (int from = 0; from < size_; ++from) {
      for (int to = 0; to < size_; ++to) {
        const int64_t sends = seen[from * 2 * size_ + to];
        const int64_t expects = seen[to * 2 * size_ + size_ + from];
        if (sends != expects) {
          differ += concat(differ.empty() ? "" : "; ", "rank ", from, " sends ", sends,
                           " elements, rank ", to, " expects ", expects);
        }
      }
    }
    DTRAIN_CHECK_T(CommError, differ.empty(), "all_to_all counts differ on group '", name_,
                   "' (DTRAIN_CHECK_COLLECTIVES): ", differ);
  }
  if (size_ > 1) {
    count_collective("all_to_all", input.numel(), input.element_size(),
                     (input.numel() - counts.send[rank_]) * input.element_size());
  }
  return counts;
}

WorkPtr Communicator::all_to_all(at::Tensor output, at::Tensor input,
                                 const AllToAllOptions& options) {
  const std::string what = concat("all_to_all(", input.scalar_type(), ")");
  const AllToAllCounts counts = prepare_all_to_all(output, input, options, what);
  const auto timeout = resolve(options.timeout);
  const int64_t sequence = next_sequence();
  // Detached: the op thread must never hold the last reference to an autograd graph.
  return run_async(
      describe(what), timeout, [=, input = input.detach(), output = output.detach(), this] {
        const at::Tensor in = input.reshape({-1}).contiguous();
        at::Tensor out = output.is_contiguous() ? output.view({-1})
                                                : at::empty({output.numel()}, output.options());
        const auto send_at = offsets_of(counts.send), recv_at = offsets_of(counts.recv);
        out.narrow(0, recv_at[rank_], counts.recv[rank_])
            .copy_(in.narrow(0, send_at[rank_], counts.send[rank_]));
        const int64_t span = INT_MAX - kMaxUserTag;
        const int tag = kMaxUserTag + static_cast<int>((sequence * 2 * size_) % span);
        // Every receive and send posted at once, the s-th peer up and down the ring in turn.
        std::vector<std::pair<WorkPtr, int>> receives, sends;
        auto fail = [&](const char* direction, int peer, const std::exception& e) {
          DTRAIN_THROW(CommError, describe(what), ": ", direction, " rank ", peer, " (world rank ",
                       global_ranks_[peer], ") failed: ", e.what());
        };
        for (int s = 1; s < size_; ++s) {
          const int from = (rank_ - s + size_) % size_, to = (rank_ + s) % size_;
          try {
            if (counts.recv[from] > 0) {
              receives.emplace_back(
                  recv_tagged(out.narrow(0, recv_at[from], counts.recv[from]), from, tag, timeout),
                  from);
            }
          } catch (const std::exception& e) {
            fail("receiving from", from, e);
          }
          try {
            if (counts.send[to] > 0) {
              sends.emplace_back(
                  send_tagged(in.narrow(0, send_at[to], counts.send[to]), to, tag, timeout), to);
              count_sent(counts.send[to] * in.element_size());
            }
          } catch (const std::exception& e) {
            fail("sending to", to, e);
          }
        }
        for (auto& [work, peer] : receives) {
          try {
            work->wait(timeout);
          } catch (const std::exception& e) {
            fail("receiving from", peer, e);
          }
        }
        for (auto& [work, peer] : sends) {
          try {
            work->wait(timeout);
          } catch (const std::exception& e) {
            fail("sending to", peer, e);
          }
        }
        if (!output.is_contiguous()) output.copy_(out.view(output.sizes()));
      });
}

WorkPtr Communicator::send(at::Tensor tensor, int dst, const P2POptions& options) {
  const std::string what =
      concat("send(", shape_string(tensor), " to rank ", dst, ", tag ", options.tag, ")");
  DTRAIN_CHECK(options.tag >= 0 && options.tag < kMaxUserTag, describe(what),
               ": tag must be in [0, ", kMaxUserTag, ")");
  DTRAIN_CHECK(dst >= 0 && dst < size_ && dst != rank_, describe(what), ": bad destination");
  DTRAIN_CHECK(tensor.is_contiguous(), describe(what), ": tensor must be contiguous");
  count_sent(tensor.numel() * tensor.element_size());
  *wire_family_ += tensor.numel() * tensor.element_size();
  return send_tagged(tensor, dst, options.tag, resolve(options.timeout));
}

WorkPtr Communicator::recv(at::Tensor tensor, int src, const P2POptions& options) {
  const std::string what =
      concat("recv(", shape_string(tensor), " from rank ", src, ", tag ", options.tag, ")");
  DTRAIN_CHECK(options.tag >= 0 && options.tag < kMaxUserTag, describe(what),
               ": tag must be in [0, ", kMaxUserTag, ")");
  DTRAIN_CHECK(src >= 0 && src < size_ && src != rank_, describe(what), ": bad source");
  DTRAIN_CHECK(tensor.is_contiguous(), describe(what), ": tensor must be contiguous");
  return recv_tagged(tensor, src, options.tag, resolve(options.timeout));
}

CommunicatorPtr Communicator::regroup(const std::vector<int>& world_ranks, const std::string& key,
                                      const std::string& name) {
  DTRAIN_THROW(CommError, "backend ", backend_name(), " cannot regroup ranks without the others ('",
               name, "', ", world_ranks.size(), " ranks under '", key,
               "'): fault tolerance needs the gloo backend");
}

CommunicatorPtr Communicator::split(int color, int key, const std::string& name) {
  at::Tensor mine = at::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)}, at::kLong);
  at::Tensor all = at::empty({2 * size_}, at::kLong);
  allgather(all, mine)->wait();
  std::map<int64_t, std::vector<std::pair<int64_t, int>>> members;  // color -> (key, rank)
  for (int r = 0; r < size_; ++r) {
    const int64_t c = all[2 * r].item<int64_t>();
    if (c >= 0) members[c].emplace_back(all[2 * r + 1].item<int64_t>(), r);
  }
  CommunicatorPtr result;
  for (auto& [c, entries] : members) {  // same order on every rank
    std::sort(entries.begin(), entries.end());
    std::vector<int> ranks;
    for (const auto& entry : entries) ranks.push_back(entry.second);
    auto group = new_group(ranks, concat(name, c));
    if (c == color) result = group;
  }
  return result;
}

namespace {
thread_local std::vector<std::pair<const Communicator*, CommunicatorPtr>> g_lanes;
}  // namespace

LaneScope::LaneScope(std::vector<std::pair<const Communicator*, CommunicatorPtr>> substitutes)
    : saved_(std::move(g_lanes)) {
  g_lanes = std::move(substitutes);
}

LaneScope::~LaneScope() { g_lanes = std::move(saved_); }

const CommunicatorPtr& on_lane(const CommunicatorPtr& group) {
  for (const auto& [from, to] : g_lanes) {
    if (from == group.get()) return to;
  }
  return group;
}

}  // namespace dtrain::comm
