// Pipeline parallelism over the grid's PP group, with data parallelism over its DP group: this
// rank runs a contiguous run of the model's stages, exchanging activations and their gradients
// with its neighbours in the order a schedule gives (Schedule.h), then averages its stages'
// gradients over its DP group and steps an optimizer over its own parameters only.
#pragma once

#include <map>
#include <memory>

#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/pipeline/Partition.h"
#include "dtrain/parallel/pipeline/Schedule.h"

namespace dtrain::parallel::pipeline {

class StageLink;

class PipelineStrategy : public Strategy {
 public:
  explicit PipelineStrategy(StrategyOptions options);
  ~PipelineStrategy() override;
  std::string name() const override { return "pipeline"; }
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  StepResult train_step(const std::vector<data::Batch>& micro_batches,
                        const LossFn& loss) override;
  /// This rank's copy of the whole model; only its own stages' parameters are trained here.
  Model& model() override { return model_; }
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  void save(const std::string& directory) override;
  void load(const std::string& directory) override;
  MemoryReport memory_report() const override;

  const Partition& partition() const { return partition_; }
  /// The parameters this rank trains (its stages'), with their names in the whole model.
  const std::vector<at::Tensor>& local_parameters() const { return parameters_; }
  const std::vector<std::string>& local_parameter_names() const { return names_; }

 private:
  at::Tensor run_stages(const at::Tensor& x) const;
  void average_gradients_over_dp();
  double clip_gradients();

  StrategyOptions options_;
  ScheduleKind kind_;
  Model model_;
  std::shared_ptr<comm::ProcessGrid> grid_;
  Partition partition_;
  std::vector<Stage> stages_;  // this rank's
  std::vector<at::Tensor> parameters_;
  std::vector<std::string> names_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<StageLink> link_;
};

}  // namespace dtrain::parallel::pipeline
