// DiLoCo (Douillard et al. 2023): islands of ranks each train with a synchronous inner strategy
// for H steps without talking to the others; then the islands average their parameter change
// (the outer gradient) and an outer optimizer (Nesterov momentum by default) moves the shared
// outer parameters, which every island continues from. Communication across islands drops by H.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/Compression.h"
#include "dtrain/parallel/Registry.h"
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
  /// Makes the model hold the outer parameters (the run's result) until the next step.
  void materialize() override;

  /// Outer steps made, and inner steps since the last one.
  int64_t outer_steps_done() const { return outer_done_; }
  int64_t inner_steps_pending() const { return pending_; }

 private:
  /// Collective over the islands: averages the outer gradient, steps the outer optimizer and
  /// puts the outer parameters into every island's model.
  void outer_step();
  /// The islands' mean of `slice` of the outer gradient (in place), each island's sent
  /// compressed (allgathered and decoded).
  void average_compressed(at::Tensor slice);
  /// Swaps the model's parameters with the outer ones (in place; twice restores).
  void swap_in_outer();

  StrategyOptions options_;
  DilocoOptions diloco_;
  StrategyPtr inner_;
  std::shared_ptr<comm::ProcessGrid> grid_;
  comm::CommunicatorPtr island_;  // this island's ranks
  comm::CommunicatorPtr across_;  // the ranks at this rank's place in every island
  int island_index_ = 0;
  int islands_ = 1;
  std::vector<at::Tensor> parameters_;  // the model's (the inner strategy's)
  std::vector<std::string> names_;
  std::vector<at::Tensor> outer_;  // the outer parameters (.grad: slices of flat_grad_)
  at::Tensor flat_grad_;           // the outer gradient, one buffer
  std::vector<at::Tensor> stash_;  // the island's parameters while the outer ones are in
  std::unique_ptr<torch::optim::Optimizer> outer_optimizer_;
  comm::CompressionSpec compression_;
  at::Tensor residual_;  // top-k's error feedback: what this rank's slice did not send yet
  int64_t pending_ = 0;
  int64_t outer_done_ = 0;
  int64_t outer_bytes_ = 0;
  bool outer_in_model_ = false;  // materialize(): the model holds the outer parameters
};

}  // namespace dtrain::parallel::diloco
