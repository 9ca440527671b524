// Pipelines whose replicas outlive each other (--pipeline-parallel P --fault-tolerance replicas
// with ddp stages): each data-parallel replica is a whole pipeline, P stages x --tensor-parallel
// ranks, laid out as consecutive world ranks (comm::GridOrder::kTpPpDp), which fails and is
// replaced as one. A step runs the pipeline's schedule inside each replica with the gradients
// kept local; then each rank sums its stage's gradients, with its replica's loss and a one that
// counts it, with the same (stage, TP rank) position of the other replicas present through the
// ReplicaManager (one decision per step covers every position) and divides by their number, as
// FaultTolerantDdp does. A rank that dies or hangs takes its replica out: its other ranks wait
// for it at their next activation, and their launcher ends them and starts the whole pipeline
// again. The leading replica evaluates and checkpoints alone (its stages writing the usual
// pipelined files); a replacement pipeline forms its TP and PP groups among its own ranks and
// each rank takes the state of the leading replica's rank at its position.
#pragma once

#include <memory>

#include "dtrain/parallel/ft/Replicas.h"
#include "parallel/ft/ReplicaMember.h"
#include "parallel/pipeline/PipelineStrategy.h"

namespace dtrain::parallel::ft {

class FaultTolerantPipeline : public pipeline::PipelineStrategy, public ReplicaMemberStrategy {
 public:
  explicit FaultTolerantPipeline(StrategyOptions options);
  void setup(Model model, const optim::OptimizerFactory& make_optimizer,
             std::shared_ptr<comm::ProcessGrid> grid) override;
  bool survives_replica_failures() const override { return true; }
  comm::CommunicatorPtr step_group() const override { return member_->manager().group(); }
  comm::CommunicatorPtr replica_group() const override { return replica_; }

 protected:
  /// The stage costs: the replica's first rank's (every replica places its stages alike).
  comm::Communicator& agreement_group() const override { return *replica_; }
  /// The replica group forms here; a replacement's state comes with its admission.
  void broadcast_replica_state() override;
  bool reduces_over_data_parallel() const override { return false; }
  /// The stage's gradients and this rank's share of the loss: the mean over the replicas
  /// present (each stage's sum starts when its own schedule ends; the pipeline's report of the
  /// loss comes after).
  void reduce_over_replicas(StepResult& result) override;
  /// The leading replica's ranks, whichever replica leads.
  bool writes_stage_files() const override { return member_->manager().leads(); }
  /// What a replacement receives: its stage's parameters and buffers and their optimizer state.
  ReplicaState replica_state() override;

 private:
  comm::CommunicatorPtr replica_;
};

/// With --fault-tolerance replicas: InputError naming what a pipeline inside replicas does not
/// take (zero1 stages, --pipeline-sync 2bw/async, --pipeline-balance time; --stage-replicas is
/// check_fault_tolerance_layout's).
void check_pipeline_replicas(const pipeline::PipelineOptions& options);

}  // namespace dtrain::parallel::ft
