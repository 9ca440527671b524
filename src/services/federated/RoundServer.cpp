#include "dtrain/services/federated/RoundServer.h"

#include "dtrain/services/federated/Compression.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <random>

#include <ATen/CPUGeneratorImpl.h>
#include <sodium.h>

#include "common/PickledFile.h"
#include "dtrain/common/Error.h"

namespace dtrain::federated {

namespace {
constexpr const char* kFormat = "dtrain-fl-server-1";
}

bool valid_client_id(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

RoundServer::RoundServer(at::Tensor initial, RoundServerOptions options)
    : options_(std::move(options)), global_(initial.detach().clone()) {
  validate(options_.dp);
  validate(options_.robust);
  AggregatorOptions aggregation;
  aggregation.server = options_.optimizer;
  aggregation.robust = options_.robust;
  aggregation.feddyn_alpha = options_.feddyn_alpha;
  aggregation.scaffold_option = options_.scaffold_option;
  aggregator_ = make_aggregator(resolve_algorithm(options_.algorithm, aggregation, options_.local),
                                aggregation);
  check_combination(*aggregator_, options_.secure_aggregation, options_.dp.enabled());
  clip_ = options_.dp.clip;
  if (options_.dp.adaptive()) {
    DTRAIN_CHECK_INPUT(!options_.secure_aggregation,
                       "--dp-target-quantile: each client's 'within the clip' bit would reach the "
                       "server in the clear beside --secure-aggregation's masked sum; use a fixed "
                       "--dp-clip with secure aggregation");
    update_noise_multiplier(options_.dp.noise_multiplier, count_noise());  // z < 2 sigma_b
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
}

double RoundServer::dp_clip() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return clip_;
}

double RoundServer::count_noise() const {
  return options_.dp.count_noise > 0 ? options_.dp.count_noise
                                     : static_cast<double>(options_.clients_per_round) / 20.0;
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

bool RoundServer::selected(const std::string& client) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return selected_.count(client) > 0;
}

std::string RoundServer::submit(const std::string& client, const at::Tensor& delta,
                                int64_t examples, double train_loss,
                                const at::Tensor& control_delta, int within_clip) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (selected_.count(client) == 0) {
    return concat("client '", client, "' was not selected for round ", round_);
  }
  if (submitted_.count(client) > 0) {
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
  if (!all_finite(delta)) {
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
    if (!all_finite(control_delta)) {
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
  mean_.add(delta, weight);
  if (options_.dp.adaptive()) within_clip_ += within_clip;
  if (aggregator_->needs_individual_updates()) updates_.push_back({client, delta.clone(), weight});
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
  if (!all_finite(weighted_sum) || !std::isfinite(loss_sum)) {
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
  out.selected = static_cast<int64_t>(selected_.size());
  out.finished = static_cast<int64_t>(submitted_.size());
  out.dropped = out.selected - out.finished;
  out.examples = static_cast<int64_t>(mean_.total_weight());
  if (out.examples > 0) out.train_loss = loss_sum_ / static_cast<double>(out.examples);
  out.applied = out.finished >= options_.min_clients;
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
  selected_.clear();
  clear_round();
  return out;
}

void RoundServer::save(const std::string& path) const {
  c10::impl::GenericDict file(c10::StringType::get(), c10::AnyType::get());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    file.insert("format", kFormat);
    file.insert("round", round_);
    file.insert("dp_clip", clip_);
    file.insert("optimizer", aggregator_->state_kind());
    c10::Dict<std::string, at::Tensor> tensors;
    tensors.insert("global", global_.clone());
    for (const auto& [name, tensor] : aggregator_->state()) tensors.insert(name, tensor.clone());
    file.insert("tensors", tensors);
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
    attempt_ = 0;
    selected_.clear();
    submitted_.clear();
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, path,
                 " is a malformed federated server checkpoint: ", e.what_without_backtrace());
  }
}

}  // namespace dtrain::federated
