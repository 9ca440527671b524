// DiLoCo: islands, the outer gradient's average across them (whole or in fragments, compressed
// or not, overlapped or not) and the outer optimizer; checkpoints in DilocoCheckpoint.cpp.
#include "parallel/diloco/DilocoStrategy.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "dtrain/common/Error.h"
#include "dtrain/common/Flags.h"
#include "dtrain/parallel/StateShards.h"
#include "dtrain/parallel/ft/FaultToleranceOptions.h"
#include "parallel/ft/FaultToleranceFlags.h"
#include "parallel/ft/FaultTolerantDdp.h"
#include "parallel/ft/FaultTolerantDiloco.h"

namespace dtrain::parallel::diloco {

namespace {

void declare_flags(FlagSet& flags, DilocoOptions& o) {
  flags.add("--inner-strategy", o.inner_strategy,
            "DiLoCo: the strategy each island trains with: ddp, zero1, zero2, zero3");
  flags.add("--island-size", o.island_size, "DiLoCo: ranks per island (0 = the ranks of one node)");
  flags.add("--outer-steps", o.outer_steps, "DiLoCo: inner steps between outer steps (H)");
  flags.add("--outer-optimizer", o.outer_optimizer, "DiLoCo: nesterov, sgd, adam");
  flags.add("--outer-lr", o.outer_lr, "DiLoCo: the outer optimizer's learning rate");
  flags.add("--outer-momentum", o.outer_momentum,
            "DiLoCo: the outer momentum (nesterov, sgd; 0 = none)");
  flags.add("--outer-compression", o.outer_compression,
            "DiLoCo: the outer gradient across islands: none, q8, topk:FRACTION (error "
            "feedback)");
  flags.add("--streaming-fragments", o.fragments,
            "Streaming DiLoCo: the model in this many fragments, exchanged at staggered steps");
  flags.add("--overlap-steps", o.overlap_steps,
            "Streaming DiLoCo: inner steps an exchange overlaps before it is applied (< H)");
  flags.add("--merge-alpha", o.merge_alpha,
            "Streaming DiLoCo: island's share when the new outer parameters merge in (0 = "
            "replaced)");
}

void check_options(const DilocoOptions& o) {
  DTRAIN_CHECK_INPUT(o.inner_strategy == "ddp" || o.inner_strategy == "zero1" ||
                         o.inner_strategy == "zero2" || o.inner_strategy == "zero3",
                     "--inner-strategy must be a synchronous data-parallel strategy (ddp, zero1, "
                     "zero2 or zero3), got '",
                     o.inner_strategy, "'");
  DTRAIN_CHECK_INPUT(o.outer_steps >= 1, "--outer-steps must be >= 1, got ", o.outer_steps);
  DTRAIN_CHECK_INPUT(o.island_size >= 0, "--island-size must be >= 0, got ", o.island_size);
  DTRAIN_CHECK_INPUT(
      o.outer_optimizer == "nesterov" || o.outer_optimizer == "sgd" || o.outer_optimizer == "adam",
      "--outer-optimizer must be nesterov, sgd or adam, got '", o.outer_optimizer, "'");
  DTRAIN_CHECK_INPUT(std::isfinite(o.outer_lr) && o.outer_lr > 0, "--outer-lr must be > 0, got ",
                     o.outer_lr);
  DTRAIN_CHECK_INPUT(o.outer_momentum >= 0 && o.outer_momentum < 1,
                     "--outer-momentum must be in [0, 1), got ", o.outer_momentum);
  DTRAIN_CHECK_INPUT(o.outer_optimizer != "nesterov" || o.outer_momentum > 0,
                     "--outer-optimizer nesterov needs --outer-momentum > 0");
  comm::parse_compression(o.outer_compression, "--outer-compression");  // throws if bad
  DTRAIN_CHECK_INPUT(o.fragments >= 1, "--streaming-fragments must be >= 1, got ", o.fragments);
  DTRAIN_CHECK_INPUT(o.overlap_steps >= 0 && o.overlap_steps < o.outer_steps,
                     "--overlap-steps must be in [0, --outer-steps ", o.outer_steps, "), got ",
                     o.overlap_steps);
  DTRAIN_CHECK_INPUT(o.merge_alpha >= 0 && o.merge_alpha < 1,
                     "--merge-alpha must be in [0, 1), got ", o.merge_alpha);
}

void check_layout(const DilocoOptions& o, const Layout& layout) {
  DTRAIN_CHECK_INPUT(layout.pipeline_parallel == 1 && layout.tensor_parallel == 1,
                     "diloco's islands are data-parallel (--inner-strategy); use "
                     "--pipeline-parallel 1 and --tensor-parallel 1 with it");
  DTRAIN_CHECK_INPUT(layout.ranks == 0 || o.island_size == 0 || layout.ranks % o.island_size == 0,
                     "--island-size ", o.island_size, " does not divide the ", layout.ranks,
                     " ranks");
}

std::unique_ptr<torch::optim::Optimizer> make_outer_optimizer(const DilocoOptions& o,
                                                              const std::vector<at::Tensor>& p) {
  if (o.outer_optimizer == "adam") {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(o.outer_lr));
  }
  return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(o.outer_lr)
                                                    .momentum(o.outer_momentum)
                                                    .nesterov(o.outer_optimizer == "nesterov"));
}

}  // namespace

StrategyInfo diloco_strategy() {
  StrategyInfo info;
  info.name = "diloco";
  info.summary =
      "DiLoCo: islands train alone for H steps, then average their change with an outer "
      "optimizer";
  info.whole_model_on_rank0 = false;  // rank 0 holds its island's parameters, not the outer ones
  info.options = {option_group<DilocoOptions>("diloco", declare_flags, check_options),
                  ft::fault_tolerance_options()};
  info.fault_tolerant = true;
  info.replica_ranks = [](const StrategyOptions& options, const Layout&) {
    return options.of<DilocoOptions>().island_size;  // (fault tolerance needs it given)
  };
  info.inner_strategy = [](const StrategyOptions& options) {
    return options.of<DilocoOptions>().inner_strategy;
  };
  info.check_layout = [](const StrategyOptions& options, const Layout& layout) {
    check_layout(options.of<DilocoOptions>(), layout);
    ft::check_fault_tolerance_layout(options, layout);
  };
  info.make = [](const StrategyOptions& options) -> StrategyPtr {
    if (options.of<ft::FaultToleranceOptions>().replicas()) {
      return std::make_unique<ft::FaultTolerantDiloco>(options);
    }
    return std::make_unique<DilocoStrategy>(options);
  };
  return info;
}

int64_t DilocoStrategy::stop_check_every() const { return diloco_.outer_steps; }

DilocoStrategy::DilocoStrategy(StrategyOptions options)
    : options_(std::move(options)), diloco_(options_.of<DilocoOptions>()) {
  check_options(diloco_);
  compression_ = comm::parse_compression(diloco_.outer_compression, "--outer-compression");
  // The inner strategy trains one island: islands that outlive each other are DiLoCo's
  // business (FaultTolerantDiloco), not the inner strategy's.
  StrategyOptions inner = options_;
  inner.of<ft::FaultToleranceOptions>() = ft::FaultToleranceOptions();
  inner_ = make_strategy(diloco_.inner_strategy, inner);  // its own checks (precision, ...)
}

int DilocoStrategy::island_size_of(int world) const {
  if (diloco_.island_size > 0) {
    DTRAIN_CHECK_INPUT(world % diloco_.island_size == 0, "--island-size ", diloco_.island_size,
                       " does not divide the ", world, " ranks");
    return diloco_.island_size;
  }
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int size = local ? std::atoi(local) : world;
  DTRAIN_CHECK_INPUT(size >= 1 && world % size == 0, "diloco: the ranks of one node (",
                     "LOCAL_WORLD_SIZE=", size, ") do not divide the ", world,
                     " ranks; give --island-size");
  return size;
}

void DilocoStrategy::form_islands(Model& model) {
  const comm::CommunicatorPtr& all = grid_->dp();
  const int world = all->size();
  const int rank = all->rank();
  const int size = island_size_of(world);
  islands_ = world / size;
  island_index_ = rank / size;
  island_ = islands_ == 1 ? all : all->split(island_index_, rank, "island");
  across_ = islands_ == 1 ? nullptr : all->split(rank % size, rank, "islands");
  // Every island starts from island 0's model (the inner strategy then spreads it in each).
  if (across_) {
    torch::NoGradGuard no_grad;
    std::vector<comm::WorkPtr> works;
    for (auto& p : model.module->parameters()) works.push_back(across_->broadcast(p, {0}));
    for (auto& b : model.module->buffers()) works.push_back(across_->broadcast(b, {0}));
    comm::wait_all(works);
  }
}

comm::WorkPtr DilocoStrategy::average_over_islands(const at::Tensor& slice) {
  return across_->allreduce(slice, {comm::ReduceOp::Avg});
}

DilocoStrategy::SaveRole DilocoStrategy::save_role() const {
  SaveRole role;
  role.leader = grid_->world()->rank() == 0;
  role.island = island_index_;
  role.islands = islands_;
  return role;
}

at::Tensor DilocoStrategy::counters() const {
  std::vector<int64_t> values = {inner_done_, outer_done_};
  for (const auto& f : fragments_) values.push_back(f.last_sync);
  return at::tensor(values, at::kLong);
}

void DilocoStrategy::set_counters(const at::Tensor& counters) {
  DTRAIN_CHECK(counters.numel() == static_cast<int64_t>(2 + fragments_.size()),
               "diloco: ", counters.numel(), " step counters for ", fragments_.size(),
               " fragments");
  const at::Tensor values = counters.to(at::kLong).contiguous();
  const int64_t* v = values.data_ptr<int64_t>();
  inner_done_ = v[0];
  outer_done_ = v[1];
  for (size_t p = 0; p < fragments_.size(); ++p) fragments_[p].last_sync = v[2 + p];
}

DilocoStrategy::~DilocoStrategy() = default;

void DilocoStrategy::setup(Model model, const optim::OptimizerFactory& make_optimizer,
                           std::shared_ptr<comm::ProcessGrid> grid) {
  grid_ = std::move(grid);
  DTRAIN_CHECK_INPUT(grid_->pp_size() == 1 && grid_->tp_size() == 1,
                     "diloco's islands are data-parallel: --pipeline-parallel and "
                     "--tensor-parallel must be 1");
  form_islands(model);
  inner_->setup(std::move(model), make_optimizer, std::make_shared<comm::ProcessGrid>(island_));
  // ZeRO-3 islands: each rank's shards are its parameters; rank r of every island holds the same
  // slice, so the outer gradient is averaged shard by shard and never gathered in the island.
  pieces_ = inner_->parameter_pieces();
  sharded_ = !pieces_.empty();
  if (sharded_) {
    for (const auto& piece : pieces_) {
      parameters_.push_back(piece.tensor);
      names_.push_back(piece.name);
    }
  } else {
    for (const auto& item : inner_->model().module->named_parameters()) {
      if (!item.value().requires_grad()) continue;
      parameters_.push_back(item.value());
      names_.push_back(item.key());
    }
  }
  DTRAIN_CHECK_INPUT(!parameters_.empty(), "model has no trainable parameters",
                     sharded_ ? " in this rank's shards" : "");
  // The outer parameters; their gradients are slices of one flat buffer, averaged by one
  // collective per outer step (or per fragment).
  const auto dtype = parameters_.front().scalar_type();
  int64_t total = 0;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    DTRAIN_CHECK_INPUT(parameters_[i].scalar_type() == dtype, "diloco needs parameters of one ",
                       "dtype; ", names_[0], " is ", dtype, ", ", names_[i], " is ",
                       parameters_[i].scalar_type());
    total += parameters_[i].numel();
  }
  flat_grad_ = at::zeros({total}, parameters_.front().options().requires_grad(false));
  int64_t offset = 0;
  torch::NoGradGuard no_grad;
  for (const auto& p : parameters_) {
    outer_.push_back(p.detach().clone());
    grad_views_.push_back(flat_grad_.narrow(0, offset, p.numel()).view(p.sizes()));
    outer_.back().mutable_grad() = grad_views_.back();
    offset += p.numel();
  }
  make_fragments();
  std::vector<at::Tensor> stepped;  // what the outer optimizer steps: the runs
  for (const auto& run : runs_) stepped.push_back(run.outer);
  outer_optimizer_ = make_outer_optimizer(diloco_, stepped);
}

void DilocoStrategy::make_fragments() {
  const int count = diloco_.fragments;
  const int64_t total = flat_grad_.numel();
  DTRAIN_CHECK_INPUT(count <= total, "--streaming-fragments ", count, " exceeds the model's ",
                     total, " trainable elements", sharded_ ? " in this rank's shards" : "");
  // Fragment p: elements [total p / P, total (p + 1) / P) of the flat outer gradient. A tensor
  // that a boundary cuts is stepped as runs of its flattened elements (views of its outer
  // values and gradient); one that none cuts stays whole.
  std::vector<int64_t> bounds;
  for (int p = 0; p <= count; ++p) bounds.push_back(total * p / count);
  int64_t start = 0;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const int64_t end = start + parameters_[i].numel();
    int64_t lo = start;
    while (lo < end) {
      const int64_t cut = *std::upper_bound(bounds.begin(), bounds.end(), lo);
      const int64_t hi = std::min(end, cut);
      Run run;
      run.tensor = i;
      run.lo = lo - start;
      run.length = hi - lo;
      if (run.length == parameters_[i].numel()) {
        run.outer = outer_[i];
      } else {
        DTRAIN_CHECK(parameters_[i].is_contiguous(), "diloco: ", names_[i],
                     " is not contiguous; --streaming-fragments cuts it");
        run.outer = outer_[i].view({-1}).narrow(0, run.lo, run.length);
        run.outer.mutable_grad() = grad_views_[i].view({-1}).narrow(0, run.lo, run.length);
      }
      runs_.push_back(run);
      lo = hi;
    }
    start = end;
  }
  size_t next = 0;
  int64_t flat = 0;
  for (int p = 0; p < count; ++p) {
    Fragment f;
    f.first = next;
    f.offset = bounds[p];
    f.elements = bounds[p + 1] - bounds[p];
    while (next < runs_.size() && flat < bounds[p + 1]) flat += runs_[next++].length;
    f.last = next;
    f.phase = static_cast<int64_t>(p) * diloco_.outer_steps / count;
    fragments_.push_back(f);
  }
}

at::Tensor DilocoStrategy::fragment_offsets() const {
  std::vector<int64_t> offsets;
  for (const auto& f : fragments_) offsets.push_back(f.offset);
  offsets.push_back(flat_grad_.numel());
  return at::tensor(offsets, at::kLong);
}

at::Tensor DilocoStrategy::run_parameter(const Run& run) const {
  const at::Tensor& p = parameters_[run.tensor];
  return run.length == p.numel() ? p : p.view({-1}).narrow(0, run.lo, run.length);
}

StepResult DilocoStrategy::train_step(const std::vector<data::Batch>& micro_batches,
                                      const LossFn& loss) {
  if (outer_in_model_) swap_in_outer();  // materialize() left the outer parameters in
  StepResult result = inner_->train_step(micro_batches, loss);
  ++inner_done_;
  // Exchanges that left overlap_steps ago are applied first, then those due now leave.
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    if (it->due > inner_done_) {
      ++it;
      continue;
    }
    finish_exchange(*it);
    it = in_flight_.erase(it);
  }
  int started = 0;
  for (size_t p = 0; p < fragments_.size(); ++p) {
    if (inner_done_ % diloco_.outer_steps != fragments_[p].phase) continue;
    start_exchange(p, diloco_.overlap_steps);
    ++started;
  }
  result.metrics["outer_step"] = started;
  result.metrics["outer_steps"] = static_cast<double>(outer_done_);
  result.metrics["outer_bytes"] = static_cast<double>(outer_bytes_);
  return result;
}

void DilocoStrategy::finish_training(StepResult& last) {
  drain();
  int started = 0;
  for (size_t p = 0; p < fragments_.size(); ++p) {
    if (fragments_[p].last_sync == inner_done_) continue;
    start_exchange(p, 0);
    ++started;
  }
  last.metrics["outer_step"] += started;
  last.metrics["outer_steps"] = static_cast<double>(outer_done_);
  last.metrics["outer_bytes"] = static_cast<double>(outer_bytes_);
}

void DilocoStrategy::drain() {
  for (auto& exchange : in_flight_) finish_exchange(exchange);
  in_flight_.clear();
}

void DilocoStrategy::start_exchange(size_t index, int overlap) {
  torch::NoGradGuard no_grad;
  Fragment& fragment = fragments_[index];
  fragment.last_sync = inner_done_;
  // The outer gradient: how far this island moved away from the outer parameters, averaged
  // over the islands (every rank of an island holds the same parameters: each averages with
  // the ranks at its place in the other islands).
  for (size_t r = fragment.first; r < fragment.last; ++r) {
    at::sub_out(runs_[r].outer.mutable_grad(), runs_[r].outer, run_parameter(runs_[r]));
  }
  Exchange exchange;
  exchange.fragment = index;
  exchange.due = inner_done_ + overlap;
  if (crosses_islands()) {
    // Each rank of an island carries one slice of it across (one model's bytes per island, not
    // one per rank), then the island gathers the averaged slices over its own links. Sharded
    // islands (zero3) hold their slices already: each rank's whole fragment is its own.
    const int size = sharded_ ? 1 : island_->size(), rank = sharded_ ? 0 : island_->rank();
    exchange.counts.assign(size, fragment.elements / size);
    for (int64_t i = 0; i < fragment.elements % size; ++i) ++exchange.counts[i];
    int64_t offset = fragment.offset;
    for (int i = 0; i < rank; ++i) offset += exchange.counts[i];
    exchange.slice = flat_grad_.narrow(0, offset, exchange.counts[rank]);
    if (compression_.kind != comm::CompressionSpec::None) {
      send_compressed(exchange, &fragment.residual);
    } else {
      exchange.work = average_over_islands(exchange.slice);
      outer_bytes_ += exchange.slice.numel() * exchange.slice.element_size();
    }
  }
  if (overlap == 0) {
    finish_exchange(exchange);
  } else {
    in_flight_.push_back(std::move(exchange));
  }
}

void DilocoStrategy::finish_exchange(Exchange& exchange) {
  torch::NoGradGuard no_grad;
  const Fragment& fragment = fragments_[exchange.fragment];
  at::Tensor gradient = flat_grad_.narrow(0, fragment.offset, fragment.elements);
  if (crosses_islands()) {
    if (exchange.work) exchange.work->wait();
    if (exchange.gathered.defined()) receive_compressed(exchange);
    if (!sharded_ && island_->size() > 1) {
      island_->allgather(gradient, exchange.slice.clone(), {exchange.counts})->wait();
    }
    // Every island's loss is checked within the island only: a diverged island shows here, on
    // every rank at once (sharded islands agree on it first: each rank sees its shards).
    bool finite = comm::all_finite(gradient);
    if (sharded_ && island_->size() > 1) {
      at::Tensor bad = at::tensor({finite ? 0.0 : 1.0}, at::kDouble);
      island_->allreduce(bad)->wait();
      finite = bad.item<double>() == 0;
    }
    DTRAIN_CHECK(finite, "diloco: the outer gradient of outer step ", outer_done_ + 1,
                 " is not finite (an island diverged); lower --lr or --outer-lr");
  }
  // The outer optimizer steps this fragment's parameters alone (it skips those without a
  // gradient); their state is their own, so fragments never mix.
  const bool whole = fragments_.size() == 1;
  std::vector<at::Tensor> unset(runs_.size());
  if (!whole) {
    for (size_t r = 0; r < runs_.size(); ++r) {
      if (r < fragment.first || r >= fragment.last)
        std::swap(unset[r], runs_[r].outer.mutable_grad());
    }
  }
  outer_optimizer_->step();
  if (!whole) {
    for (size_t r = 0; r < runs_.size(); ++r) {
      if (unset[r].defined()) runs_[r].outer.mutable_grad() = unset[r];
    }
  }
  const double alpha = diloco_.merge_alpha;
  for (size_t r = fragment.first; r < fragment.last; ++r) {
    at::Tensor parameter = run_parameter(runs_[r]);
    if (alpha == 0) {
      parameter.copy_(runs_[r].outer);
    } else {
      parameter.mul_(alpha).add_(runs_[r].outer, 1 - alpha);
    }
  }
  ++outer_done_;
}

void DilocoStrategy::send_compressed(Exchange& exchange, at::Tensor* residual) {
  // Encoded on the CPU (the encoder's random rounding and top-k run there), in float32 or
  // float64, when the exchange leaves (the residual is this step's); every island's encoding
  // has the same parts of the same sizes (the same n and k), so they travel as one fixed-size
  // byte image, allgathered while the island trains on (--overlap-steps).
  at::Tensor mine = exchange.slice.to(at::kCPU);
  if (mine.scalar_type() != at::kDouble) mine = mine.to(at::kFloat);
  // The rounding's seed: this step, fragment and rank (exchanges in flight together never share
  // one; outer_done_ did, for fragments that left before either was applied).
  const uint64_t seed =
      (static_cast<uint64_t>(inner_done_) * 1000003ULL + exchange.fragment) * 1000003ULL +
      static_cast<uint64_t>(grid_->world()->rank());
  exchange.encoded = comm::encode_update(mine, compression_, residual, seed);
  std::vector<at::Tensor> images;
  for (const auto& part : exchange.encoded.parts) {
    images.push_back(part.second.contiguous().reshape({-1}).view(at::kByte));
  }
  const at::Tensor image = at::cat(images);
  exchange.gathered = at::empty({image.numel() * islands_}, image.options());
  exchange.work = across_->allgather(exchange.gathered, image);
  outer_bytes_ += image.numel();
}

void DilocoStrategy::receive_compressed(Exchange& exchange) {
  const int64_t length = exchange.gathered.numel() / islands_;
  const int64_t n = exchange.slice.numel();
  const auto dtype = exchange.slice.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor sum = at::zeros({n}, at::TensorOptions().dtype(dtype));
  for (int island = 0; island < islands_; ++island) {
    comm::EncodedUpdate theirs;
    theirs.encoding = exchange.encoded.encoding;
    int64_t offset = island * length;
    for (const auto& [name, part] : exchange.encoded.parts) {
      const int64_t bytes = static_cast<int64_t>(part.nbytes());
      theirs.parts.emplace_back(name, exchange.gathered.narrow(0, offset, bytes)
                                          .clone()
                                          .view(part.scalar_type())
                                          .view(part.sizes()));
      offset += bytes;
    }
    at::Tensor dense;
    const std::string problem = comm::decode_update(theirs, n, dtype, &dense);
    DTRAIN_CHECK(problem.empty(), "diloco: island ", island, "'s outer gradient: ", problem);
    sum += dense;
  }
  exchange.slice.copy_(sum / islands_);
  exchange.gathered = at::Tensor();
}

void DilocoStrategy::swap_in_outer() {
  torch::NoGradGuard no_grad;
  if (stash_.empty()) {
    for (const auto& p : parameters_) stash_.push_back(at::empty_like(p));
  }
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (!outer_in_model_) {
      stash_[i].copy_(parameters_[i]);
      parameters_[i].copy_(outer_[i]);
    } else {
      parameters_[i].copy_(stash_[i]);
    }
  }
  outer_in_model_ = !outer_in_model_;
}

at::Tensor DilocoStrategy::evaluate_forward(const at::Tensor& inputs) {
  // The outer parameters go in once per evaluation (not per batch): the next step, save() or
  // swap back.
  if (!outer_in_model_) swap_in_outer();
  return inner_->evaluate_forward(inputs);
}

void DilocoStrategy::materialize() {
  if (!outer_in_model_) swap_in_outer();
  inner_->materialize();  // zero3 gathers the outer values from its shards
}

std::vector<PieceRef> DilocoStrategy::outer_pieces() const {
  // The runs the outer optimizer steps (whole tensors unless a fragment boundary cuts one), as
  // runs of the model's parameters (or of this rank's shards of them).
  const std::vector<PieceRef> base = sharded_ ? pieces_ : whole_pieces(names_, outer_);
  std::vector<PieceRef> pieces;
  for (const auto& run : runs_) {
    PieceRef piece = base[run.tensor];
    piece.offset += run.lo;
    piece.tensor = run.outer;
    pieces.push_back(piece);
  }
  return pieces;
}

std::string DilocoStrategy::layout() const {
  return concat(
      "diloco: ", islands_, islands_ == 1 ? " island" : " islands", " of ", island_->size(),
      island_->size() == 1 ? " rank" : " ranks", " (", diloco_.inner_strategy, "), an outer ",
      diloco_.outer_optimizer, " step (lr ", diloco_.outer_lr, ", momentum ",
      diloco_.outer_momentum, ") every ", diloco_.outer_steps, " steps",
      fragments_.size() > 1 ? concat(" in ", fragments_.size(), " staggered fragments")
                            : std::string(),
      diloco_.overlap_steps > 0 ? concat(", each applied ", diloco_.overlap_steps,
                                         " steps later (merge alpha ", diloco_.merge_alpha, ")")
                                : std::string(),
      ", outer gradients ",
      compression_.kind == comm::CompressionSpec::None ? "uncompressed"
                                                       : comm::to_string(compression_));
}

}  // namespace dtrain::parallel::diloco
