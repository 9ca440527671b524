// `dtrain train`'s flags, a table of declarations: each binds a JobConfig field, with its help
// line (docs/guide/train.md explains them).
#include "TrainFlags.h"

#include <cstdio>
#include <string>

#include "CommonFlags.h"
#include "ConfigFile.h"
#include "NumericOptions.h"
#include "dtrain/common/Error.h"
#include "dtrain/data/Datasets.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/Strategies.h"

namespace dtrain::cli {

void add_train_options(CLI::App& app, dtrain::train::JobConfig& job,
                       dtrain::FlagSet& strategy_flags) {
  auto& t = job.trainer;
  // A flag given twice (config file, then command line) keeps the last value.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  add_config_option(app);
  // From the registries, so that they cannot drift: the names, then (--help-all) each one's line.
  std::string models, described;
  for (const std::string& name : dtrain::models::model_names()) {
    models += (models.empty() ? "" : ", ") + name;
    described += "; " + name + ": " + dtrain::models::model_info(name).summary;
  }
  models += described;
  add_model_flags(
      app, job.model,
      models +
          ". Each trains with its own recipe unless flags say otherwise: the "
          "optimizer, lr, momentum, weight decay, lr decay, warmup, batch size and clipping shown "
          "here are the image models'; gpt's is adamw at 0.002, weight decay 0.1, batch 32, "
          "clipping 1.0. An optimizer other than the recipe's trains at its own lr and weight "
          "decay (PyTorch's: adam 0.001, adamw 0.001 and 0.01, sgd 0.001, adagrad 0.01) unless "
          "given. docs/guide/train.md describes each model",
      [](const dtrain::models::ModelInfo&) { return true; });
  app.add_flag("--sequence-parallel", job.model.gpt.sequence_parallel,
               "gpt, llama with --tensor-parallel: split norm, dropout and residual activations "
               "along the sequence too (Megatron's sequence parallelism; --context a multiple "
               "of T)");
  app.add_flag("--tp-comm-overlap", job.model.gpt.tp_comm_overlap,
               "gpt, llama with --tensor-parallel: the column-parallel layers' backward overlaps "
               "the input gradient's allreduce (reduce-scatter) with the weight gradient "
               "(Megatron's asynchronous tensor-parallel communication)");
  std::string datasets = dtrain::data::dataset_names_where([](const auto&) { return true; });
  for (const auto& info : dtrain::data::datasets())
    datasets += "; " + info.name + ": " + info.summary;
  add_data_flags(
      app, job.dataset, job.data, datasets, [](const dtrain::data::DatasetInfo&) { return true; },
      [](FlagSet& flags) { add_to_help(flags, "--image-size", " (--augment's crop)"); });
  std::string strategies;
  for (const auto& name : dtrain::parallel::strategy_names()) {
    strategies += (strategies.empty() ? "" : ", ") + name;
  }
  add(app, "--strategy", t.strategy, "Parallel strategy: " + strategies)->capture_default_str();
  add(app, "--pipeline-parallel", t.pipeline_parallel,
      "Pipeline stages: the model's stages are split over this many ranks (the rest of the "
      "world makes each stage data-parallel with --strategy ddp or zero1)")
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--stage-replicas",
         [&t](const std::string& text) {
           t.stage_replicas.clear();
           size_t begin = 0;
           while (begin <= text.size()) {
             const size_t end = std::min(text.find(',', begin), text.size());
             const std::string count = text.substr(begin, end - begin);
             int value = 0;
             char tail = 0;
             DTRAIN_CHECK_INPUT(
                 std::sscanf(count.c_str(), "%d%c", &value, &tail) == 1 && value >= 1,
                 "--stage-replicas '", text, "': expected replica counts R0,R1,... (each >= 1)");
             t.stage_replicas.push_back(value);
             begin = end + 1;
           }
         },
         "PipeDream's layouts: a pipeline whose stage s runs on R_s ranks (R0,R1,...; the world "
         "is their sum), each stage's replicas taking its micro-batches in turn and averaging "
         "their gradients (sets --pipeline-parallel; gpipe, 1f1b, zb-h1 or zb-h2, ddp; dtrain "
         "plan --search --stage-replicas prints them)")
      ->type_name("R0,R1,...");
  add(app, "--tensor-parallel", t.tensor_parallel,
      "Tensor-parallel ranks: each layer's matrices are split over this many ranks (Megatron-"
      "style; --model gpt). With --pipeline-parallel P the world is DP x P x T")
      ->capture_default_str();
  add(app, "--expert-parallel", t.expert_parallel,
      "Expert-parallel ranks: a mixture of experts' experts (--moe-experts) are split over this "
      "many data-parallel ranks, tokens sent to their experts' ranks and back by all-to-all; it "
      "must divide the data-parallel size and --moe-experts (--strategy ddp, zero1 or zero2)")
      ->capture_default_str();
  add(app, "--context-parallel", t.context_parallel,
      "Context-parallel ranks: each sequence split over this many data-parallel ranks, which "
      "read the same examples, attention spanning the whole sequence by --cp-method (gpt, "
      "llama; --context a multiple of 2 x this; --strategy ddp, zero1, zero2, zero3 or a "
      "pipeline's)")
      ->capture_default_str();
  add(app, "--cp-method", job.model.gpt.cp_method,
      "--context-parallel: ring (keys and values passed around the ranks, partial results "
      "merged by log-sum-exp), allgather (gathered once a layer, as Llama 3 trained) or "
      "ulysses (an all-to-all from the sequence split to a head split; the heads of a rank "
      "must be a multiple of --context-parallel)")
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--cp-split",
         [&job](const std::string& text) {
           DTRAIN_CHECK_INPUT(text == "zigzag" || text == "contiguous",
                              "--cp-split must be zigzag or contiguous, got '", text, "'");
           job.model.gpt.cp_zigzag = text == "zigzag";
         },
         "--context-parallel: zigzag (each rank two mirrored chunks of 2 x C, the same causal "
         "work everywhere; the default) or contiguous (chunk r on rank r)")
      ->type_name("zigzag|contiguous");
  app.add_flag("--reset-attention-mask", job.reset_attention_mask,
               "gpt, llama: packed sequences: attention stays inside each document of a window "
               "and positions restart after each end-of-document token (Megatron's "
               "--reset-attention-mask and --reset-position-ids; the token: --eod-token, else "
               "the tokenizer's end of text)");
  add(app, "--eod-token", job.eod_token,
      "--reset-attention-mask: the end-of-document token's id (-1: the data's tokenizer's)")
      ->capture_default_str();
  add(app, "--moe-bias-rate", t.moe_bias_rate,
      "A mixture of experts' auxiliary-loss-free balancing (DeepSeek-V3's, which used 0.001): "
      "after each step every MoE layer's expert bias moves by this towards the experts the "
      "step's tokens (summed over the data-parallel ranks) chose least (0: off)")
      ->capture_default_str();
  // Each strategy's own flags (Registry.h): --ps, --n-fetch, --schedule, --zero3-..., ...
  dtrain::parallel::declare_strategy_flags(strategy_flags, t.strategy_options);
  add_flags(app, strategy_flags);
  add(app, "--ps-shards", job.ps_shards,
      "--strategy downpour/sandblaster: start this many parameter-server shards here, in the "
      "launching "
      "process (instead of --ps)")
      ->capture_default_str();
  add(app, "--ps-optimizer", job.ps_optimizer,
      "--ps-shards: the shards' optimizer (adagrad, sgd or adam)")
      ->capture_default_str();
  add(app, "--ps-lr", job.ps_lr,
      "--ps-shards: the shards' learning rate (the job's decay and warmup become their "
      "schedule, by version)")
      ->capture_default_str();
  add(app, "--ps-auth-token-file", job.ps_auth_token_file,
      "--strategy downpour/sandblaster: file holding the shards' token (sent with every call; "
      "--ps-shards "
      "shards require it)");
  app.add_option_function<std::string>(
      "--simulate-slowdown",
      [&t](const std::string& text) {
        int rank = -1;
        double factor = 0;
        char tail = 0;
        std::string rate = text;
        const bool spin = text.size() > 5 && text.compare(text.size() - 5, 5, ":spin") == 0;
        if (spin) rate.resize(text.size() - 5);
        DTRAIN_CHECK_INPUT(std::sscanf(rate.c_str(), "%d:%lf%c", &rank, &factor, &tail) == 2 &&
                               rank >= 0 && factor >= 1 && std::isfinite(factor),
                           "--simulate-slowdown '", text,
                           "': expected RANK:FACTOR[:spin] with RANK >= 0 and FACTOR >= 1");
        t.slowdown_rank = rank;
        t.slowdown_factor = factor;
        t.slowdown_spin = spin;
      },
      "RANK:FACTOR[:spin]: rank RANK takes FACTOR times as long per step (a straggler, for "
      "testing): it sleeps the difference, or with :spin keeps its core busy (a slow "
      "machine's capacity is lost)");
  add(app, "--micro-batches", job.micro_batches,
      "Micro-batches per optimizer step (the pipeline's M; sets --accumulation)");
  add(app, "--trace", t.trace_file,
      "Write a Chrome/Perfetto trace of every rank (forward, backward, recv, sync, optimizer "
      "spans) to this file; scripts/plot-timeline draws it");
  add(app, "--nproc", job.nproc, "Local ranks to launch")->capture_default_str();
  add_threads_flag(app, job.threads, "cores / ranks");
  add(app, "--interface", job.interface,
      "Network interface for rank-to-rank traffic (default: the one that reaches MASTER_ADDR)");
  add(app, "--max-restarts", job.max_restarts,
      "With --nproc: restart the ranks this many times after a failure, resuming from the "
      "newest checkpoint")
      ->capture_default_str();
  add(app, "--backend", job.backend, "Communication backend: gloo, nccl")->capture_default_str();
  add(app, "--comm-timeout", job.comm_timeout_ms, "Timeout of every collective (ms)")
      ->capture_default_str();
  add(app, "--epochs", t.epochs, "Epochs")->capture_default_str();
  add(app, "--batch-size", t.batch_size, "Examples per rank per micro-batch")
      ->capture_default_str();
  add(app, "--accumulation", t.accumulation_steps,
      "Micro-batches per optimizer step (gradient accumulation)")
      ->capture_default_str();
  add(app, "--global-batch", t.global_batch,
      "Examples per optimizer step at any world size: sets --accumulation to this / "
      "(batch size x ranks); elastic jobs keep their step and data order across sizes "
      "(0 = batch size x accumulation x ranks)")
      ->capture_default_str();
  add(app, "--max-steps", t.max_steps, "Train this many steps (0 = all epochs)")
      ->capture_default_str();
  add(app, "--stop-at-step", t.stop_at_step,
      "Checkpoint and halt at this step, keeping the schedule (resume later)")
      ->capture_default_str();
  add(app, "--optimizer", t.optimizer.name, "sgd, adam, adamw, adagrad")->capture_default_str();
  add_sgd_flags(app, t.optimizer.lr, t.optimizer.momentum, t.optimizer.weight_decay, "");
  app.add_flag("--nesterov", t.optimizer.nesterov, "Nesterov momentum (SGD)");
  app.add_flag_callback(
      "--check-collectives",
      [] { setenv("DTRAIN_CHECK_COLLECTIVES", "1", 1); },  // every rank inherits it
      "Before each collective the ranks compare what they call (op, size, dtype, root): a "
      "mismatch is an error naming the group, the ranks and each one's call, not a hang or "
      "wrong numbers (as TORCH_DISTRIBUTED_DEBUG=DETAIL; Gloo; costs a small allgather per "
      "collective). Or set DTRAIN_CHECK_COLLECTIVES=1");
  add(app, "--offload", t.optimizer.offload,
      "Where the optimizer's state lives: none; optimizer (host memory: with parameters on a "
      "GPU, host master copies and the step on the CPU, as ZeRO-Offload); optimizer:DIR (a "
      "file under DIR read and written bucket by bucket, as ZeRO-Infinity: for a model whose "
      "state does not fit in memory)")
      ->capture_default_str();
  add(app, "--offload-bucket-mb", t.optimizer.offload_bucket_mb,
      "--offload: parameters per bucket, in MiB of float32 (the state in memory during the "
      "step is about three buckets')")
      ->capture_default_str();
  add(app, "--freeze-variance-after", t.optimizer.freeze_variance_after,
      "adam, adamw: keep the second moment as it is after this many steps (1-bit Adam's "
      "freeze step: the rule turns linear in the gradients; 0 = never)")
      ->capture_default_str();
  add(app, "--lr-decay", t.schedule.decay, "constant, step, cosine")->capture_default_str();
  add(app, "--warmup-steps", t.schedule.warmup_steps, "Linear warmup steps")->capture_default_str();
  add(app, "--lr-step-size", t.schedule.step_size, "Steps between step decays")
      ->capture_default_str();
  add(app, "--lr-gamma", t.schedule.gamma, "Step decay factor")->capture_default_str();
  add(app, "--reference-batch", t.reference_batch,
      "Linear scaling rule: lr x global batch / this (0 = off)")
      ->capture_default_str();
  add(app, "--max-nonfinite-steps", t.max_nonfinite_steps,
      "Stop with an error after this many consecutive steps with a non-finite loss or gradient "
      "norm (0 = never)")
      ->capture_default_str();
  add(app, "--max-grad-norm", t.strategy_options.max_grad_norm,
      "Clip gradients to this global norm (0 = off)")
      ->capture_default_str();
  add(app, "--bucket-cap-mb", job.bucket_cap_mb, "Gradient bucket size in MiB")
      ->capture_default_str();
  add(app, "--grad-compression", t.strategy_options.grad_compression,
      "Gradient compression: none, fp16, bf16 (wire dtype), "
      "powersgd:RANK[:START_STEP[:MIN_RATE[:fp16|bf16]]] (low rank with error feedback, the "
      "factors optionally sent in 16 bits; ddp, zero1, pipelines)")
      ->capture_default_str();
  app.add_flag("--hierarchical-allreduce", t.strategy_options.hierarchical_allreduce,
               "Allreduce gradients inside each host first, then across hosts, then inside "
               "again (ddp, zero1, pipelines; not with powersgd)");
  add(app, "--ranks-per-host", t.strategy_options.ranks_per_host,
      "Ranks of one host for --hierarchical-allreduce (0 = the launcher's LOCAL_WORLD_SIZE)")
      ->capture_default_str();
  app.add_flag("--error-on-unused-parameters", t.strategy_options.error_on_unused_parameters,
               "Fail a step when a parameter gets no gradient (default: treat as zero)");
  add(app, "--device", t.strategy_options.device,
      "cpu, cuda (this rank's GPU: LOCAL_RANK modulo the GPUs) or cuda:N")
      ->capture_default_str();
  add(app, "--precision", t.strategy_options.precision,
      "fp32, bf16-mixed, fp16-mixed, bf16 or bf16-master. bf16-mixed: autocast over fp32 "
      "weights; fp16-mixed: the same in fp16 (CUDA only); bf16: everything, the optimizer state "
      "too; bf16-master (ddp, zero1, zero2, zero3: a bf16 model, gradients "
      "accumulated and reduced in fp32, fp32 master weights in the (sharded) optimizer, "
      "checkpoints of the master weights: Megatron's layout)")
      ->capture_default_str();
  add(app, "--loss-scaling", t.strategy_options.loss_scaling,
      "auto (dynamic for fp16-mixed), dynamic, none")
      ->capture_default_str();
  add(app, "--checkpointing", job.model.checkpointing,
      "Activation checkpointing: none, sqrt, a segment count, or selective (gpt, llama: "
      "recompute only attention's core, keeping the rest)")
      ->capture_default_str();
  add_seed_flag(app, t.seed, "model, data order");
  add_run_flags(app, t.checkpoint_dir, t.eval_every, t.progress, "Directory for checkpoints",
                "steps (0 = epoch ends only)");
  add(app, "--eval-batch-size", t.eval_batch_size,
      "Examples per evaluation forward (0 = 256, or for token windows as many as hold 16384 "
      "tokens, at least --batch-size)")
      ->capture_default_str();
  add(app, "--checkpoint-every", t.checkpoint_every,
      "Also checkpoint every N steps (0 = epoch ends only)")
      ->capture_default_str();
  add(app, "--keep-checkpoints", t.keep_checkpoints, "Checkpoints to keep")->capture_default_str();
  app.add_flag("--async-checkpoint", t.async_checkpoint,
               "Write checkpoints in the background: a save copies the state to host memory "
               "and training goes on while a thread writes, verifies and publishes it");
  app.add_flag("!--no-resume", t.resume, "Start fresh even if --checkpoint-dir has one");
  add(app, "--init-from", t.init_from,
      "Start from these weights: a checkpoint (directory or root) of any strategy and world "
      "size, a consolidated file (dtrain ckpt consolidate, dtrain fl --save-model), or "
      "safetensors (a file, or a folder as Hugging Face saves one: a Llama's config.json must "
      "agree with the model's flags; any tensor-parallel layout)");
  app.add_flag("--allow-non-finite-weights", t.allow_non_finite_weights,
               "Load --init-from's weights even where they hold NaN or Inf (refused otherwise)");
  add(app, "--metrics", t.metrics_file, "JSONL metrics file");
  add(app, "--tensorboard", t.tensorboard_dir,
      "Also write TensorBoard event files in DIR: every number of the metrics file (train/loss, "
      "train/lr, eval/val_loss, ...) and the configuration as text (tensorboard --logdir DIR)");
  add(app, "--run-dir", job.run_dir,
      "The run's folder: metrics.jsonl, config.toml (the options given), command.txt and "
      "checkpoints/ (unless --metrics or --checkpoint-dir say otherwise). Without it, and "
      "without --metrics or --checkpoint-dir, runs/MODEL-DATE-TIME gets the metrics, config and "
      "command");
  app.add_flag("--no-run-dir", job.no_run_dir, "No run folder by default");
  app.add_flag("--defer-eval", t.defer_eval,
               "Evaluate after training, on copies of the parameters taken at each evaluation "
               "point (recorded with their moment's clock: time to accuracy without the "
               "evaluations)");
  app.add_flag("--sync-batchnorm", t.sync_batchnorm,
               "BatchNorm statistics over the data-parallel ranks (as torch.nn.SyncBatchNorm: "
               "N ranks train as one process on the global batch; the ResNets)");
  add(app, "--log-every", t.log_every,
      "Steps between metrics records (and progress lines off a terminal)")
      ->capture_default_str();
  add(app, "--peak-tflops", t.peak_tflops,
      "One device's peak TFLOP/s at the run's precision (e.g. 989 for an H100 SXM in bf16): "
      "language models then report their model FLOPs utilization (MFU) beside their FLOP/s");
}

}  // namespace dtrain::cli
