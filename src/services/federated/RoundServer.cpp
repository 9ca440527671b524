#include "dtrain/services/federated/RoundServer.h"

#include "dtrain/comm/Compression.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <random>

#include <ATen/CPUGeneratorImpl.h>
#include <sodium.h>

#include "common/PickledFile.h"
#include "dtrain/common/Error.h"

namespace dtrain::services::federated {

namespace {
constexpr const char* kFormat = "dtrain-fl-server-1";
}

bool valid_client_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

namespace {
RoundServerOptions with_min_clients(RoundServerOptions options) {
  if (options.min_clients == 0) options.min_clients = 1;
  return options;
}
}  // namespace

RoundServer::RoundServer(at::Tensor initial, RoundServerOptions options)
    : options_(with_min_clients(std::move(options))), global_(initial.detach().clone()) {
  validate(options_.dp);
  validate(options_.aggregator.robust);
  const AggregatorOptions& aggregation = options_.aggregator;
  aggregator_ = make_aggregator(
      resolve_algorithm(aggregation.algorithm, aggregation, options_.local), aggregation);
  check_combination(*aggregator_, options_.secure_aggregation, options_.dp.enabled());
  clip_ = options_.dp.clip;
  if (options_.dp.adaptive()) {
    DTRAIN_CHECK_INPUT(!options_.secure_aggregation,
                       "--dp-target-quantile: each client's 'within the clip' bit would reach the "
                       "server in the clear beside --secure-aggregation's masked sum; use a fixed "
                       "--dp-clip with secure aggregation");
    update_noise_multiplier(options_.dp.noise_multiplier, count_noise());  // z < 2 sigma_b
  }
  validate(options_.buffer);
  if (options_.buffer.enabled()) {
    DTRAIN_CHECK_INPUT(!options_.secure_aggregation,
                       "--buffer-size (asynchronous buffered aggregation) with "
                       "--secure-aggregation: buffered secure aggregation is not implemented; "
                       "use synchronous rounds (--buffer-size 0) with secure aggregation");
    DTRAIN_CHECK_INPUT(aggregator_->supports_buffered(), "--buffer-size with --algorithm ",
                       aggregator_->name(),
                       ": it assumes synchronous rounds (drift state or a statistic over one "
                       "round's updates); buffered aggregation takes fedavg, fedprox, fedavgm, "
                       "fedadam or fedsgd");
  }
  validate(options_.local);
  aggregator_->configure(options_.local, 0);  // its checks of the plan, before any round
  DTRAIN_CHECK(sodium_init() >= 0, "libsodium failed to initialize");
  DTRAIN_CHECK_INPUT(options_.clients_per_round >= 1, "--clients-per-round must be >= 1, got ",
                     options_.clients_per_round);
  DTRAIN_CHECK_INPUT(
      options_.min_clients >= 1 && options_.min_clients <= options_.clients_per_round,
      "--min-clients must be in [1, clients per round = ", options_.clients_per_round, "], got ",
      options_.min_clients);
  DTRAIN_CHECK_INPUT(global_.dim() == 1 && (global_.scalar_type() == at::kFloat ||
                                            global_.scalar_type() == at::kDouble),
                     "the global model must be a flat float32 or float64 vector");
}

int64_t RoundServer::round() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return round_;
}

at::Tensor RoundServer::global() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return global_.clone();
}

std::vector<std::string> RoundServer::select(const std::vector<std::string>& available) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> pool(available);
  std::sort(pool.begin(), pool.end());
  pool.erase(std::unique(pool.begin(), pool.end()), pool.end());
  most_offered_ = std::max(most_offered_, static_cast<int64_t>(pool.size()));
  // Seeded by (seed, round, attempt): the same selection after a restart.
  std::seed_seq seq{static_cast<uint64_t>(options_.seed), static_cast<uint64_t>(round_),
                    static_cast<uint64_t>(attempt_)};
  std::mt19937_64 rng(seq);
  std::shuffle(pool.begin(), pool.end(), rng);
  pool.resize(std::min<size_t>(pool.size(), static_cast<size_t>(options_.clients_per_round)));
  selected_ = std::set<std::string>(pool.begin(), pool.end());
  clear_round();
  return pool;
}

void RoundServer::clear_round() {
  submitted_.clear();
  mean_ = WeightedMean();
  updates_.clear();
  control_sum_ = at::Tensor();
  within_clip_ = 0;
  loss_sum_ = 0;
  buffered_ = 0;
  left_ = 0;
  staleness_sum_ = 0;
}

double RoundServer::dp_clip() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return clip_;
}

double RoundServer::count_noise() const {
  const int64_t per_step =
      options_.buffer.enabled() ? options_.buffer.size : options_.clients_per_round;
  return options_.dp.count_noise > 0 ? options_.dp.count_noise
                                     : static_cast<double>(per_step) / 20.0;
}

std::string RoundServer::start(const std::string& client) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!options_.buffer.enabled()) return "start() is for buffered aggregation";
  if (training_.count(client) > 0) {
    return concat("client '", client, "' is already training (from step ", training_.at(client),
                  ")");
  }
  if (submitted_.count(client) > 0) {
    // One update per client in a buffer (as one per round): a fast device cannot fill it.
    return concat("client '", client, "' already has an update in step ", round_, "'s buffer");
  }
  if (static_cast<int64_t>(training_.size()) >= options_.buffer.clients_at_once()) {
    return concat(options_.buffer.clients_at_once(), " clients are training (--concurrency)");
  }
  training_[client] = round_;
  return "";
}

void RoundServer::leave(const std::string& client) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (training_.erase(client) > 0) ++left_;
}

double RoundServer::clock() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return clock_;
}

void RoundServer::set_clock(double minutes) {
  std::lock_guard<std::mutex> lock(mutex_);
  clock_ = minutes;
}

int64_t RoundServer::training() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(training_.size());
}

std::map<std::string, int64_t> RoundServer::training_steps() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return training_;
}

bool RoundServer::buffer_full() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.buffer.enabled() && buffered_ >= options_.buffer.size;
}

at::Tensor RoundServer::client_control() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const at::Tensor c = aggregator_->client_control();
  return c.defined() ? c.clone() : c;
}

std::vector<std::string> RoundServer::select_from(int64_t population,
                                                  const std::function<bool(int64_t)>& available,
                                                  int64_t* available_count) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::seed_seq seq{static_cast<uint64_t>(options_.seed), static_cast<uint64_t>(round_),
                    static_cast<uint64_t>(attempt_), uint64_t{0x5E1EC7}};
  std::mt19937_64 rng(seq);
  const auto k = static_cast<size_t>(options_.clients_per_round);
  int64_t count = 0;
  for (int64_t c = 0; c < population; ++c) count += available(c) ? 1 : 0;
  if (available_count != nullptr) *available_count = count;
  std::vector<int64_t> chosen;
  if (static_cast<double>(count) >= 4.0 * static_cast<double>(k)) {
    // Many available: distinct uniform draws, the unavailable ones rejected.
    std::set<int64_t> taken;
    std::uniform_int_distribution<int64_t> any(0, population - 1);
    while (taken.size() < k) {
      const int64_t c = any(rng);
      if (taken.count(c) == 0 && available(c)) {
        taken.insert(c);
        chosen.push_back(c);
      }
    }
  } else {
    for (int64_t c = 0; c < population; ++c) {
      if (available(c)) chosen.push_back(c);
    }
    std::shuffle(chosen.begin(), chosen.end(), rng);
    chosen.resize(std::min(chosen.size(), k));
  }
  most_offered_ = std::max(most_offered_, count);
  std::vector<std::string> ids;
  for (const int64_t c : chosen) ids.push_back(std::to_string(c));
  selected_ = std::set<std::string>(ids.begin(), ids.end());
  clear_round();
  return ids;
}

LocalTraining RoundServer::plan() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return aggregator_->configure(options_.local, round_);
}

LocalTraining RoundServer::plan_at(int64_t round) const {
  return aggregator_->configure(options_.local, round);
}

bool RoundServer::selected(const std::string& client) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return selected_.count(client) > 0;
}

std::string RoundServer::submit(const std::string& client, const at::Tensor& delta,
                                int64_t examples, double train_loss,
                                const at::Tensor& control_delta, int within_clip) {
  std::lock_guard<std::mutex> lock(mutex_);
  const bool buffered = options_.buffer.enabled();
  if (buffered && training_.count(client) == 0) {
    return concat("client '", client, "' is not training (start it first)");
  }
  if (!buffered && selected_.count(client) == 0) {
    return concat("client '", client, "' was not selected for round ", round_);
  }
  if (!buffered && submitted_.count(client) > 0) {
    return concat("client '", client, "' already sent its update for round ", round_);
  }
  if (!delta.defined() || delta.dim() != 1 || delta.numel() != global_.numel()) {
    return concat("client '", client, "': the update holds ", delta.defined() ? delta.numel() : 0,
                  " elements, the model ", global_.numel());
  }
  if (delta.scalar_type() != global_.scalar_type()) {
    return concat("client '", client, "': the update is ", delta.scalar_type(), ", the model ",
                  global_.scalar_type());
  }
  if (examples < 1) return concat("client '", client, "': ", examples, " examples");
  if (!comm::all_finite(delta)) {
    return concat("client '", client, "': the update holds NaN or Inf values");
  }
  if (aggregator_->needs_control_deltas()) {
    if (!control_delta.defined() || control_delta.dim() != 1 ||
        control_delta.numel() != global_.numel() ||
        control_delta.scalar_type() != global_.scalar_type()) {
      return concat("client '", client, "': --algorithm ", aggregator_->name(),
                    " needs its control-variate change, one ", global_.scalar_type(),
                    " per parameter");
    }
    if (!comm::all_finite(control_delta)) {
      return concat("client '", client, "': the control-variate change holds NaN or Inf values");
    }
  }
  // With differential privacy every client counts once and no update may exceed the clip.
  double weight = static_cast<double>(examples);
  if (options_.dp.enabled()) {
    const double norm = delta.to(at::kDouble).norm().item<double>();
    if (norm > clip_ * (1 + 1e-6)) {
      return concat("client '", client, "': the update's L2 norm ", norm, " exceeds the clip ",
                    clip_, " (--dp-clip)");
    }
    if (options_.dp.adaptive() && within_clip != 0 && within_clip != 1) {
      return concat("client '", client,
                    "': adaptive clipping needs whether its update was within the clip");
    }
    weight = 1.0;
  }
  // FedBuff: an update computed from an older model counts less.
  double scale = 1.0;
  if (buffered) {
    const int64_t staleness = round_ - training_.at(client);
    scale = options_.buffer.staleness.weight(staleness);
    training_.erase(client);
    ++buffered_;
    staleness_sum_ += static_cast<double>(staleness);
  }
  mean_.add(delta, weight, scale);
  if (options_.dp.adaptive()) within_clip_ += within_clip;
  if (aggregator_->needs_individual_updates()) {
    updates_.push_back({client, scale == 1.0 ? delta.clone() : delta * scale, weight});
  }
  if (aggregator_->needs_control_deltas()) {
    if (control_sum_.defined()) {
      control_sum_.add_(control_delta);
    } else {
      control_sum_ = control_delta.to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);
    }
  }
  submitted_[client] = examples;
  loss_sum_ += train_loss * weight;
  return "";
}

std::string RoundServer::submit_sum(const at::Tensor& weighted_sum, double examples,
                                    const std::vector<std::string>& clients, double loss_sum) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aggregator_->needs_individual_updates()) {
    return concat("--algorithm ", aggregator_->name(),
                  " needs each client's update, not their "
                  "sum");
  }
  for (const auto& client : clients) {
    if (selected_.count(client) == 0 || submitted_.count(client) > 0) {
      return concat("client '", client, "' was not selected for round ", round_,
                    " or is already counted");
    }
  }
  if (!weighted_sum.defined() || weighted_sum.dim() != 1 ||
      weighted_sum.numel() != global_.numel()) {
    return concat("an aggregate of ", weighted_sum.defined() ? weighted_sum.numel() : 0,
                  " elements for a model of ", global_.numel());
  }
  if (!(examples >= 1)) return concat("an aggregate of ", examples, " examples");
  if (!comm::all_finite(weighted_sum) || !std::isfinite(loss_sum)) {
    return "the aggregate holds NaN or Inf values";
  }
  mean_.add(weighted_sum.to(at::kDouble) / examples, examples);
  for (const auto& client : clients) submitted_[client] = 0;
  loss_sum_ += loss_sum;
  return "";
}

RoundOutcome RoundServer::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  RoundOutcome out;
  out.round = round_;
  const bool buffered = options_.buffer.enabled();
  if (buffered) {
    // A step of K updates: DP's noise is divided by K as a round's by its selected clients.
    out.selected = options_.buffer.size;
    out.finished = buffered_;
    out.dropped = left_;
    out.staleness = buffered_ > 0 ? staleness_sum_ / static_cast<double>(buffered_) : 0.0;
  } else {
    out.selected = static_cast<int64_t>(selected_.size());
    out.finished = static_cast<int64_t>(submitted_.size());
    out.dropped = out.selected - out.finished;
  }
  out.examples = static_cast<int64_t>(mean_.total_weight());
  if (out.examples > 0) out.train_loss = loss_sum_ / static_cast<double>(out.examples);
  out.applied = buffered ? buffered_ > 0 : out.finished >= options_.min_clients;
  if (out.applied) {
    at::Tensor average = mean_.mean(global_.scalar_type());
    if (options_.dp.enabled()) {
      // DP-FedAvg: (the sum of clipped updates + N(0, (z S)^2)) / the selected clients.
      at::Tensor sum = mean_.mean(at::kDouble) * mean_.total_weight();
      uint64_t seed = 0;
      randombytes_buf(&seed, sizeof seed);
      at::Generator generator = at::detail::createCPUGenerator(seed);
      const double z = options_.dp.adaptive()
                           ? update_noise_multiplier(options_.dp.noise_multiplier, count_noise())
                           : options_.dp.noise_multiplier;
      if (z > 0) sum += at::randn(sum.sizes(), generator, at::kDouble) * (z * clip_);
      average = (sum / static_cast<double>(out.selected)).to(global_.scalar_type());
      out.dp_clip = clip_;
      if (options_.dp.adaptive()) {
        // The noised fraction of clients within the clip moves it towards the quantile.
        double within = static_cast<double>(within_clip_);
        if (options_.dp.noise_multiplier > 0) {
          within += at::randn({1}, generator, at::kDouble).item<double>() * count_noise();
        }
        const double fraction = within / static_cast<double>(out.selected);
        clip_ *= std::exp(-options_.dp.clip_lr * (fraction - options_.dp.target_quantile));
      }
    }
    const int64_t population = options_.population > 0 ? options_.population : most_offered_;
    aggregator_->aggregate(
        global_, {round_, average, std::move(updates_), control_sum_, out.finished, population});
    ++round_;
    attempt_ = 0;
  } else {
    ++attempt_;
  }
  if (!buffered) selected_.clear();
  clear_round();
  return out;
}

void RoundServer::save(const std::string& path,
                       const std::map<std::string, at::Tensor>& extra) const {
  c10::impl::GenericDict file(c10::StringType::get(), c10::AnyType::get());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    file.insert("format", kFormat);
    file.insert("round", round_);
    file.insert("dp_clip", clip_);
    file.insert("clock", clock_);
    file.insert("optimizer", aggregator_->state_kind());
    c10::Dict<std::string, at::Tensor> tensors;
    tensors.insert("global", global_.clone());
    for (const auto& [name, tensor] : aggregator_->state()) tensors.insert(name, tensor.clone());
    file.insert("tensors", tensors);
    if (options_.buffer.enabled()) {
      // The asynchronous state: the buffer so far and who is training from which step (their
      // updates are taken, with the right staleness, after a restart).
      c10::List<std::string> clients;
      c10::List<int64_t> steps;
      for (const auto& [client, step] : training_) {
        clients.push_back(client);
        steps.push_back(step);
      }
      file.insert("training_clients", clients);
      file.insert("training_steps", steps);
      file.insert("buffered", buffered_);
      file.insert("buffer_weight", mean_.total_weight());
      file.insert("buffer_loss", loss_sum_);
      file.insert("buffer_staleness", staleness_sum_);
      file.insert("buffer_within_clip", within_clip_);
      file.insert("left", left_);
      c10::List<std::string> in_buffer;
      for (const auto& entry : submitted_) in_buffer.push_back(entry.first);
      file.insert("buffer_clients", in_buffer);
      if (mean_.sum().defined()) file.insert("buffer", mean_.sum().clone());
    }
  }
  if (!extra.empty()) {
    c10::Dict<std::string, at::Tensor> tensors;
    for (const auto& [name, tensor] : extra) tensors.insert(name, tensor);
    file.insert("extra", tensors);
  }
  save_pickled_dict(path, file);
}

void RoundServer::load(const std::string& path) {
  const auto file = load_pickled_dict(path, "federated server checkpoint", kFormat);
  try {
    const std::string optimizer = file.at("optimizer").toStringRef();
    DTRAIN_CHECK_INPUT(optimizer == aggregator_->state_kind(), path, " holds ", optimizer,
                       " server-optimizer state, this server runs ", aggregator_->state_kind());
    const auto tensors = file.at("tensors").toGenericDict();
    DTRAIN_CHECK_INPUT(tensors.contains("global"), path, ": no global model");
    const at::Tensor global = tensors.at("global").toTensor();
    std::lock_guard<std::mutex> lock(mutex_);
    DTRAIN_CHECK_INPUT(global.dim() == 1 && global.numel() == global_.numel() &&
                           global.scalar_type() == global_.scalar_type(),
                       path, " holds a model of ", global.numel(), " ", global.scalar_type(),
                       " parameters, this server's has ", global_.numel(), " ",
                       global_.scalar_type());
    std::vector<std::pair<std::string, at::Tensor>> state;
    for (const auto& entry : tensors) {
      const std::string name = entry.key().toStringRef();
      if (name == "global") continue;
      const at::Tensor t = entry.value().toTensor();
      DTRAIN_CHECK_INPUT(t.sizes() == global.sizes() && t.scalar_type() == global.scalar_type(),
                         path, ": optimizer state '", name, "' does not match the model");
      state.emplace_back(name, t);
    }
    global_ = global.clone();
    aggregator_->load_state(state);
    round_ = file.at("round").toInt();
    if (file.contains("dp_clip") && options_.dp.adaptive()) clip_ = file.at("dp_clip").toDouble();
    clock_ = file.contains("clock") ? file.at("clock").toDouble() : 0.0;
    attempt_ = 0;
    selected_.clear();
    clear_round();
    training_.clear();
    if (options_.buffer.enabled() && file.contains("training_clients")) {
      const auto clients = file.at("training_clients").toList();
      const auto steps = file.at("training_steps").toList();
      DTRAIN_CHECK_INPUT(clients.size() == steps.size(), path,
                         ": a damaged list of training clients");
      for (size_t i = 0; i < clients.size(); ++i) {
        training_[clients.get(i).toStringRef()] = steps.get(i).toInt();
      }
      buffered_ = file.at("buffered").toInt();
      loss_sum_ = file.at("buffer_loss").toDouble();
      staleness_sum_ = file.at("buffer_staleness").toDouble();
      within_clip_ = file.at("buffer_within_clip").toInt();
      left_ = file.at("left").toInt();
      const auto in_buffer = file.at("buffer_clients").toList();
      for (size_t i = 0; i < in_buffer.size(); ++i) submitted_[in_buffer.get(i).toStringRef()] = 1;
      if (file.contains("buffer")) {
        const at::Tensor sum = file.at("buffer").toTensor();
        DTRAIN_CHECK_INPUT(sum.dim() == 1 && sum.numel() == global_.numel(), path,
                           ": the buffer does not match the model");
        mean_.restore(sum.to(at::kDouble), file.at("buffer_weight").toDouble(), buffered_);
      }
    }
    loaded_extra_.clear();
    if (file.contains("extra")) {
      for (const auto& entry : file.at("extra").toGenericDict()) {
        loaded_extra_[entry.key().toStringRef()] = entry.value().toTensor();
      }
    }
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, path,
                 " is a malformed federated server checkpoint: ", e.what_without_backtrace());
  }
}

}  // namespace dtrain::services::federated
