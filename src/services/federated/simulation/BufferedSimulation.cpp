// `fl simulate --buffer-size K`: FedBuff on the virtual clock. At most C clients train at once,
// each from the model version current when it started; a client's completion is an event at
// start + its device's time for the plan (or it leaves earlier: a dropout, its availability
// window closing). Events are taken in simulated-time order (ties by client number), so the run
// is deterministic however the pool's threads interleave; the training itself runs ahead on the
// pool as soon as a client starts.
#include <torch/torch.h>

#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "dtrain/common/Error.h"
#include "services/federated/simulation/SimulatedClients.h"

namespace dtrain::services::federated {

namespace {

// Threads that each own one model replica and run the clients' local training.
class TrainingPool {
 public:
  explicit TrainingPool(std::vector<Model>& replicas) : replicas_(replicas) {
    for (size_t t = 0; t < replicas.size(); ++t) {
      threads_.emplace_back([this, t] { loop(static_cast<int>(t)); });
    }
  }
  ~TrainingPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      queue_.clear();  // not started: abandoned (their futures are never read)
    }
    ready_.notify_all();
    for (auto& t : threads_) t.join();
  }
  std::shared_future<ClientResult> run(std::function<ClientResult(Model&)> job) {
    auto task = std::make_shared<std::packaged_task<ClientResult(Model&)>>(std::move(job));
    std::shared_future<ClientResult> result = task->get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back([task](Model& replica) { (*task)(replica); });
    }
    ready_.notify_one();
    return result;
  }

 private:
  void loop(int t) {
    at::set_num_threads(1);
    for (;;) {
      std::function<void(Model&)> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job(replicas_[static_cast<size_t>(t)]);
    }
  }
  std::vector<Model>& replicas_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void(Model&)>> queue_;
  bool stop_ = false;
};

// A client on its way: when it is done (or leaves) and what it will hand in; what it started
// from, for a checkpoint (a resumed run trains it again from there).
struct Flight {
  bool finishes = false;
  std::shared_future<ClientResult> result;
  int64_t version = 0;
  uint64_t seed = 0;
  double clip = 0.0;
  at::Tensor global;
  // Its error-feedback residual when it started (its training, run ahead, may have replaced
  // the stored one already).
  at::Tensor residual;
};

using Events = std::map<std::pair<double, int64_t>, Flight>;  // (time, client) -> its flight

// What a checkpoint keeps of a buffered run besides the server: the clients' state (with the
// residuals of those in flight as they started) and the flights, with the models they left
// from ("flight/..."), so that a resumed run goes on as an uninterrupted one does.
std::map<std::string, at::Tensor> buffered_state(SimulatedClients& clients, const Events& events) {
  std::map<std::string, at::Tensor> state = client_state(clients);
  const auto n = static_cast<int64_t>(events.size());
  at::Tensor ends = at::empty({n}, at::kDouble), clips = at::empty({n}, at::kDouble);
  at::Tensor ints = at::empty({n, 4}, at::kLong);
  int64_t i = 0;
  for (const auto& [key, flight] : events) {
    ends[i] = key.first;
    clips[i] = flight.clip;
    ints[i][0] = key.second;
    ints[i][1] = flight.finishes ? 1 : 0;
    ints[i][2] = flight.version;
    ints[i][3] = static_cast<int64_t>(flight.seed);
    ++i;
    if (!flight.finishes) continue;
    state["flight/global/" + std::to_string(flight.version)] = flight.global;
    const std::string residual = "residual/" + std::to_string(key.second);
    if (flight.residual.defined()) {
      state[residual] = flight.residual;
    } else {
      state.erase(residual);
    }
  }
  state["flight/ends"] = ends;
  state["flight/clips"] = clips;
  state["flight/ints"] = ints;
  return state;
}

}  // namespace

namespace {

using TrainAhead =
    std::function<std::shared_future<ClientResult>(int64_t, const Flight&, const LocalTraining&)>;

/// A resumed run: the clients that were training when it was saved go on from the models they
/// started from (a checkpoint without them, from an older dtrain: they leave), as `events`.
void resume_flights(SimulatedClients& clients, Events& events, const TrainAhead& train_ahead,
                    const std::function<at::Tensor(int64_t)>& residual_now) {
  const SimulationOptions& options = clients.options;
  RoundServer& server = clients.server;
  const std::string saved = options.checkpoint_dir + "/server.pt";
  const auto& extra = server.loaded_extra();
  const auto training = server.training_steps();
  if (!training.empty() && extra.count("flight/ints") == 0) {
    for (const auto& entry : training) server.leave(entry.first);
  } else if (!training.empty()) {
    const at::Tensor ints = extra.at("flight/ints"), ends = extra.at("flight/ends"),
                     clips = extra.at("flight/clips");
    const int64_t n = ints.size(0);
    DTRAIN_CHECK_INPUT(ints.dim() == 2 && ints.size(1) == 4 && ends.numel() == n &&
                           clips.numel() == n && n == static_cast<int64_t>(training.size()),
                       saved, ": its ", n, " clients in flight do not match the server's ",
                       training.size(), " training ones");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = ints[i][0].item<int64_t>();
      Flight flight;
      flight.finishes = ints[i][1].item<int64_t>() != 0;
      flight.version = ints[i][2].item<int64_t>();
      flight.seed = static_cast<uint64_t>(ints[i][3].item<int64_t>());
      flight.clip = clips[i].item<double>();
      DTRAIN_CHECK_INPUT(c >= 0 && c < options.clients, saved, ": client ", c,
                         " is in flight, and this run has ", options.clients, " clients");
      DTRAIN_CHECK_INPUT(training.count(std::to_string(c)) == 1, saved, ": client ", c,
                         " is in flight but not training at the server");
      if (flight.finishes) {
        const std::string global = "flight/global/" + std::to_string(flight.version);
        DTRAIN_CHECK_INPUT(extra.count(global) == 1 && extra.at(global).numel() == clients.numel,
                           saved, ": no model version ", flight.version, " for client ", c);
        flight.global = extra.at(global);
        flight.residual = residual_now(c);
        flight.result = train_ahead(c, flight, server.plan_at(flight.version));
      }
      events.emplace(std::make_pair(ends[i].item<double>(), c), std::move(flight));
    }
  }
}

/// What a buffered step's record sums over its clients.
struct StepSums {
  int64_t uplink = 0, server_ns = 0, encoding_ns = 0, training_ns = 0, trained = 0, started = 0,
          attackers = 0, diverged = 0;
};

/// The buffer is full: the server applies it; the step's record (its sums start again).
RoundRecord close_step(SimulatedClients& clients, StepSums& sums, int64_t download, double now) {
  const SimulationOptions& options = clients.options;
  RoundServer& server = clients.server;
  RoundRecord record;
  if (options.byzantine.enabled()) record.faulty = sums.attackers;
  const auto closing = std::chrono::steady_clock::now();
  record.outcome = server.close();
  record.server_aggregation_s =
      static_cast<double>(sums.server_ns + nanoseconds_since(closing)) * 1e-9;
  record.client_aggregation_s =
      static_cast<double>(sums.encoding_ns) * 1e-9 / static_cast<double>(record.outcome.finished);
  record.client_training_s = static_cast<double>(sums.training_ns) * 1e-9 /
                             static_cast<double>(std::max<int64_t>(1, sums.trained));
  record.uplink_bytes = sums.uplink;
  record.downlink_bytes = sums.started * download;
  record.sim_minutes = now;
  server.set_clock(now);
  if (sums.diverged > 0) {
    std::fprintf(stderr,
                 "step %lld: the local training of %lld client(s) diverged (NaN/Inf); they "
                 "left (a smaller --lr?)\n",
                 static_cast<long long>(server.round()), static_cast<long long>(sums.diverged));
  }
  sums = StepSums{};
  return record;
}

}  // namespace

void simulate_buffered(SimulatedClients& clients, std::vector<Model>& replicas, Model& global_model,
                       const data::TensorDataset& test, RoundLog& log, SimulationResult& result) {
  const SimulationOptions& options = clients.options;
  RoundServer& server = clients.server;
  const BufferSpec& buffer = options.round.buffer;
  DTRAIN_CHECK_INPUT(buffer.size <= options.clients, "--buffer-size ", buffer.size,
                     " is more than the ", options.clients,
                     " clients: a buffer takes one update per client");
  const int64_t concurrency = std::min(buffer.clients_at_once(), options.clients);
  double now = server.clock();
  // Who starts next: drawn anew from the step's number at every step, so a resumed run draws
  // as an uninterrupted one.
  std::mt19937_64 pick;
  const auto draw_for_step = [&] {
    pick.seed(mix(options.round.seed, 0xB0FFE2ULL, static_cast<uint64_t>(server.round())));
  };
  draw_for_step();
  std::uniform_int_distribution<int64_t> any(0, options.clients - 1);
  Events events;
  std::map<int64_t, std::pair<int64_t, uint64_t>> starts;  // client -> (version, starts there)
  TrainingPool pool(replicas);
  const auto train_ahead = [&](int64_t c, const Flight& flight, const LocalTraining& plan) {
    ClientWork job;
    job.client = c;
    job.version = flight.version;
    job.seed = flight.seed;
    job.global = flight.global;
    job.plan = plan;
    job.clip = flight.clip;
    return pool.run([&clients, job](Model& replica) { return run_client(clients, replica, job); });
  };
  // A client's error-feedback residual now (top-k keeps one; undefined if it has none yet).
  const auto residual_now = [&](int64_t c) {
    at::Tensor residual;
    if (options.compression.kind != comm::CompressionSpec::TopK) return residual;
    std::lock_guard<std::mutex> lock(clients.memory_mutex);
    const auto it = clients.residuals.find(c);
    if (it != clients.residuals.end()) residual = it->second;
    return residual;
  };
  resume_flights(clients, events, train_ahead, residual_now);
  // What a step's record sums.
  StepSums sums;
  int64_t version = -1;
  at::Tensor global;
  LocalTraining plan;
  double clip = 0.0;
  int64_t download = 0;

  // Starts one client available now (not training, not in this step's buffer); false if none.
  const auto start_one = [&]() -> bool {
    if (version != server.round()) {
      version = server.round();
      global = server.global();
      plan = server.plan();
      clip = server.dp_clip();
      download = download_bytes(global);
    }
    const auto usable = [&](int64_t c) {
      return options.availability.available(c, now, options.round.seed) &&
             server.start(std::to_string(c)).empty();
    };
    int64_t chosen = -1;
    for (int tries = 0; tries < 64 && chosen < 0; ++tries) {
      const int64_t c = any(pick);
      if (usable(c)) chosen = c;
    }
    for (int64_t i = 0, from = any(pick); chosen < 0 && i < options.clients; ++i) {
      const int64_t c = (from + i) % options.clients;  // few usable: look at every client
      if (usable(c)) chosen = c;
    }
    if (chosen < 0) return false;
    const int64_t c = chosen;
    auto& [at_version, repeats] = starts[c];
    if (at_version != version) {
      at_version = version;
      repeats = 0;
    }
    const uint64_t seed =
        mix(options.round.seed, static_cast<uint64_t>(version) * 2, static_cast<uint64_t>(c)) +
        repeats++ * 0x9E3779B97F4A7C15ULL;
    std::mt19937_64 draw(mix(options.round.seed ^ 0xD20F0ULL, seed, static_cast<uint64_t>(c)));
    const int64_t examples = static_cast<int64_t>(clients.population.client(c).train.size());
    const double needs = options.speed.minutes(c, local_steps(plan, examples), options.round.seed);
    Flight flight;
    double ends = now + needs;
    flight.finishes = true;
    if (options.dropout > 0 &&
        std::uniform_real_distribution<double>(0, 1)(draw) < options.dropout) {
      ends = now + std::uniform_real_distribution<double>(0, 1)(draw) * needs;
      flight.finishes = false;
    }
    const double left = options.availability.minutes_left(c, now, options.round.seed);
    if (left < ends - now) {
      ends = now + left;
      flight.finishes = false;
    }
    flight.version = version;
    flight.seed = seed;
    flight.clip = clip;
    if (flight.finishes) {
      flight.global = global;
      flight.residual = residual_now(c);
      flight.result = train_ahead(c, flight, plan);
    }
    ++sums.started;
    events.emplace(std::make_pair(ends, c), std::move(flight));
    return true;
  };

  int idle = 0;
  auto step_start = std::chrono::steady_clock::now();
  while (server.round() < options.rounds) {
    while (server.training() < concurrency && start_one()) {
    }
    if (events.empty()) {
      // Nobody can start now (all unavailable): the clock moves on.
      DTRAIN_CHECK_INPUT(++idle < 100000, "--buffer-size: no client became available in ", idle,
                         " tries (check --availability)");
      now += options.availability.round_minutes;
      continue;
    }
    idle = 0;
    auto first = events.begin();
    const auto [when, c] = first->first;
    Flight flight = std::move(first->second);
    events.erase(first);
    now = when;
    const std::string id = std::to_string(c);
    if (!flight.finishes) {
      server.leave(id);
      continue;
    }
    const ClientResult& done = flight.result.get();
    sums.training_ns += done.training_ns;
    ++sums.trained;
    if (done.attacked) ++sums.attackers;
    if (done.diverged) {
      ++sums.diverged;
      server.leave(id);
      continue;
    }
    sums.encoding_ns += done.encoding_ns;
    sums.uplink += deliver(clients, done, id, &sums.server_ns);
    if (!server.buffer_full()) continue;
    RoundRecord record = close_step(clients, sums, download, now);
    record.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
    step_start = std::chrono::steady_clock::now();
    if (finish_round(options, server, global_model, test, log, record, result, 1,
                     [&] { return buffered_state(clients, events); })) {
      break;
    }
    draw_for_step();
  }
}

}  // namespace dtrain::services::federated
