// DiLoCo (Douillard et al. 2023): islands of ranks each train with a synchronous inner strategy
// for H steps without talking to the others; then the islands average their parameter change
// (the outer gradient) and an outer optimizer (Nesterov momentum by default) moves the shared
// outer parameters, which every island continues from. Communication across islands drops by H.
// Streaming DiLoCo (Douillard et al. 2025) exchanges the model in fragments at staggered steps,
// each exchange overlapping the next inner steps: the peak traffic drops by the fragments too.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/Compression.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/diloco/DilocoOptions.h"

namespace dtrain::parallel::diloco {

StrategyInfo diloco_strategy();

class DilocoStrategy : public Strategy {
 public:
  explicit DilocoStrategy(StrategyOptions options);
  ~DilocoStrategy() override;
  std::string name() const override { return "diloco"; }
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  StepResult train_step(const std::vector<data::Batch>& micro_batches, const LossFn& loss) override;
  Model& model() override { return inner_->model(); }
  torch::optim::Optimizer& optimizer() override { return inner_->optimizer(); }
  void save(const std::string& directory) override;
  void load(const std::string& directory) override;
  MemoryReport memory_report() const override;
  void prepare(const data::Batch& example) override { inner_->prepare(example); }
  /// Evaluates the outer parameters (what the islands agree on), not this island's: they stay in
  /// the model until the next step.
  at::Tensor evaluate_forward(const at::Tensor& inputs) override;
  std::string layout() const override;
  /// Each step's loss is agreed within the island: no step waits on the link between islands.
  /// (A non-finite outer gradient stops every island at the next outer step.)
  comm::CommunicatorPtr step_group() const override { return island_; }
  /// A stop request is agreed at the outer steps, where the islands meet anyway.
  int64_t stop_check_every() const override;
  /// Makes the model hold the outer parameters (the run's result) until the next step.
  void materialize() override;
  /// The exchanges in flight complete, and every fragment with inner steps since its last
  /// exchange makes one more: the run's last steps count.
  void finish_training(StepResult& last) override;

 protected:
  /// Forms island_ (and across_ when there are several islands) over the world and makes every
  /// island start from the same `model` (island 0's); the inner strategy then spreads it.
  virtual void form_islands(Model& model);
  /// Collective over the islands: starts the mean of `slice` (this rank's share of an outer
  /// gradient) over the ranks at its place in every island; nullptr when done in place.
  virtual comm::WorkPtr average_over_islands(const at::Tensor& slice);
  /// The outer gradient crosses islands (false: one island, nothing to average).
  virtual bool crosses_islands() const { return across_ != nullptr; }
  /// Who writes what of a checkpoint: `leader` the outer state and the counters, `island` the
  /// folder its island's own state goes to, `islands` what the state file says it holds.
  struct SaveRole {
    bool leader = false;
    int island = 0;
    int islands = 1;
  };
  virtual SaveRole save_role() const;
  /// Ranks per island: --island-size, else this node's ranks (LOCAL_WORLD_SIZE).
  int island_size_of(int world) const;
  /// The step counters (inner and outer steps, each fragment's last exchange) as one tensor,
  /// and back: what a replacement island continues from.
  at::Tensor counters() const;
  void set_counters(const at::Tensor& counters);
  /// The model holds this island's parameters (not the outer ones materialize() put in).
  void island_in_model() {
    if (outer_in_model_) swap_in_outer();
  }

 private:
  /// Elements [lo, lo + length) of parameters_[tensor] flattened (the whole tensor unless a
  /// fragment boundary cuts it): what the outer optimizer steps. `outer` is a view of outer_'s
  /// (the tensor itself when whole), its .grad the matching view of flat_grad_.
  struct Run {
    size_t tensor = 0;
    int64_t lo = 0, length = 0;
    at::Tensor outer;
  };
  /// Runs [first, last) of runs_, elements [offset, offset + elements) of flat_grad_.
  struct Fragment {
    size_t first = 0, last = 0;
    int64_t offset = 0, elements = 0;
    int64_t phase = 0;      // exchanged after inner steps t with t % H == phase
    int64_t last_sync = 0;  // the inner step of its last exchange (0: none yet)
    at::Tensor residual;    // top-k's error feedback of this rank's slice of it
  };
  /// An exchange whose allreduce across the islands is in flight (overlap_steps > 0).
  struct Exchange {
    size_t fragment = 0;
    at::Tensor slice;  // this rank's slice of the fragment's outer gradient
    std::vector<int64_t> counts;
    comm::WorkPtr work;
    int64_t due = 0;              // the inner step after which it is applied
    comm::EncodedUpdate encoded;  // compressed: this rank's encoding (the parts' sizes)
    at::Tensor gathered;          // compressed: every island's encoding, allgathered
  };
  /// P fragments of equal shares of the flat outer gradient (the last ones one element more
  /// where P does not divide it), their runs and their phases.
  void make_fragments();
  /// Where each fragment starts in the flat outer gradient, then its size (kept with this
  /// rank's top-k residuals in checkpoints).
  at::Tensor fragment_offsets() const;
  /// The island's values of `run` (a view of the model's parameter, or of this rank's shard).
  at::Tensor run_parameter(const Run& run) const;
  /// Collective over the islands: the fragment's outer gradient leaves now; applied now when
  /// `overlap` is 0, else after `overlap` more inner steps (finish_exchange).
  void start_exchange(size_t fragment, int overlap);
  /// Waits for the islands' mean, gathers it in the island, steps the outer optimizer over the
  /// fragment and merges the new outer parameters into the island's model.
  void finish_exchange(Exchange& exchange);
  /// Completes every exchange in flight (save(), the end of training).
  void drain();
  /// Encodes the exchange's slice of the outer gradient (`residual`: its error feedback) and
  /// starts the allgather of every island's encoding (exchange.work).
  void send_compressed(Exchange& exchange, at::Tensor* residual);
  /// After the allgather: the islands' decoded mean, written into the exchange's slice.
  void receive_compressed(Exchange& exchange);
  /// Swaps the model's parameters with the outer ones (in place; twice restores).
  void swap_in_outer();

 protected:
  StrategyOptions options_;
  DilocoOptions diloco_;
  StrategyPtr inner_;
  std::shared_ptr<comm::ProcessGrid> grid_;
  comm::CommunicatorPtr island_;  // this island's ranks
  comm::CommunicatorPtr across_;  // the ranks at this rank's place in every island
  int island_index_ = 0;
  int islands_ = 1;
  std::vector<at::Tensor> parameters_;  // the model's, or this rank's shards of them (zero3)
  bool sharded_ = false;                // each rank of an island holds its own part of the model
  std::vector<at::Tensor> outer_;       // the outer parameters (.grad: slices of flat_grad_)
  std::unique_ptr<torch::optim::Optimizer> outer_optimizer_;

 private:
  /// The outer parameters as checkpoint pieces (whole, or this rank's shards of them).
  std::vector<PieceRef> outer_pieces() const;

  std::vector<std::string> names_;
  std::vector<PieceRef> pieces_;   // zero3: the shards' places in the model's parameters
  at::Tensor flat_grad_;           // the outer gradient, one buffer
  std::vector<at::Tensor> stash_;  // the island's parameters while the outer ones are in
  comm::CompressionSpec compression_;
  std::vector<at::Tensor> grad_views_;  // outer_[i]'s gradient: its slice of flat_grad_
  std::vector<Run> runs_;
  std::vector<Fragment> fragments_;
  std::vector<Exchange> in_flight_;
  int64_t inner_done_ = 0;
  int64_t outer_done_ = 0;
  int64_t outer_bytes_ = 0;
  bool outer_in_model_ = false;  // materialize(): the model holds the outer parameters
};

}  // namespace dtrain::parallel::diloco
