#include "parallel/ps/ReplicaStrategy.h"

#include <torch/torch.h>

#include <cstdio>

#include "dtrain/common/Error.h"

namespace dtrain::parallel::ps {

namespace {

void check_connection(const PsOptions& o) {
  DTRAIN_CHECK_INPUT(o.retry_ms >= 0, "--ps-retry-ms must be >= 0, got ", o.retry_ms);
  DTRAIN_CHECK_INPUT(o.rpc_timeout_ms >= 1, "--ps-timeout-ms must be >= 1, got ", o.rpc_timeout_ms);
}

}  // namespace

void declare_connection_flags(FlagSet& flags, PsOptions& o) {
  flags.add_list("--ps", o.addresses,
                 "--strategy downpour/sandblaster: the parameter-server shards, HOST:PORT,... in "
                 "shard order (each started with dtrain ps serve)");
  flags.add("--ps-timeout-ms", o.rpc_timeout_ms,
            "--strategy downpour/sandblaster: deadline of every parameter-server call");
  flags.add("--ps-retry-ms", o.retry_ms,
            "--strategy downpour/sandblaster: how long an unreachable shard (restarting?) is "
            "retried, with back-off, before the worker fails");
  flags
      .add("--ps-tls", o.tls,
           "--strategy downpour/sandblaster: connect to the shards with TLS (system roots "
           "unless --ps-tls-ca)")
      .show_default = false;
  flags
      .add("--ps-tls-ca", o.tls_ca,
           "--strategy downpour/sandblaster: PEM file of the certificates to trust (implies "
           "--ps-tls)")
      .show_default = false;
}

StrategyInfo replica_strategy(const std::string& name, const std::string& summary, Loop loop,
                              OptionGroup own,
                              std::function<StrategyPtr(const StrategyOptions&)> make) {
  StrategyInfo info;
  info.name = name;
  info.summary = summary;
  info.loop = loop;
  info.parameter_server = true;
  info.options = {option_group<PsOptions>("parameter-server connection", declare_connection_flags,
                                          check_connection),
                  std::move(own)};
  // Workers are whole-model replicas: no pipeline or tensor parallelism.
  info.check_layout = [name](const StrategyOptions&, const Layout& layout) {
    DTRAIN_CHECK_INPUT(layout.pipeline_parallel <= 1 && layout.tensor_parallel <= 1, "--strategy ",
                       name,
                       " workers are replicas of the whole model: "
                       "--pipeline-parallel and --tensor-parallel are not supported with it");
  };
  info.make = std::move(make);
  return info;
}

void ReplicaStrategy::setup_replica(Model model, const optim::OptimizerFactory& make_optimizer,
                                    std::shared_ptr<comm::ProcessGrid> grid) {
  const std::string strategy = concat("--strategy ", name());
  check_connection(ps_);
  DTRAIN_CHECK_INPUT(!ps_.addresses.empty(), strategy,
                     " needs the parameter-server shards: --ps HOST:PORT,... (servers started "
                     "with dtrain ps serve) or --ps-shards N (started here)");
  DTRAIN_CHECK_INPUT(options_.precision == "fp32", strategy,
                     " trains in the model's own dtype "
                     "(the shards hold the parameters in it); --precision ",
                     options_.precision, " is not supported with it");
  DTRAIN_CHECK_INPUT(grid->pp_size() == 1 && grid->tp_size() == 1, strategy,
                     " workers are replicas of the whole model: pipeline and tensor parallelism "
                     "are not supported with it");
  model_ = std::move(model);
  grid_ = std::move(grid);
  bool first = true;
  for (const auto& item : model_.module->named_parameters()) {
    const at::ScalarType type = item.value().scalar_type();
    if (first) dtype_ = type;
    first = false;
    DTRAIN_CHECK_INPUT((type == at::kFloat || type == at::kDouble) && type == dtype_, strategy,
                       ": parameter ", item.key(), " is ", type,
                       "; the shards hold float32 or "
                       "float64 parameters, all of one dtype (the first is ",
                       dtype_, ")");
    names_.push_back(item.key());
    parameters_.push_back(item.value());
    numel_ += item.value().numel();
  }
  optimizer_ = make_optimizer(parameters_);
  PsClientOptions client;
  client.rpc_timeout = std::chrono::milliseconds(ps_.rpc_timeout_ms);
  client.worker = grid_->world()->rank();
  client.retry_window = std::chrono::milliseconds(ps_.retry_ms);
  client.auth_token = ps_.auth_token;
  client.tls = ps_.tls || !ps_.tls_ca.empty();
  client.tls_ca = ps_.tls_ca;
  client_ = std::make_unique<PsClient>(ps_.addresses, client);
  client_->on_restart([worker = client.worker, label = name()](const ShardRestart& r) {
    std::fprintf(stderr,
                 "%s worker %d: parameter server %s (shard %d) restarted from its checkpoint "
                 "at version %lld; it had reached at least version %lld: %lld updates lost\n",
                 label.c_str(), worker, r.address.c_str(), r.shard,
                 static_cast<long long>(r.resumed_version), static_cast<long long>(r.seen_version),
                 static_cast<long long>(r.lost));
  });
}

at::Tensor ReplicaStrategy::flat_parameters() const {
  std::vector<at::Tensor> flat;
  for (const auto& p : parameters_) flat.push_back(p.detach().reshape({-1}));
  return at::cat(flat);
}

void ReplicaStrategy::set_parameters(const at::Tensor& flat) {
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  for (auto& p : parameters_) {
    p.copy_(flat.slice(0, offset, offset + p.numel()).view_as(p));
    offset += p.numel();
  }
}

void ReplicaStrategy::write_replica(const std::string& directory) const {
  write_state_shard(directory, 0, 1, pieces(), nullptr, buffers());
}

void ReplicaStrategy::load(const std::string& directory) {
  const NamedTensors b = buffers();
  read_state_shards(directory, pieces(), nullptr, {}, &b);
}

std::vector<PieceRef> ReplicaStrategy::pieces() const { return whole_pieces(names_, parameters_); }

NamedTensors ReplicaStrategy::buffers() const {
  NamedTensors b;
  for (const auto& item : model_.module->named_buffers()) b.emplace_back(item.key(), item.value());
  return b;
}

}  // namespace dtrain::parallel::ps
