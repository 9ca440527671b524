// `dtrain fl simulate`: many clients in one process against the federated server's logic
// (services/federated/simulation).
#include "Command.h"
#include "CommonFlags.h"

#include <cmath>
#include <cstdio>

#include "FederatedShared.h"
#include "NumericOptions.h"
#include "dtrain/comm/Compression.h"
#include "dtrain/services/federated/secagg/SecureAggregation.h"
#include "dtrain/services/federated/simulation/Simulation.h"

namespace dtrain::cli::fl {

namespace {

struct SimulateOptions {
  CLI::App* simulate_cmd = nullptr;
  Shared sim_shared;
  services::federated::SimulationOptions sim;
  std::string partition = "iid";
  std::string availability_trace = "always";
  std::string byzantine = "none";
  std::string client_speed = "none", staleness = "poly:0.5";
  bool error_feedback = true;
};

class SimulateCommand final : public Command {
 public:
  explicit SimulateCommand(CLI::App* fl) {
    SimulateOptions& o = options_;
    auto& s = o.sim;
    o.simulate_cmd = fl->add_subcommand(
        "simulate", "Simulate many clients in one process against the federated server's logic");
    CLI::App& c = *o.simulate_cmd;
    c.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    add(c, "--clients", s.clients, "Clients (each a partition of the training set)")
        ->capture_default_str();
    add(c, "--fraction", s.fraction, "C: the fraction of clients selected each round")
        ->capture_default_str();
    add_round_flags(c, s.rounds, o.sim_shared, s.secagg_threshold, s.metrics_file, "");
    add(c, "--partition", o.partition,
        "How the training set is cut: iid, shards:K (sorted labels, K shards per client: "
        "pathological non-IID) or dirichlet:ALPHA (label skew)")
        ->capture_default_str();
    add(c, "--local-test-fraction", s.local_test_fraction,
        "Share of each client's examples held out as its local test set")
        ->capture_default_str();
    add(c, "--client-examples", s.client_examples,
        "Examples a client holds at least: the set is dealt while it can give every client this "
        "many; a larger population (--clients 1000000) has each client draw this many by its "
        "seed, label-skewed by --partition")
        ->capture_default_str();
    add_plan(c, o.sim_shared);
    c.add_flag("!--no-error-feedback", o.error_feedback,
               "topk: drop what was not sent instead of keeping it for the next update");
    add(c, "--availability", o.availability_trace,
        "Who can be selected when: always, or diurnal:HOURS (each client, in its own time zone, "
        "available HOURS a day; a client whose window closes mid-round leaves it)")
        ->capture_default_str();
    add(c, "--round-minutes", s.availability.round_minutes,
        "Simulated minutes per round (moves the diurnal clock)")
        ->capture_default_str();
    add(c, "--client-speed", o.client_speed,
        "The virtual clock: each device's slowness, none (a round takes --round-minutes), "
        "constant, lognormal:SIGMA (median 1) or pareto:ALPHA (>= 1, heavy tail); a device takes "
        "slowness x --step-seconds per local step of simulated time")
        ->capture_default_str();
    add(c, "--step-seconds", s.speed.step_seconds,
        "Simulated seconds a median device takes per local step (batch)")
        ->capture_default_str();
    add(c, "--round-deadline", s.round_deadline,
        "Synchronous rounds on the virtual clock: simulated minutes a round waits for its clients "
        "(the slower ones are dropped; 0 = wait for every selected client)")
        ->capture_default_str();
    add_buffer_flags(c, o.sim_shared, o.staleness, " (in simulation: on the virtual clock)");
    add(c, "--byzantine", o.byzantine,
        "Faulty clients: F:KIND[:S], a fraction F of the clients (drawn from the seed) sending "
        "sign-flip (-S x their update, S = 1), scaled (S x, S = 10), gaussian (noise of standard "
        "deviation S = 1) or label-flip (trained on class c -> classes - 1 - c) updates")
        ->capture_default_str();
    add(c, "--dropout", s.dropout,
        "Probability that a selected client drops out before sending its update")
        ->capture_default_str();
    add(c, "--secagg-dropout", s.secagg_dropout,
        "The fraction of a round's clients expected to leave that --secagg-graph auto sizes the "
        "degree for (< 0: --dropout's)")
        ->capture_default_str();
    add_data(c, o.sim_shared, "the clients' data and the test set");
    add_run_flags(c, s.checkpoint_dir, s.eval_every, s.progress,
                  "Save the server (model, optimizer, round) here every round; resume from it",
                  "rounds");
    add(c, "--personalize-epochs", s.personalize_epochs,
        "After training, each client fine-tunes the global model for this many epochs on its own "
        "examples; both are tested on its local test set (0 = no personalization)")
        ->capture_default_str();
    add(c, "--personalize-layers", s.personalize_layers,
        "Fine-tune only the last N layers (0 = all)")
        ->capture_default_str();
    add(c, "--target-accuracy", s.target_accuracy,
        "Stop once the global model's test accuracy reaches this (0 = never)")
        ->capture_default_str();
  }
  bool parsed() const override { return options_.simulate_cmd->parsed(); }
  int run(const std::vector<std::string>&) override;

 private:
  SimulateOptions options_;
};

int SimulateCommand::run(const std::vector<std::string>&) {
  SimulateOptions& o = options_;
  auto& s = o.sim;
  const Shared& sh = o.sim_shared;
  s.partition = services::federated::parse_partition(o.partition);
  const double round_minutes = s.availability.round_minutes;
  s.availability = services::federated::parse_availability_trace(o.availability_trace);
  s.availability.round_minutes = round_minutes;
  s.round = sh.round;
  s.byzantine = services::federated::parse_byzantine(o.byzantine);
  const double step_seconds = s.speed.step_seconds;
  s.speed = services::federated::parse_client_speed(o.client_speed);
  s.speed.step_seconds = step_seconds;
  DTRAIN_CHECK_INPUT(step_seconds > 0 && std::isfinite(step_seconds),
                     "--step-seconds must be > 0, got ", step_seconds);
  s.round.buffer.staleness = services::federated::parse_staleness(o.staleness);
  s.threads = sh.threads;
  s.compression = comm::parse_compression(sh.compression);
  s.compression.error_feedback = o.error_feedback;
  s.secagg_graph = services::federated::secagg::parse_secagg_graph(sh.secagg_graph);
  const models::ModelSpec spec = model_spec(sh, sh.model.name, sh.model.hidden);
  set_up_process(sh.threads);  // evaluation (--threads, or the cores); client threads use one each
  const data::TensorDataset train = load(sh, true), test = load(sh, false);
  if (!sh.init_from.empty())
    s.initial = services::federated::flatten_parameters(initial_model(sh, spec));
  const auto result = services::federated::simulate(spec, train, test, s);
  std::printf("%s", services::federated::summary(s, result).c_str());
  save_final(sh, spec, result.global);
  return 0;
}

}  // namespace

std::unique_ptr<Command> simulate_command(CLI::App* fl) {
  return std::make_unique<SimulateCommand>(fl);
}

}  // namespace dtrain::cli::fl
