// `dtrain train --dry-run`: the run's memory per rank, as the planner counts it (setup, step,
// offload), against this machine's, before anything is built; exit 2 when it does not fit.
#include "DryRun.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include "Units.h"
#include "dtrain/common/Cpu.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/pipeline/PipelineOptions.h"
#include "dtrain/plan/ModelCost.h"
#include "dtrain/plan/Planner.h"
#include "dtrain/train/Job.h"

namespace dtrain::cli {

namespace {

double memory_total_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemTotal:") return kib * 1024;
    meminfo.ignore(256, '\n');
  }
  return static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE);
}

// The model as the planner counts it: a decoder layer by layer; any other model by its
// parameters alone (built: those are small), its activations not counted.
plan::ModelCost model_cost(const train::RunPlan& run, bool* activations_counted) {
  const models::ModelSpec spec = train::run_model_spec(run);
  const models::ModelInfo& info = models::model_info(spec.name);
  *activations_counted = info.language_model;
  if (info.language_model) {
    const models::GptConfig config = models::decoder_config(spec);
    return plan::decoder(config, spec.name, config.vocab, false);
  }
  models::ModelSpec probe = spec;
  probe.deferred = false;
  const Model model = models::make_model(probe);
  plan::ModelCost cost;
  cost.name = spec.name;
  plan::Layer whole;
  whole.name = spec.name;
  for (const auto& p : model.module->parameters()) whole.parameters += p.numel();
  cost.layers.push_back(whole);
  return cost;
}

std::string planned_strategy_of(const train::RunPlan& run) {
  const std::string& name = run.trainer.strategy;
  if (parallel::strategy_info(name).pipelines) {
    return run.trainer.strategy_options.of<parallel::pipeline::PipelineOptions>().data_parallel;
  }
  return name;
}

}  // namespace

int dry_run(const train::RunPlan& run) {
  const train::TrainerOptions& t = run.trainer;
  const std::string strategy = planned_strategy_of(run);
  const std::vector<std::string> modelled = plan::planned_strategies(true);
  std::printf("dtrain train --dry-run: %s on %d rank(s), strategy %s\n", run.job.model.name.c_str(),
              run.ranks, t.strategy.c_str());
  if (std::find(modelled.begin(), modelled.end(), strategy) == modelled.end()) {
    std::printf(
        "memory            not counted: the planner does not model --strategy %s (it "
        "models %zu: ddp, zero1, zero2, zero3 and pipelines of them)\n",
        t.strategy.c_str(), modelled.size());
    return 0;
  }
  const models::ModelSpec spec = train::run_model_spec(run);
  if (models::model_info(spec.name).language_model && spec.gpt.moe_experts > 0) {
    const models::GptConfig config = models::decoder_config(spec);
    std::printf(
        "experts           %.3f B parameters active per token of %.3f B (%lld experts, "
        "top-%lld)\n",
        static_cast<double>(models::gpt_active_parameter_count(config)) / 1e9,
        static_cast<double>(models::gpt_parameter_count(config)) / 1e9,
        static_cast<long long>(config.moe_experts), static_cast<long long>(config.moe_top_k));
  }
  bool activations = false;
  const plan::ModelCost model = model_cost(run, &activations);
  plan::Cluster cluster;
  plan::Hardware& hw = cluster.hardware;
  hw.name = "this machine";
  hw.device = cpu_info().model;
  hw.memory_bytes = memory_total_bytes();
  hw.shared_cores = true;  // the ranks share this machine's memory
  hw.gpus_per_node = run.ranks;
  // (Rates the step's time needs; the dry run reports memory only.)
  hw.peak_flops = {{"fp32", 1e11}, {"bf16", 1e11}, {"fp16", 1e11}};
  hw.memory_bandwidth_Bps = 1e10;
  hw.matmul_efficiency = hw.memory_efficiency = 1;
  hw.intra_node = hw.inter_node = {1e-5, 1e9};
  hw.disk_read_Bps = hw.disk_write_Bps = 1e9;
  cluster.gpus_per_node = run.ranks;
  plan::Layout layout;
  layout.strategy = strategy;
  layout.pp = t.pipeline_parallel;
  layout.tp = t.tensor_parallel;
  layout.ep = t.expert_parallel;
  layout.cp = t.context_parallel;
  layout.cp_method = run.job.model.gpt.cp_method;
  layout.dp = static_cast<int>(run.data_parallel);
  layout.micro_batch_size = static_cast<int>(t.batch_size);
  layout.micro_batches = static_cast<int>(run.batches.micro_batches);
  if (layout.pp > 1) {
    const auto& pipeline = t.strategy_options.of<parallel::pipeline::PipelineOptions>();
    layout.schedule = pipeline.schedule;
    layout.chunks = pipeline.virtual_stages;
  }
  const std::string& precision = t.strategy_options.precision;
  layout.precision = precision == "fp64" ? "fp32" : precision;
  const std::string& checkpointing = run.job.model.checkpointing;
  layout.selective_recompute = checkpointing == "selective";
  layout.checkpointing = checkpointing != "none" && checkpointing != "selective";
  layout.sequence_parallel = run.layout.sequence_parallel;
  const std::string& optimizer = t.optimizer.name;
  layout.optimizer = optimizer == "sgd" ? (t.optimizer.momentum > 0 ? "momentum" : "sgd") : "adam";
  const std::string& offload = t.optimizer.offload;
  layout.offload = offload.rfind("optimizer:", 0) == 0 ? "disk" : "none";
  layout.bucket_cap_bytes = t.strategy_options.bucket_cap_bytes;
  const plan::Prediction p = plan::predict(model, cluster, layout);
  const plan::Memory& m = p.memory;
  const double scale = precision == "fp64" ? 2.0 : 1.0;  // the planner counts fp32 at most
  const double has = plan::rank_memory_bytes(cluster);
  std::printf("layout            %s\n", layout.describe().c_str());
  std::printf("model             %.3f B parameters\n", model.parameters() / 1e9);
  std::printf(
      "memory per rank   step %.2f GiB (parameters %.2f, gradients %.2f, optimizer %.2f, "
      "activations %s, buffers %.2f), setup %.2f GiB\n",
      scale * m.total() / kGiB, scale * m.parameters / kGiB, scale * m.gradients / kGiB,
      scale * m.optimizer / kGiB, activations ? gib(scale * m.activations).c_str() : "not counted",
      scale * m.buffers / kGiB, scale * m.setup / kGiB);
  if (m.disk > 0) {
    std::printf("offloaded         %.2f GiB per rank in %s\n", scale * m.disk / kGiB,
                offload.substr(10).c_str());
  }
  std::printf("this machine      %.2f GiB of memory, %.2f GiB per rank (%d ranks share it)\n",
              hw.memory_bytes / kGiB, has / kGiB, run.ranks);
  std::fflush(stdout);
  DTRAIN_CHECK_INPUT(scale * m.peak() <= has, "--dry-run: the run does not fit: each rank needs ",
                     gib(scale * m.peak()), " GiB (", gib(scale * m.total()), " to step, ",
                     gib(scale * m.setup), " to set up), this machine has ", gib(has),
                     " GiB per rank (", gib(hw.memory_bytes), " GiB over ", run.ranks,
                     " ranks); more ranks, zero3, --offload optimizer:DIR or a smaller model");
  std::printf("fits              yes: %.0f%% of a rank's share\n", 100 * scale * m.peak() / has);
  return 0;
}

}  // namespace dtrain::cli
