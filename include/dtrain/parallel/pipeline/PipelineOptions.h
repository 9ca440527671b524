// The pipeline strategy's own options (StrategyOptions::of<pipeline::PipelineOptions>()); its
// flags are declared beside it (src/parallel/pipeline/PipelineStrategy.cpp).
#pragma once

#include <string>

namespace dtrain::parallel::pipeline {

struct PipelineOptions {
  /// "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2" or "zb-v"; the step's micro-batches are
  /// the pipeline's.
  std::string schedule = "1f1b";
  /// Model chunks per rank (interleaved; zb-v always runs 2): the model is cut into chunks x P
  /// virtual stages, rank r running virtual stages r, r + P, ... (zb-v: r and 2P - 1 - r)
  int virtual_stages = 1;
  /// Stages placed by "params" (parameter count), "time" (forward + backward time of each
  /// stage measured on the example batch, see Strategy::prepare) or "S1,S2,..." (stages per
  /// virtual stage).
  std::string balance = "params";
  /// How each stage's replicas share their work over the DP group: "ddp" (averaged gradients)
  /// or "zero1" (each replica keeps the optimizer state of its shard only). Set from --strategy
  /// by parallel::resolve_strategy.
  std::string data_parallel = "ddp";
  /// How activations and their gradients travel between stages: "auto" (shared memory between
  /// stages on the same machine, the communicator otherwise) or "comm" (always the
  /// communicator).
  std::string transport = "auto";
  /// How the pipeline's steps meet the weights: "flush" (every step drains the pipeline, then
  /// one synchronous update: exactly the single-process step) or "2bw" (PipeDream-2BW: no
  /// flush, each stage keeps two weight versions and applies a step's gradient, computed on the
  /// version before, when its own backwards of that step are done: W(t+1) = W(t) - lr *
  /// grad f(W(t-1)); 1f1b only) or "eager" (2bw's pipeline and two versions, but stage s
  /// updates as soon as its 1F1B schedule next needs the weights, after the backward of its
  /// micro-batch M - P + s of the step: every micro-batch computes on the newest weights, and
  /// only the gradients of the step's last P - 1 - s micro-batches, whose backwards come after
  /// that update, are one step stale (they join the next update): W_s(t+1) = W_s(t) - lr *
  /// (head_s(t) + tail_s(t-1)), the last stage synchronous; 1f1b only) or "async" (PipeDream:
  /// no flush, an update after each micro-batch's backward, which computes on the weights its
  /// forward used; 1f1b only).
  std::string sync = "flush";
  /// 2bw: the weights each batch computes on. "none": the version before the newest, W(t - 1)
  /// (PipeDream-2BW's rule: the gradient one step stale); "extrapolate": that version moved on
  /// by the last step it took, 2 W(t - 1) - W(t - 2) (weight prediction, as SpecTrain: for SGD
  /// with momentum, W(t - 1) - lr * its velocity), which estimates W(t), the weights the
  /// gradient is applied to. One more weight copy per stage.
  std::string weight_prediction = "none";
};

}  // namespace dtrain::parallel::pipeline
