// Synchronous data parallelism: every rank holds the full model; gradients are averaged by the
// bucketed Reducer, overlapped with backward.
#pragma once

#include "dtrain/common/Error.h"
#include "dtrain/parallel/StateShards.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/Strategy.h"
#include "dtrain/parallel/ddp/Reducer.h"
#include "dtrain/precision/LossScaler.h"
#include "dtrain/precision/Precision.h"
#include "parallel/StrategySupport.h"

namespace dtrain::parallel::ddp {

StrategyInfo ddp_strategy();

class DdpStrategy : public Strategy {
 public:
  explicit DdpStrategy(StrategyOptions options);
  std::string name() const override { return "ddp"; }
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  StepResult train_step(const std::vector<data::Batch>& micro_batches, const LossFn& loss) override;
  Model& model() override { return model_; }
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  void save(const std::string& directory) override;
  void load(const std::string& directory) override;
  void load_values(const std::string& directory) override;
  MemoryReport memory_report() const override;
  /// A 16-bit model (bf16, bf16-master) takes floating inputs in its dtype.
  at::Tensor evaluate_forward(const at::Tensor& inputs) override;
  /// The Reducer (ddp, zero1, zero2; zero3 has none).
  const Reducer& reducer() const {
    DTRAIN_CHECK(reducer_, name(), " has no Reducer");
    return *reducer_;
  }
  /// The dynamic loss scaler, or null when loss scaling is off.
  precision::LossScaler* loss_scaler() { return scaler_.get(); }

 protected:
  /// Builds optimizer_ over the parameters this rank updates (all of them, for DDP).
  virtual void build_optimizer(const optim::OptimizerFactory& make_optimizer);
  /// Applies the update once gradients are averaged (and unscaled, clipped).
  virtual void apply_update();
  /// Adjusts the Reducer before it is built (ZeRO-2 switches it to reduce-scatter).
  virtual void configure_reducer(ReducerOptions& options) {}
  /// Builds the gradient synchronizer (the Reducer unless overridden) over parameters_.
  virtual void build_gradient_sync(const std::vector<std::string>& names);
  /// What synchronizes gradients each step.
  virtual GradientSync& gradient_sync() { return *reducer_; }
  /// Reduce after every micro-batch instead of accumulating locally (sharded gradients cannot
  /// accumulate unreduced).
  virtual bool reduce_every_micro_batch() const { return false; }
  /// The tensors whose .grad the update uses (loss-scaler check, clipping).
  virtual std::vector<at::Tensor> gradient_holders() const {
    return master_.empty() ? parameters_ : master_;
  }
  /// One tensor per parameter whose .grad is its whole reduced gradient: the parameters, or
  /// where the Reducer keeps fp32 gradients of a bf16 model (bf16-master without reduce-
  /// scatter), the master weights (DDP) or holders of the Reducer's gradients (ZeRO-1).
  std::vector<at::Tensor> reduced_gradient_holders() const;
  /// bf16-master: the fp32 values the master weights start from (the model's before it was cast
  /// to bf16, after the initial broadcast), for build_optimizer to keep; empty otherwise.
  std::vector<at::Tensor> initial_master_;
  /// Whether each rank holds only part of the gradients (the clipping norm is then allreduced).
  virtual bool gradients_sharded() const { return false; }
  /// Whether the gradient sync sums sequence parallelism's partial gradients over the TP group
  /// before it reduces them (ZeRO-1/2's Reducer), so the gradients may be sharded.
  virtual bool sums_partial_first() const { return false; }

  void broadcast_buffers();
  /// setup(): rank 0's parameters and buffers to every replica (a replacement replica takes
  /// them, and the optimizer state, from a replica that trains instead).
  virtual void broadcast_initial_state();
  /// Micro-batch `index`'s forward under the run's precision (pure bf16 takes bf16 inputs): its
  /// loss, before any division or scaling.
  at::Tensor micro_batch_loss(const data::Batch& batch, const LossFn& loss, size_t index);
  /// Floating inputs in a 16-bit model's dtype; others as given.
  at::Tensor model_input(const at::Tensor& inputs) const;
  /// Checkpoints: the pieces whose values and optimizer state this rank's state file holds
  /// (every parameter whole for DDP, whose rank 0 alone writes), whether every rank writes a
  /// file, and the pieces whose values a load fills (every parameter whole unless sharded).
  virtual std::vector<PieceRef> state_pieces() const {
    return whole_pieces(names_, master_.empty() ? parameters_ : master_);
  }
  virtual bool state_sharded() const { return false; }
  /// Unsharded state: whether this rank's replica writes it (the first data-parallel replica;
  /// --fault-tolerance replicas: whichever replica saves, as only the leading one does).
  virtual bool writes_replicated_state() const { return comm_->rank() == 0; }
  /// The group the gradients are reduced over and the state sharded over (the grid's
  /// data-parallel group; --fault-tolerance replicas with --replica-shards: a replica's ranks).
  virtual comm::CommunicatorPtr data_parallel_group() { return grid_->dp(); }
  /// After the step's gradient reduction, before clipping and the update (--fault-tolerance
  /// replicas' sum over the replicas present); `result` holds this rank's loss.
  virtual void after_gradient_sync(StepResult& result) { (void)result; }
  /// Before each micro-batch's backward; `last`: the step's last.
  virtual void before_backward(bool last) { (void)last; }
  virtual std::vector<PieceRef> value_pieces() const;
  /// Every parameter, whole, as checkpoint pieces.
  NamedTensors named_buffers() const;
  /// Scales gradients to at most `max_norm` in global L2 norm; returns the norm before.
  double clip_gradients(double max_norm);

  StrategyOptions options_;
  Model model_;
  std::shared_ptr<comm::ProcessGrid> grid_;
  comm::CommunicatorPtr comm_;
  std::vector<at::Tensor> parameters_;
  std::vector<std::string> names_;  // of parameters_
  /// DDP with --precision bf16-master: fp32 copies of parameters_ (the model's, bf16), which the
  /// optimizer updates; their gradients alias the Reducer's fp32 buckets. (ZeRO keeps its shard's
  /// master copy in its FlatShards instead.)
  std::vector<at::Tensor> master_;
  optim::OptimizerPtr optimizer_;
  std::unique_ptr<Reducer> reducer_;
  precision::Precision precision_ = precision::Precision::Fp32;
  c10::Device device_{c10::DeviceType::CPU};
  std::unique_ptr<precision::LossScaler> scaler_;
  /// Tensor parallelism: each TP rank holds blocks of the split parameters; gradients are
  /// reduced over the DP group only.
  TensorParallelLayout tp_;
  /// Expert parallelism (--expert-parallel): whether each of parameters_ is a block of this
  /// rank's experts. Their gradients bypass the Reducer: reduced over grid_->edp() after
  /// backward; checkpoints are written by the first expert group, one file per expert rank.
  std::vector<bool> expert_;
  bool is_expert(size_t k) const { return k < expert_.size() && expert_[k]; }
  bool has_experts() const;
  /// Whether the gradient sync reduces the experts' gradients itself (zero3 shards them over
  /// their expert group), so the step leaves them alone.
  virtual bool syncs_expert_gradients() const { return false; }
  void zero_expert_gradients();
  /// `sum_partial`: the experts' partial gradients (sequence parallelism) are summed over the
  /// TP group here (the Reducer summed the rest's). bf16-master (ddp): reduced in fp32, as the
  /// master weights' gradients (the model's bf16 ones taken once, then left).
  void reduce_expert_gradients(bool sum_partial);
  /// Parameter k's index among the Reducer's (the dense parameters' when there are experts).
  size_t reducer_index(size_t k) const { return k < reducer_index_.size() ? reducer_index_[k] : k; }
  std::vector<size_t> reducer_index_;
  /// The experts' reduced gradients of the step, in parameter order (fp32 with master weights).
  std::vector<at::Tensor> expert_gradients_;
  bool warned_unused_ = false;
};

}  // namespace dtrain::parallel::ddp
