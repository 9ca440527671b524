// Synchronous data parallelism: every rank holds the full model; gradients are averaged by the
// bucketed Reducer, overlapped with backward.
#pragma once

#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/ddp/Reducer.h"

namespace dtrain::parallel {

class DdpStrategy : public Strategy {
 public:
  explicit DdpStrategy(StrategyOptions options);
  std::string name() const override { return "ddp"; }
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  StepResult train_step(const std::vector<data::Batch>& micro_batches,
                        const LossFn& loss) override;
  Model& model() override { return model_; }
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  void save(const std::string& directory) override;
  void load(const std::string& directory) override;
  MemoryReport memory_report() const override;
  const Reducer& reducer() const { return *reducer_; }

 private:
  void broadcast_buffers();

  StrategyOptions options_;
  Model model_;
  std::shared_ptr<comm::ProcessGrid> grid_;
  comm::CommunicatorPtr comm_;
  std::vector<at::Tensor> parameters_;
  optim::OptimizerPtr optimizer_;
  std::unique_ptr<Reducer> reducer_;
  bool warned_unused_ = false;
};

}  // namespace dtrain::parallel
