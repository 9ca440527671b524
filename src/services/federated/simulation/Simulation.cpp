#include "dtrain/services/federated/simulation/Simulation.h"

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "dtrain/common/Error.h"
#include "dtrain/common/Printed.h"
#include "dtrain/train/Metrics.h"
#include "dtrain/train/Progress.h"
#include "services/federated/RoundLog.h"
#include "services/federated/secagg/SecureRound.h"
#include "services/federated/simulation/SimulatedClients.h"

namespace dtrain::services::federated {

std::pair<double, double> evaluate_model(Model& model, const data::TensorDataset& data,
                                         int64_t batch) {
  torch::NoGradGuard no_grad;
  model.module->eval();
  double loss = 0, correct = 0;
  for (int64_t begin = 0; begin < data.size(); begin += batch) {
    const data::Batch b = data.slice(begin, std::min(data.size(), begin + batch));
    const at::Tensor out = model(b.inputs);
    loss += parallel::cross_entropy(out, b.targets).item<double>() * b.targets.size(0);
    correct += out.argmax(-1).eq(b.targets).sum().item<double>();
  }
  model.module->train();
  const auto n = static_cast<double>(std::max<int64_t>(1, data.size()));
  return {loss / n, correct / n};
}

namespace {

// The dropout rate --secagg-graph auto sizes SecAgg+'s degree for.
double secagg_dropout(const SimulationOptions& options) {
  return options.secagg_dropout >= 0 ? options.secagg_dropout : options.dropout;
}

Model build(const models::ModelSpec& spec, at::ScalarType dtype) {
  Model model = models::make_model(spec);
  if (dtype == at::kDouble) model.module->to(at::kDouble);
  return model;
}

}  // namespace

AvailabilityTrace parse_availability_trace(const std::string& text) {
  AvailabilityTrace trace;
  if (text == "always") return trace;
  if (text.rfind("diurnal:", 0) == 0) {
    const std::string number = text.substr(8);
    char* end = nullptr;
    const double hours = std::strtod(number.c_str(), &end);
    DTRAIN_CHECK_INPUT(!number.empty() && *end == '\0' && hours > 0 && hours <= 24,
                       "--availability '", text, "': diurnal takes hours a day in (0, 24]");
    trace.kind = AvailabilityTrace::Diurnal;
    trace.hours = hours;
    return trace;
  }
  DTRAIN_THROW(InputError, "--availability '", text, "': expected always or diurnal:HOURS");
}

namespace {
// The client's local time of day in minutes: its time zone is a fixed offset hashed from
// (seed, client).
double local_minute(int64_t client, double minute, uint64_t seed) {
  return std::fmod(minute + hashed_uniform(seed, 0xA11CE5ULL, client) * 1440.0, 1440.0);
}
}  // namespace

bool AvailabilityTrace::available(int64_t client, double minute, uint64_t seed) const {
  return kind == Always || local_minute(client, minute, seed) < hours * 60;
}

double AvailabilityTrace::minutes_left(int64_t client, double minute, uint64_t seed) const {
  if (kind == Always) return std::numeric_limits<double>::infinity();
  return std::max(0.0, hours * 60 - local_minute(client, minute, seed));
}

namespace {

// Synchronous rounds: K selected among the available, trained on the pool's threads; a round
// takes --round-minutes of simulated time, or on the virtual clock until its slowest selected
// client is done or has left (at most --round-deadline).
/// Who of the selected clients takes part in the round: a dropout or an availability window
/// that closes first leaves it (on the virtual clock at the moment it leaves), as does a client
/// the deadline would pass. `round_end`: on the virtual clock, when the last one is done.
std::vector<char> who_takes_part(SimulatedClients& clients,
                                 const std::vector<std::string>& selected,
                                 const LocalTraining& round_plan, int64_t round, uint64_t attempt,
                                 double minute, double& round_end) {
  const SimulationOptions& options = clients.options;
  const bool clock = options.speed.enabled();
  std::vector<char> takes_part(selected.size(), 1);
  for (size_t i = 0; i < selected.size(); ++i) {
    const int64_t c = std::stoll(selected[i]);
    // A retried round draws its dropouts anew.
    std::mt19937_64 draw(mix(options.round.seed + attempt * 0x9E3779B97F4A7C15ULL,
                             static_cast<uint64_t>(round) * 2 + 1, static_cast<uint64_t>(c)));
    const bool drops =
        options.dropout > 0 && std::uniform_real_distribution<double>(0, 1)(draw) < options.dropout;
    if (!clock) {
      takes_part[i] =
          !drops && options.availability.available(c, minute + options.availability.round_minutes,
                                                   options.round.seed);
      continue;
    }
    const int64_t examples = static_cast<int64_t>(clients.population.client(c).train.size());
    const double needs =
        options.speed.minutes(c, local_steps(round_plan, examples), options.round.seed);
    double ends = minute + needs;
    if (drops) {
      ends = minute + std::uniform_real_distribution<double>(0, 1)(draw) * needs;
      takes_part[i] = 0;
    }
    const double left = options.availability.minutes_left(c, minute, options.round.seed);
    if (left < ends - minute) {
      ends = minute + left;
      takes_part[i] = 0;
    }
    if (options.round_deadline > 0 && ends - minute > options.round_deadline) {
      ends = minute + options.round_deadline;
      takes_part[i] = 0;
    }
    round_end = std::max(round_end, ends);
  }
  return takes_part;
}

/// Secure aggregation's round: keys and shares before anyone trains (`degree_out`: SecAgg+'s
/// graph degree, 0 for the full graph).
std::unique_ptr<SecureRound> secure_round(SimulatedClients& clients,
                                          const std::vector<std::string>& selected, int64_t round,
                                          uint64_t attempt, int& degree_out) {
  const SimulationOptions& options = clients.options;
  const int64_t numel = clients.numel;
  std::vector<int64_t> examples;
  for (const auto& id : selected) {
    examples.push_back(
        static_cast<int64_t>(clients.population.client(std::stoll(id)).train.size()));
  }
  const auto k = static_cast<int>(selected.size());
  // SecAgg+: a round smaller than the degree needs (fewer available) uses the full graph.
  const int degree = options.secagg_graph > 0 && options.secagg_graph >= k - 1
                         ? 0
                         : secagg::round_degree(options.secagg_graph, k, options.secagg_threshold,
                                                secagg_dropout(options));
  degree_out = degree;
  const int threshold =
      secagg::secagg_threshold(options.secagg_threshold, degree > 0 ? degree + 1 : k);
  // With differential privacy every client counts once.
  if (options.round.dp.enabled()) std::fill(examples.begin(), examples.end(), 1);
  return std::make_unique<SecureRound>(
      selected, examples, numel, threshold, options.secagg_frac_bits, degree,
      mix(options.round.seed ^ 0x5EC6A7ULL, static_cast<uint64_t>(round), attempt));
}

/// What the round's clients did, counted from every training thread.
struct RoundWork {
  std::atomic<int64_t> uplink{0};
  std::atomic<int64_t> client_ns{0}, server_ns{0}, senders{0}, training_ns{0}, trained{0};
  std::atomic<int64_t> diverged{0}, attackers{0};
};

/// The clients that take part train on `replicas.size()` threads, each delivering its update
/// to the server (or, under secure aggregation, its masked input).
void train_clients(SimulatedClients& clients, std::vector<Model>& replicas,
                   const std::vector<std::string>& selected, const std::vector<char>& takes_part,
                   int64_t round, const at::Tensor& global, const LocalTraining& round_plan,
                   SecureRound* secure, RoundWork& work) {
  const SimulationOptions& options = clients.options;
  const int threads = static_cast<int>(replicas.size());
  const at::Tensor control = clients.server.client_control();
  const double clip = clients.server.dp_clip();
  std::atomic<size_t> next{0};
  std::vector<std::exception_ptr> errors(threads);
  auto train = [&](int t) {
    try {
      if (threads > 1) at::set_num_threads(1);
      for (size_t i = next++; i < selected.size(); i = next++) {
        if (!takes_part[i]) continue;  // it leaves before it sends anything
        const int64_t c = std::stoll(selected[i]);
        ClientWork job;
        job.client = c;
        job.version = round;
        job.seed = mix(options.round.seed, static_cast<uint64_t>(round) * 2, c);
        job.global = global;
        job.control = control;
        job.plan = round_plan;
        job.clip = clip;
        job.secure = secure;
        job.secure_index = i;
        const ClientResult done = run_client(clients, replicas[t], job);
        work.training_ns += done.training_ns;
        ++work.trained;
        if (done.attacked) ++work.attackers;
        if (done.diverged) {
          ++work.diverged;
          continue;
        }
        if (done.masked) continue;
        work.client_ns += done.encoding_ns;
        ++work.senders;
        int64_t ns = 0;
        work.uplink += deliver(clients, done, selected[i], &ns);
        work.server_ns += ns;
      }
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  if (threads == 1) {
    // One client thread trains with one intra-op thread too, as each of several does: the
    // process's setting (often the cores, for evaluation) would run batch-10 steps on
    // several OpenMP threads, 10-40x slower where the cores are busy or shared.
    const int saved = at::get_num_threads();
    at::set_num_threads(1);
    train(0);
    at::set_num_threads(saved);
  } else {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back(train, t);
    for (auto& th : pool) th.join();
  }
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

void simulate_rounds(SimulatedClients& clients, std::vector<Model>& replicas, Model& global_model,
                     const data::TensorDataset& test, RoundLog& log, SimulationResult& result) {
  const SimulationOptions& options = clients.options;
  RoundServer& server = clients.server;
  const bool clock = options.speed.enabled();
  uint64_t attempt = 0;  // retries of the current round
  // Rounds tried since the (simulated) start, as a checkpoint saved them (retries count).
  int64_t attempts_total = server.round();
  const auto saved_attempts = server.loaded_extra().find("rounds/attempts");
  if (saved_attempts != server.loaded_extra().end()) {
    attempts_total = saved_attempts->second.item<int64_t>();
  }
  double now = server.clock();  // the virtual clock's minutes
  while (server.round() < options.rounds) {
    const auto round_start = std::chrono::steady_clock::now();
    const int64_t round = server.round();
    // Simulated time: every attempt at a round takes round_minutes (without the virtual clock).
    const double minute =
        clock ? now : static_cast<double>(attempts_total) * options.availability.round_minutes;
    ++attempts_total;
    int64_t available = 0;
    const std::vector<std::string> selected = server.select_from(
        options.clients,
        [&](int64_t c) { return options.availability.available(c, minute, options.round.seed); },
        &available);
    const at::Tensor global = server.global();
    const LocalTraining round_plan = server.plan();
    // Who takes part (and, on the virtual clock, when the round ends).
    double round_end = minute;
    const std::vector<char> takes_part =
        who_takes_part(clients, selected, round_plan, round, attempt, minute, round_end);
    RoundWork work;
    int secagg_degree = -1;
    std::unique_ptr<SecureRound> secure =
        options.round.secure_aggregation
            ? secure_round(clients, selected, round, attempt, secagg_degree)
            : nullptr;
    train_clients(clients, replicas, selected, takes_part, round, global, round_plan, secure.get(),
                  work);
    if (work.diverged > 0) {
      std::fprintf(stderr,
                   "round %lld: the local training of %lld client(s) diverged (NaN/Inf); "
                   "they left the round (a smaller --lr?)\n",
                   static_cast<long long>(round + 1), static_cast<long long>(work.diverged.load()));
    }
    RoundRecord record;
    record.available = available;
    if (options.byzantine.enabled()) record.faulty = work.attackers.load();
    if (secure) {
      const std::string why = secure->finish(server);
      // Too few clients left for the masks to come off: the round has no updates (retried).
      if (!why.empty() && options.progress)
        std::fprintf(stderr, "round %lld: %s\n", static_cast<long long>(round + 1), why.c_str());
      work.uplink += secure->uplink_bytes();
      record.server_aggregation_s = secure->server_seconds();
      record.client_aggregation_s = secure->client_seconds();
      record.server_masks = secure->server_masks();
      record.secagg_degree = secagg_degree;
      record.client_masks = secure->client_masks();
    } else {
      record.server_aggregation_s = static_cast<double>(work.server_ns.load()) * 1e-9;
      record.client_aggregation_s = static_cast<double>(work.client_ns.load()) * 1e-9 /
                                    static_cast<double>(std::max<int64_t>(1, work.senders));
    }
    const auto closing = std::chrono::steady_clock::now();
    record.outcome = server.close();
    record.server_aggregation_s += static_cast<double>(nanoseconds_since(closing)) * 1e-9;
    record.uplink_bytes = work.uplink.load();
    record.client_training_s = static_cast<double>(work.training_ns.load()) * 1e-9 /
                               static_cast<double>(std::max<int64_t>(1, work.trained));
    record.downlink_bytes = static_cast<int64_t>(selected.size()) * download_bytes(global);
    attempt = record.outcome.applied ? 0 : attempt + 1;
    if (clock) {
      // No client available: the clock still moves (the next attempt waits a round's minutes).
      now = selected.empty() ? now + options.availability.round_minutes : round_end;
      server.set_clock(now);
      record.sim_minutes = now;
    }
    record.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - round_start).count();
    if (finish_round(options, server, global_model, test, log, record, result,
                     server.options().min_clients, [&] {
                       auto state = client_state(clients);
                       state["rounds/attempts"] = at::scalar_tensor(attempts_total, at::kLong);
                       return state;
                     })) {
      break;
    }
  }
}

}  // namespace

SimulationResult simulate(const models::ModelSpec& spec, const data::TensorDataset& train,
                          const data::TensorDataset& test, const SimulationOptions& options) {
  validate(options.round.local);
  validate(options.round.aggregator.server);
  DTRAIN_CHECK_INPUT(options.fraction > 0 && options.fraction <= 1,
                     "--fraction must be in (0, 1], got ", options.fraction);
  DTRAIN_CHECK_INPUT(options.rounds >= 1, "--rounds must be >= 1, got ", options.rounds);
  DTRAIN_CHECK_INPUT(options.dropout >= 0 && options.dropout < 1,
                     "--dropout must be in [0, 1), got ", options.dropout);
  DTRAIN_CHECK_INPUT(options.eval_every >= 1, "--eval-every must be >= 1, got ",
                     options.eval_every);
  DTRAIN_CHECK_INPUT(options.threads >= 0, "--threads must be >= 0, got ", options.threads);
  DTRAIN_CHECK_INPUT(options.availability.round_minutes > 0, "--round-minutes must be > 0");
  DTRAIN_CHECK_INPUT(options.personalize_epochs >= 0 && options.personalize_layers >= 0,
                     "--personalize-epochs and --personalize-layers must be >= 0");
  DTRAIN_CHECK_INPUT(
      !options.round.secure_aggregation || options.compression.kind == comm::CompressionSpec::None,
      "--secure-aggregation sends masked 32-bit words, which do not compress: it "
      "cannot be combined with --compression ",
      to_string(options.compression));
  validate(options.round.aggregator.robust);
  validate(options.round.buffer);
  DTRAIN_CHECK_INPUT(options.round_deadline >= 0 && std::isfinite(options.round_deadline),
                     "--round-deadline must be >= 0 simulated minutes (0 = none), got ",
                     options.round_deadline);
  DTRAIN_CHECK_INPUT(!options.round.buffer.enabled() || options.speed.enabled(),
                     "--buffer-size runs on the virtual clock: give --client-speed (constant, "
                     "lognormal:SIGMA or pareto:ALPHA)");
  DTRAIN_CHECK_INPUT(options.round_deadline == 0 || options.speed.enabled(),
                     "--round-deadline is in simulated minutes on the virtual clock: give "
                     "--client-speed");
  DTRAIN_CHECK_INPUT(options.personalize_epochs == 0 || options.clients <= 100000,
                     "--personalize-epochs fine-tunes every client after the last round: at most "
                     "100,000 clients, got ",
                     options.clients);
  DTRAIN_CHECK_INPUT(options.secagg_threshold >= 0 && options.secagg_threshold <= 1,
                     "--secagg-threshold must be a fraction in [0, 1], got ",
                     options.secagg_threshold);
  DTRAIN_CHECK_INPUT(options.secagg_dropout < 1,
                     "--secagg-dropout must be a fraction in [0, 1) "
                     "(< 0: --dropout's), got ",
                     options.secagg_dropout);
  if (options.round.secure_aggregation &&
      (options.secagg_graph > 0 || options.secagg_graph == secagg::kAutoGraph)) {
    const int64_t per_round =
        std::max<int64_t>(1, std::llround(options.fraction * static_cast<double>(options.clients)));
    secagg::round_degree(options.secagg_graph, per_round, options.secagg_threshold,
                         secagg_dropout(options));
    if (options.secagg_graph == secagg::kAutoGraph) {
      secagg::check_auto_graph(per_round, options.secagg_threshold, secagg_dropout(options));
    }
    if (options.secagg_graph == secagg::kAutoGraph) {
      std::fprintf(
          stderr, "%s\n",
          secagg::describe_auto_degree(per_round, options.secagg_threshold, secagg_dropout(options))
              .c_str());
    }
  }
  const at::ScalarType dtype =
      train.raw_inputs().scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  torch::manual_seed(options.round.seed);
  Model global_model = build(spec, dtype);
  RoundServerOptions server_options = options.round;
  server_options.clients_per_round = std::max<int64_t>(
      1,
      static_cast<int64_t>(std::llround(options.fraction * static_cast<double>(options.clients))));
  server_options.min_clients =
      std::min(server_options.clients_per_round, std::max<int64_t>(1, options.round.min_clients));
  server_options.population = options.clients;
  if (options.initial.defined()) {
    const int64_t parameters = flatten_parameters(global_model).numel();
    DTRAIN_CHECK_INPUT(options.initial.numel() == parameters, "--init-from: a model of ",
                       options.initial.numel(), " parameters for one of ", parameters);
    load_flat_parameters(global_model, options.initial.to(dtype));
  }
  RoundServer server(flatten_parameters(global_model), server_options);
  const std::string checkpoint =
      options.checkpoint_dir.empty() ? "" : options.checkpoint_dir + "/server.pt";
  SimulationResult result;
  if (!checkpoint.empty() && std::filesystem::exists(checkpoint)) {
    server.load(checkpoint);
    result.start_round = server.round();
  }
  const int threads = options.threads > 0
                          ? options.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::vector<Model> replicas;
  for (int t = 0; t < threads; ++t) replicas.push_back(build(spec, dtype));
  // Clients are made when selected (from the partition and the seed) and dropped after.
  SimulatedClients clients(train, options, server);
  // A resumed run: the clients' error-feedback residuals and drift-correction state as saved.
  if (result.start_round > 0) restore_client_state(clients, server.loaded_extra(), checkpoint);
  RoundLog log(options.metrics_file, options.progress, options.rounds, result.start_round);
  if (options.round.buffer.enabled()) {
    simulate_buffered(clients, replicas, global_model, test, log, result);
  } else {
    simulate_rounds(clients, replicas, global_model, test, log, result);
  }
  result.global = server.global();
  result.rounds_done = server.round();
  if (options.personalize_epochs > 0) {
    LocalTraining plan = options.round.local;
    plan.epochs = options.personalize_epochs;
    // Every client fine-tunes: all of them made (a sampled population of more than 100,000 is
    // refused before the first round).
    std::vector<ClientIndices> everyone;
    for (int64_t c = 0; c < clients.population.size(); ++c) {
      everyone.push_back(clients.population.client(c));
    }
    result.personalization = personalize(spec, result.global, train, everyone, plan,
                                         options.personalize_layers, threads, options.round.seed);
    log.write({{"event", std::string("personalization")},
               {"clients", static_cast<int64_t>(result.personalization.global_accuracy.size())},
               {"epochs", options.personalize_epochs},
               {"layers", options.personalize_layers},
               {"global_accuracy", result.personalization.mean_global},
               {"personalized_accuracy", result.personalization.mean_personalized}});
  }
  return result;
}

std::string summary(const SimulationOptions& s, const SimulationResult& result) {
  std::string out;
  double accuracy = -1, uplink = 0;
  int64_t applied = 0;
  for (const auto& r : result.rounds) {
    if (r.test_accuracy >= 0) accuracy = r.test_accuracy;
    if (r.outcome.applied) {
      uplink += static_cast<double>(r.uplink_bytes);
      ++applied;
    }
  }
  out += printed("federated %s, %lld clients (%s), ", s.round.aggregator.algorithm.c_str(),
                 static_cast<long long>(s.clients), to_string(s.partition).c_str());
  if (s.round.buffer.enabled()) {
    out += printed("buffered K = %lld, concurrency %lld, staleness %s",
                   static_cast<long long>(s.round.buffer.size),
                   static_cast<long long>(s.round.buffer.clients_at_once()),
                   to_string(s.round.buffer.staleness).c_str());
  } else {
    out += printed("C = %g", s.fraction);
  }
  out += printed(", E = %lld, B = %lld: %lld %s", static_cast<long long>(s.round.local.epochs),
                 static_cast<long long>(s.round.local.batch),
                 static_cast<long long>(result.rounds_done),
                 s.round.buffer.enabled() ? "server steps" : "rounds");
  if (accuracy >= 0) out += printed(", test accuracy %.4f", accuracy);
  if (!result.rounds.empty() && result.rounds.back().dp_epsilon >= 0) {
    out += printed(", (%.3g, %g)-DP", result.rounds.back().dp_epsilon, s.round.dp.delta);
  }
  if (s.byzantine.enabled()) {
    out += printed(", faulty clients %s", to_string(s.byzantine).c_str());
  }
  if (applied > 0) {
    out += printed(", uplink %.0f bytes per round (%s)", uplink / static_cast<double>(applied),
                   comm::to_string(s.compression).c_str());
  }
  if (result.rounds_to_target > 0) {
    out += printed(", reached %.3f in %s %lld", s.target_accuracy,
                   s.round.buffer.enabled() ? "step" : "round",
                   static_cast<long long>(result.rounds_to_target));
    if (result.minutes_to_target >= 0) {
      out += printed(" (%.1f simulated minutes)", result.minutes_to_target);
    }
  }
  if (!result.rounds.empty() && result.rounds.back().sim_minutes >= 0) {
    out += printed(", %.1f simulated minutes in all", result.rounds.back().sim_minutes);
  }
  out += "\n";
  if (s.personalize_epochs > 0) {
    out += printed(
        "personalization (%lld epochs, %s): mean local test accuracy of %zu clients: "
        "global model %.4f, personalized %.4f\n",
        static_cast<long long>(s.personalize_epochs),
        s.personalize_layers == 0 ? "all layers"
                                  : concat("last ", s.personalize_layers, " layers").c_str(),
        result.personalization.global_accuracy.size(), result.personalization.mean_global,
        result.personalization.mean_personalized);
  }
  return out;
}

}  // namespace dtrain::services::federated
