// Asynchronous buffered aggregation (FedBuff, Nguyen et al. 2022) and the virtual clock that
// compares it with synchronous rounds. The server hands the current model to at most C clients
// at once; each returns its update whenever it is done, weighted by how stale it is (how many
// server steps happened since it downloaded: a polynomial or hinge rule), into a buffer that is
// applied, through the aggregator and server optimizer as a synchronous round's mean, every K
// updates. With K = C = every client and no staleness discount it is synchronous FedAvg.
//
// The virtual clock (simulation): each client's device has a fixed slowness drawn from a
// heavy-tailed distribution (log-normal or Pareto, hashed from the seed and the client), so its
// local training takes slowness x --step-seconds per local step in simulated time; a synchronous
// round lasts until its slowest selected client is done (or has left, or its deadline passed),
// an asynchronous run moves from one client's completion to the next. Runs are deterministic:
// events are ordered by simulated time, not by which thread finished first.
#pragma once

#include <cstdint>
#include <string>

namespace dtrain::services::federated {

/// How an update's weight falls with its staleness s (server steps since the client downloaded
/// the model): constant (1), poly:A ((1 + s)^-A; FedBuff's default A = 0.5) or hinge:A,B (1 for
/// s <= B, then 1 / (A (s - B) + 1); Xie et al.'s FedAsync).
struct StalenessRule {
  enum Kind { Constant, Poly, Hinge };
  Kind kind = Poly;
  double a = 0.5, b = 0.0;
  double weight(int64_t staleness) const;
};

/// "constant", "poly:A" or "hinge:A,B" (InputError naming --staleness otherwise).
StalenessRule parse_staleness(const std::string& text);
std::string to_string(const StalenessRule& rule);

/// FedBuff's parameters (--buffer-size, --concurrency, --staleness). size 0: synchronous rounds.
struct BufferSpec {
  /// K: updates per server step.
  int64_t size = 0;
  /// C: clients training at once (0 = 10 x K).
  int64_t concurrency = 0;
  StalenessRule staleness;
  bool enabled() const { return size > 0; }
  int64_t clients_at_once() const { return concurrency > 0 ? concurrency : 10 * size; }
};

/// InputError naming the flag when K or C is out of range.
void validate(const BufferSpec& spec);

/// The devices' speeds on the virtual clock: "none" (no clock: a synchronous round takes
/// --round-minutes, as before), "constant" (every device alike), "lognormal:SIGMA" (slowness
/// e^(SIGMA x N(0,1)), median 1) or "pareto:ALPHA" (slowness >= 1 with tail exponent ALPHA).
struct ClientSpeed {
  enum Kind { None, Constant, LogNormal, Pareto };
  Kind kind = None;
  double shape = 1.0;
  /// Simulated seconds a median device takes per local step (one batch).
  double step_seconds = 1.0;
  bool enabled() const { return kind != None; }
  /// The client's slowness factor (>= 0), fixed for the run: a hash of (seed, client).
  double slowness(int64_t client, uint64_t seed) const;
  /// Simulated minutes `client` takes for `steps` local steps.
  double minutes(int64_t client, int64_t steps, uint64_t seed) const;
};

/// InputError naming --client-speed.
ClientSpeed parse_client_speed(const std::string& text);
std::string to_string(const ClientSpeed& speed);

/// A uniform double in [0, 1) from (seed, salt, index): splitmix64, cheap enough to ask for a
/// million clients (the diurnal trace's time zones, the speeds).
double hashed_uniform(uint64_t seed, uint64_t salt, int64_t index);

}  // namespace dtrain::services::federated
