// The command line as a user runs it: every subcommand's help and bad input, the parameter
// server's commands, configs and recipes, training end to end (real processes, exit codes,
// messages).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <string>
#include <thread>

#include <ATen/ATen.h>
#include <torch/version.h>

#include "CliRuns.h"
#include "TempDir.h"
#include "dtrain/common/Error.h"
#include "dtrain/common/Net.h"
#include "dtrain/launch/Environment.h"
#include "dtrain/parallel/StateShards.h"
#include "dtrain/train/Checkpoint.h"

using dtrain::test::TempDir;
using namespace dtrain::test::cli;

namespace {

// Field `key` of every `event` record of a metrics file, in order.
std::vector<double> metric_values(const std::string& path, const std::string& event,
                                  const std::string& key) {
  std::vector<double> values;
  std::ifstream metrics(path);
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("event", "") == event) values.push_back(record[key].get<double>());
  }
  return values;
}

}  // namespace

TEST(Cli, HelpOnEverySubcommand) {
  for (const std::string sub : {"", " train", " launch", " ckpt consolidate", " ckpt export",
                                " ckpt inspect", " ckpt verify", " ps serve", " plan", " generate",
                                " data prepare", " data tokenizer train"}) {
    const auto out = run(kDtrain + sub + " --help");
    EXPECT_EQ(out.code, 0) << sub;
    EXPECT_TRUE(has(out, "Usage:")) << sub;
  }
  EXPECT_TRUE(has(run(kDtrain + " train --help"), "--checkpoint-dir"));
  // --version: the build and the machine, as benchmark records are stamped (bench/report.py).
  const auto version = run(kDtrain + " --version");
  EXPECT_EQ(version.code, 0) << version.text;
  EXPECT_TRUE(has(version, "dtrain ") && has(version, "\nLibTorch ") && has(version, "\nCPU "))
      << version.text;
  // The data sets --help offers are the registry's.
  const auto train = run(kDtrain + " train --help");
  EXPECT_TRUE(has(train, "fashion-mnist, synthetic, text, tokens"));
  // Its groups in the order a user sets a run up, each group's flags in the listed order (not
  // the order they were added in): the model, its data, the batch and optimizer, ... output.
  size_t at = 0;
  for (const char* heading :
       {"\nOptions:\n", "\nModel:\n  --model ", "\nData:\n  --dataset ",
        "\nBatch, optimizer and schedule:\n  --epochs ", "\nProcesses:\n  --nproc ",
        "\nParallelism:\n  --strategy ", "\nPrecision and memory:\n  --precision ",
        "\nFailures:\n  --max-restarts ", "\nCheckpoints:\n  --checkpoint-dir ",
        "\nOutput:\n  --run-dir "}) {
    const size_t found = train.text.find(heading, at);
    EXPECT_NE(found, std::string::npos) << heading << " after offset " << at << "\n" << train.text;
    if (found != std::string::npos) at = found;
  }
}

TEST(Cli, BadInputIsOneClearLineAndExitCode2) {
  TempDir dir;
  std::filesystem::create_directories(dir / "damaged");
  std::ofstream(dir / "damaged/shard-0-of-1.pt") << "not a checkpoint";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {" train --bogus", "--bogus"},
      {" train --lr abc", "--lr"},
      {" train --model transformer9", "unknown model 'transformer9'"},
      {" train --strategy zero9", "unknown strategy 'zero9'"},
      {" train --epochs 0", "epochs must be >= 1"},
      {" train --lr -1", "learning rate must be > 0"},
      {" train --data-dir " + dir.path() + "/none", dir.path() + "/none does not exist"},
      {" train --data-dir " + dir.path(), "train"},  // an empty directory: no IDX files
      {" train --checkpoint-dir /proc/forbidden", "/proc/forbidden"},
      {" train --config " + dir.path() + "/missing.toml", "missing.toml cannot be read"},
      {" train --grad-compression int4", "unknown gradient compression 'int4'"},
      {" train --precision fp16-mixed", "use --precision bf16-mixed"},
      {" train --device gpu", "unknown device 'gpu' (expected cpu, cuda or cuda:N)"},
      {" train --zero3-min-unit-params -5", "--zero3-min-unit-params must be >= 0, got -5"},
      // Numbers are checked whole, in range and finite, for every numeric flag.
      {" train --bucket-cap-mb abc", "--bucket-cap-mb: expects a number, got 'abc'"},
      {" train --bucket-cap-mb 0", "--bucket-cap-mb must be in (0, 1048576]"},
      {" train --lr inf", "--lr: expects a finite number, got 'inf'"},
      {" train --lr nan", "--lr: expects a finite number"},
      {" train --lr 1e999", "--lr: '1e999' is out of range"},
      {" train --lr 0.1x", "--lr: expects a number, got '0.1x'"},
      {" train --epochs 99999999999999999999", "--epochs: '99999999999999999999' is out of range"},
      {" train --nproc 4294967297", "--nproc: '4294967297' is out of range"},
      {" train --seed -1", "--seed: expects a whole number >= 0, got '-1'"},
      {" train --hidden 32 x", "--hidden: expects a whole number, got 'x'"},
      {" train --keep-checkpoints -2", "checkpoints to keep must be >= 0"},
      {" train --max-nonfinite-steps -1", "max non-finite steps must be >= 0"},
      {" train --config " + dir.path(), "is a directory, not a TOML file"},
      {" ckpt verify " + dir.path() + "/none", "neither a checkpoint"},
      {" train --strategy zero3 --grad-compression fp16", "zero3 reduce-scatters gradients"},
      {" train --precision fp8", "unknown precision 'fp8'"},
      {" train --checkpointing lots", "--checkpointing must be none, sqrt or a segment count"},
      {" train --model mlp --checkpointing selective", "gpt and llama models only"},
      {" train --strategy zero3 --fault-tolerance replicas",
       "--fault-tolerance replicas is built for --strategy ddp, zero1, zero2 or diloco, not zero3"},
      {" train --fault-tolerance sometimes", "--fault-tolerance must be none or replicas"},
      // Another strategy's flag would change nothing: refused, naming whose it is.
      {" train --outer-lr 0.5",
       "--outer-lr is --strategy diloco's option; this run (ddp) would "
       "not use it: leave it out"},
      {" train --strategy zero1 --zero3-min-unit-params 5",
       "--zero3-min-unit-params is --strategy zero3's option; this run (zero1)"},
      {" train --schedule gpipe", "--schedule is a pipeline's (--pipeline-parallel > 1) option"},
      {" train --peak-tflops -3", "--peak-tflops must be a positive number of TFLOP/s, got -3"},
      {" train --max-replacements 3",
       "--max-replacements, --replica-heartbeat-timeout, --replica-shards and "
       "--shard-across-replicas apply with --fault-tolerance replicas"},
      {" train --fault-tolerance replicas --replica-heartbeat-timeout 0.01",
       "--replica-heartbeat-timeout must be in [0.1, 3600] seconds, got 0.01"},
      {" train --model gpt --dataset text --tp-comm-overlap",
       "--tp-comm-overlap overlaps tensor parallelism's communication: it needs"},
      {" train --strategy zero3 --overlap-param-gather",
       "use --strategy zero1 or zero2 (with or without a pipeline), not zero3"},
      {" train --model mlp --fault-tolerance replicas --pipeline-parallel 2 --nproc 4 "
       "--micro-batches 2 --pipeline-balance time",
       "--pipeline-balance time measures on each replica"},
      {" train --loss-scaling maybe", "unknown loss scaling 'maybe'"},
      {" train --global-batch 64 --accumulation 2", "not both"},
      {" train --dataset synthetic --global-batch 100 --batch-size 32",
       "global batch 100 is not a whole number of micro-batches of 32 x 1"},
      {" train --pipeline-parallel 3 --nproc 4",
       "--pipeline-parallel 3 does not divide the 4 ranks"},
      {" train --model mlp --tensor-parallel 2 --nproc 2", "--tensor-parallel 2 needs --model gpt"},
      {" train --model gpt --dataset text --tensor-parallel 3 --nproc 3",
       "--tensor-parallel 3 must divide --heads (4)"},
      {" train --model gpt --dataset text --tensor-parallel 2 --nproc 3",
       "--nproc 3 is not a multiple of --tensor-parallel 2"},
      {" train --model gpt --dataset text --sequence-parallel --nproc 2",
       "--sequence-parallel splits the sequence over the tensor-parallel ranks"},
      {" train --model gpt --dataset text --moe-experts 4",
       "--moe-experts: the experts are SwiGLU MLPs: use --model llama"},
      {" train --model llama --dataset text --moe-experts 4 --moe-top-k 5",
       "--moe-top-k must be in [1, 4]"},
      {" train --model llama --dataset text --moe-experts 4 --checkpointing 2",
       "--moe-aux-loss / --moe-z-loss with --checkpointing 2"},
      {" train --model llama --dataset text --moe-experts 4 --tensor-parallel 2 --nproc 2 "
       "--sequence-parallel",
       "--moe-aux-loss / --moe-z-loss with --sequence-parallel: not built yet"},
      {" train --model llama --dataset text --moe-experts 4 --nproc 4 --micro-batches 2 "
       "--pipeline-parallel 2 --expert-parallel 2 --pipeline-sync 2bw --max-grad-norm 0",
       "--pipeline-sync 2bw with --expert-parallel: not built yet (use flush)"},
      {" train --model llama --dataset text --moe-bias-rate 0.001",
       "--moe-bias-rate balances a mixture of experts: it needs --moe-experts"},
      {" train --model llama --dataset text --moe-experts 4 --moe-bias-rate -1",
       "--moe-bias-rate must be >= 0, got -1"},
      {" train --model llama --dataset text --expert-parallel 2 --nproc 2",
       "--expert-parallel 2 splits a mixture of experts: it needs --model llama --moe-experts E"},
      {" train --model llama --dataset text --moe-experts 3 --expert-parallel 2 --nproc 2",
       "--moe-experts (3) must be a multiple of --expert-parallel (2)"},
      {" train --model llama --dataset text --moe-experts 4 --expert-parallel 4 --nproc 2",
       "--expert-parallel 4 must divide the data-parallel size 2 (--nproc 2)"},
      {" train --model llama --dataset text --moe-experts 4 --expert-parallel 2 --nproc 2 "
       "--strategy diloco",
       "--expert-parallel is built for --strategy ddp, zero1, zero2, zero3 or pipeline so far, "
       "not diloco"},
      {" train --model llama --dataset text --eod-token 3",
       "--eod-token is --reset-attention-mask's end-of-document token: give both"},
      {" train --model mlp --reset-attention-mask --eod-token 3",
       "--reset-attention-mask packs documents into a language model's sequences, not mlp's"},
      {" train --model llama --dataset text --context-parallel 3 --nproc 4",
       "--context-parallel 3 must divide the data-parallel size 4"},
      {" train --model llama --dataset text --context 60 --context-parallel 4 --nproc 4",
       "--context-parallel 4 cuts the --context of 60 tokens into 8 chunks (two mirrored ones a "
       "rank: --cp-split zigzag): it must be a multiple of 8"},
      {" train --model llama --dataset text --heads 2 --width 64 --context-parallel 4 --nproc 4 "
       "--cp-method ulysses",
       "--cp-method ulysses hands the 2 attention heads of a rank out over --context-parallel 4"},
      {" train --model llama --dataset text --context-parallel 2 --nproc 2 --cp-method striped",
       "--cp-method must be ring, allgather or ulysses, got 'striped'"},
      {" train --model llama --dataset text --cp-split diagonal",
       "--cp-split must be zigzag or contiguous, got 'diagonal'"},
      {" train --model mlp --eval-batch-size -1",
       "--eval-batch-size must be >= 1 (or 0: by the examples' size), got -1"},
      {" train --model mlp --context-parallel 2 --nproc 2",
       "--context-parallel 2 splits each sequence: mlp has no sequence to split"},
      {" train --model llama --dataset text --context-parallel 2 --nproc 2 --strategy diloco",
       "--context-parallel is built for --strategy ddp, zero1, zero2, zero3 or pipeline so far, "
       "not diloco"},
      {" train --model llama --dataset text --context-parallel 2 --nproc 4 --pipeline-parallel 2 "
       "--micro-batches 2 --pipeline-sync 2bw --max-grad-norm 0",
       "--pipeline-sync 2bw with --context-parallel: not built yet (use flush)"},
      {" train --model gpt --dataset text --tensor-parallel 2 --nproc 2 --strategy zero3 "
       "--sequence-parallel",
       "use --strategy ddp, zero1 or zero2, not zero3"},
      {" train --model mlp --pipeline-parallel 4 --nproc 4 --schedule gpipe",
       "needs 4 model stages, but --model mlp has 3"},
      {" train --model mlp --pipeline-parallel 2 --nproc 2",
       "the 1f1b schedule needs at least as many micro-batches as pipeline stages"},
      {" train --model mlp --pipeline-parallel 2 --nproc 2 --micro-batches 3 --schedule "
       "interleaved --virtual-stages 2",
       "micro-batches (3) to be a multiple of"},
      {" train --pipeline-parallel 2 --nproc 2 --strategy zero3",
       "--pipeline-parallel combines with --strategy ddp or zero1"},
      {" train --schedule zigzag", "unknown pipeline schedule 'zigzag'"},
      {" train --virtual-stages 2", "--virtual-stages 2 needs --schedule interleaved"},
      {" train --schedule zb-v --virtual-stages 3", "--schedule zb-v runs 2 chunks per rank"},
      {" train --pipeline-sync sometimes", "unknown --pipeline-sync 'sometimes'"},
      {" train --pipeline-sync 2bw --schedule gpipe", "use --schedule 1f1b, not gpipe"},
      {" train --pipeline-sync 2bw --weight-prediction guess",
       "unknown --weight-prediction 'guess' (expected none or extrapolate)"},
      {" train --weight-prediction extrapolate",
       "--weight-prediction extrapolate is for --pipeline-sync 2bw, not flush"},
      {" train --model mlp --pipeline-parallel 2 --nproc 2 --micro-batches 2 --pipeline-sync "
       "2bw --max-grad-norm 1",
       "global-norm clipping (--max-grad-norm) needs every stage's gradients"},
      {" train --model mlp --pipeline-parallel 2 --nproc 2 --micro-batches 2 --schedule zb-v",
       "needs 4 model stages, but --model mlp has 3"},
      {" train --model mlp --pipeline-parallel 2 --nproc 2 --micro-batches 3 --schedule dualpipev",
       "the dualpipev schedule needs at least twice as many micro-batches"},
      {" train --model llama --dataset text --pipeline-parallel 2 --nproc 2 --micro-batches 4 "
       "--schedule dualpipev --checkpointing 2 --dropout 0.1",
       "--schedule dualpipev with --checkpointing of whole blocks and --dropout or "
       "--reset-attention-mask: not built yet"},
      {" train --micro-batches 4 --accumulation 2", "not two of them"},
      {" train --pipeline-balance 1,x", "unknown --pipeline-balance '1,x'"},
      {" train --model mlp --pipeline-parallel 2 --nproc 2 --micro-batches 2 --pipeline-balance "
       "1,1",
       "places 2 stages, the model has 3"},
      {" train --pipeline-parallel 0", "--pipeline-parallel must be >= 1"},
      {" train --stage-replicas 2,x", "--stage-replicas '2,x': expected replica counts"},
      {" train --stage-replicas 2,0", "--stage-replicas '2,0': expected replica counts"},
      {" train --stage-replicas 2", "--stage-replicas names 1 stage"},
      {" train --model mlp --stage-replicas 2,1 --nproc 4 --micro-batches 2",
       "--stage-replicas adds up to 3 ranks, but --nproc is 4"},
      {" train --model mlp --stage-replicas 2,1 --pipeline-parallel 3 --nproc 3",
       "--pipeline-parallel 3 but --stage-replicas names 2 stages"},
      {" train --model mlp --stage-replicas 3,1 --nproc 4 --micro-batches 2",
       "gives a stage 3 replicas but a step has 2 micro-batches"},
      {" train --model mlp --stage-replicas 2,1 --nproc 3 --micro-batches 4 --schedule "
       "interleaved --virtual-stages 2",
       "--stage-replicas runs one chunk per stage"},
      {" train --model mlp --stage-replicas 2,1 --nproc 3 --micro-batches 4 --pipeline-sync 2bw",
       "--stage-replicas runs with --pipeline-sync flush, not 2bw"},
      {" train --model mlp --stage-replicas 2,1 --nproc 3 --micro-batches 4 --strategy zero1",
       "--stage-replicas replicates stages with ddp, not zero1"},
      {" launch --nnodes 2:1 -- true", "--nnodes 2:1: MIN:MAX needs 1 <= MIN <= MAX"},
      {" launch --nnodes 0:2 -- true", "MIN:MAX needs 1 <= MIN <= MAX"},
      {" launch --nnodes a:2 -- true", "--nnodes: expects N or MIN:MAX"},
      {" launch --nnodes 2 -- true", "--node-rank is required with --nnodes > 1"},
      {" launch --nnodes 1:2 --node-rank 1 --master-port 1234 -- true",
       "give --node-rank 0 on the node that hosts the rendezvous"},
      {" launch --standalone --nnodes 1:2 -- true", "--standalone is one node"},
      {" launch --nproc-per-node many -- true",
       "--nproc-per-node: expects a number of ranks >= 1, auto, cpu or gpu; got 'many'"},
      {" train --model mlp --tensorboard /proc/dtrain-tensorboard",
       "--tensorboard /proc/dtrain-tensorboard: cannot create it"},
      {" status " + dir.path() + "/no-run", "no such folder or file"},
      {" status " + dir.path(), "no metrics.jsonl in it"},
      // An unknown flag or command: named, with the nearest one there is.
      {" train --max-step 5", "train: unknown flag --max-step (did you mean --max-steps?)"},
      {" trian --epochs 1", "unknown command trian (did you mean train?)"},
      {" fl simulate --round 3", "unknown flag --round (did you mean --rounds?)"},
      {" launch --rdzv-last-call -1 -- true", "--rdzv-last-call"},
      {" launch --nproc-per-node 2", "command is required"},
      {" ckpt consolidate " + dir.path() + "/none", "neither a checkpoint"},
      {" ckpt consolidate " + dir.path() + " -o /proc/x.pt", "neither a checkpoint"},
      {" ckpt inspect " + dir.path(), "neither a checkpoint"},
      {" ckpt verify", "checkpoint is required"},
      {" ckpt", "A subcommand is required"},
      {" train --pipeline-transport pigeon", "unknown --pipeline-transport 'pigeon'"},
      {" ps serve --shard 2/2", "--shard '2/2': expected I/N with 0 <= I < N"},
      {" ps serve --shard x", "--shard 'x': expected I/N"},
      {" ps serve --optimizer rmsprop", "unknown parameter-server optimizer 'rmsprop'"},
      {" ps serve --lr 0", "the parameter server's learning rate must be > 0"},
      {" train --strategy downpour", "--strategy downpour needs the parameter-server shards"},
      {" train --strategy downpour --ps-shards 2 --ps 127.0.0.1:1",
       "--ps and --ps-shards both given"},
      {" train --strategy downpour --ps-shards 1 --n-fetch 0", "--n-fetch must be at least 1"},
      {" train --strategy downpour --ps-shards 1 --max-staleness -2", "--max-staleness must be -1"},
      {" train --strategy ddp --ps 127.0.0.1:1",
       "--ps and --ps-shards are for --strategy downpour"},
      {" train --strategy downpour --ps-shards 1 --ps-lr 0", "--ps-lr must be > 0"},
      {" train --strategy sandblaster", "--strategy sandblaster needs the parameter-server shards"},
      {" train --strategy sandblaster --ps-shards 1 --work-units -1", "--work-units must be 0"},
      {" train --strategy sandblaster --ps-shards 1 --lbfgs-history 0",
       "--lbfgs-history must be 1 to 100"},
      {" fl simulate --byzantine 0.2:bad", "--byzantine '0.2:bad': unknown kind 'bad'"},
      {" fl simulate --algorithm krum --secure-aggregation --dataset synthetic",
       "--algorithm krum needs each client's update, and --secure-aggregation reveals only"},
      {" fl simulate --algorithm scaffold --dp-clip 1 --dataset synthetic",
       "--algorithm scaffold sums the clients' control-variate changes in the clear"},
      {" fl simulate --algorithm median --assumed-faulty 0.6 --dataset synthetic",
       "--assumed-faulty must be a fraction in [0, 0.5)"},
      {" fl simulate --client-examples 0 --dataset synthetic", "--client-examples must be >= 1"},
      {" fl simulate --staleness poly:x --dataset synthetic",
       "--staleness 'poly:x': the exponent 'x' is not >= 0"},
      {" fl simulate --buffer-size 5 --dataset synthetic",
       "--buffer-size runs on the virtual clock"},
      {" fl simulate --buffer-size 5 --client-speed lognormal:1 --secure-aggregation --dataset "
       "synthetic",
       "buffered secure aggregation is not implemented"},
      {" fl simulate --client-speed gamma:2 --dataset synthetic",
       "--client-speed 'gamma:2': expected none, constant"},
      {" fl simulate --clients 10 --fraction 1 --secure-aggregation --secagg-graph 12 --dataset "
       "synthetic",
       "--secagg-graph 12: SecAgg+ degree larger than the round allows (10 clients"},
      {" fl simulate --secagg-graph sparse --dataset synthetic", "--secagg-graph 'sparse'"},
      {" fl simulate --clients 100 --fraction 1 --secure-aggregation --secagg-graph auto "
       "--dropout 0.7 --secagg-threshold 0.4 --dataset synthetic",
       "--secagg-graph auto: with 70% dropouts (--secagg-dropout) and a threshold of 0.4"},
      {" fl serve --secure-aggregation --secagg-graph auto --secagg-dropout 1.5",
       "--secagg-dropout must be a fraction in [0, 1)"},
      {" train --simulate-slowdown 1", "--simulate-slowdown '1': expected RANK:FACTOR"},
      {" train --simulate-slowdown 3:2 --nproc 2",
       "--simulate-slowdown: rank 3 is not one of the 2"},
      {" train --model mlp --sync-batchnorm",
       "--sync-batchnorm: model mlp has no BatchNorm layers"},
      {" train --model resnet --strategy downpour --ps-shards 1 --sync-batchnorm",
       "--sync-batchnorm: strategy downpour has no data-parallel group that steps together"},
      {" train --strategy downpour --ps 127.0.0.1:1 --ps-auth-token-file " + dir.path() + "/none",
       "cannot read the token file"},
      {" ps serve --lr-decay cosine", "needs --total-versions"},
      {" ps serve --tls-cert x.pem", "TLS needs both --tls-cert and --tls-key"},
      {" ps serve --auth-token-file " + dir.path() + "/none", "cannot read the token file"},
      {" ps serve --checkpoint-interval 0", "--checkpoint-interval must be > 0 seconds"},
      {" ps serve --listen 127.0.0.1:0 --checkpoint-dir " + dir.path() + "/damaged",
       "damaged/shard-0-of-1.pt is not a parameter-server shard checkpoint"},
  };
  for (const auto& [args, needle] : cases) {
    const auto out = run(kDtrain + args);
    EXPECT_EQ(out.code, 2) << args << "\n" << out.text;
    EXPECT_TRUE(has(out, needle)) << args << "\n" << out.text;
    EXPECT_TRUE(has(out, "error")) << args;
    EXPECT_LE(std::count(out.text.begin(), out.text.end(), '\n'), 1) << args << "\n" << out.text;
  }
}

TEST(Cli, PlanBadInputIsOneClearLineAndExitCode2) {
  TempDir dir;
  std::ofstream(dir / "broken.toml") << "source = \"test\"\n[accelerator]\ndevice = \"x\"\n";
  const std::string plan = " plan --cluster a100-selene";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {plan + " --model gpt-9", "unknown --model 'gpt-9' (known: resnet50, vgg16, vgg-small"},
      // (The planner refuses what dtrain train refuses, in train's words: the registry's.)
      {plan + " --model vgg16 --gpus-per-node 3 --stage-replicas 2,1 --strategy zero1",
       "--stage-replicas replicates stages with ddp, not zero1"},
      {plan + " --model vgg16 --gpus-per-node 3 --stage-replicas 2,1 --micro-batches 1 "
              "--schedule gpipe",
       "gives a stage 2 replicas but a step has 1 micro-batches"},
      {plan + " --model transformer:layers=2,hidden=100,heads=3,seq=8,vocab=10",
       "hidden 100 is not divisible by heads 3"},
      {plan + " --model transformer:layers=2,hidden=96,heads=3,seq=8", "missing vocab="},
      {plan + " --model llama --layers 2", "plan --model llama needs --vocab (the tokenizer's"},
      {plan + " --model llama --layers 2 --width 768 --heads 12 --kv-heads 4 --vocab 100 --tp 6 "
              "--gpus-per-node 6",
       "tensor parallelism 6 and the model's 4 key/value heads: one must divide the other"},
      {" plan --cluster nowhere --model gpt-1.7b", "unknown hardware profile 'nowhere' (known: "},
      {" plan --cluster " + dir.path() + "/broken.toml --model gpt-1.7b",
       "broken.toml: missing table 'accelerator.peak_tflops'"},
      {plan + " --model megatron-2.5b --tp 8",
       "tensor parallelism 8 does not divide the model's 20 attention heads"},
      {plan + " --model gpt-1.7b --tp 16",
       "pp x tp x cp = 16 does not divide the cluster's 8 GPUs"},
      {" plan --cluster h100-dgx --model llama --vocab 64 --context 100 --cp 4",
       "context parallelism 4 cuts the 100 tokens of a sample into 8 chunks"},
      {" plan --cluster h100-dgx --model llama --vocab 64 --context 128 --cp 2 --cp-method striped",
       "unknown context-parallel method 'striped' (ring, allgather, ulysses)"},
      {plan + " --model gpt-1.7b --pp 8 --micro-batches 4",
       "the 1f1b schedule needs at least as many micro-batches as pipeline stages"},
      {plan + " --model gpt-1t", "does not fit: it needs "},
      {plan + " --model gpt-1t --search --global-batch 8",
       "no layout of gpt-1t fits 8 x NVIDIA A100 SXM4 80GB (80.00 GiB per rank) at global batch 8: "
       "the "
       "smallest of "},
      {plan + " --model gpt-1.7b --search", "--search needs --global-batch"},
  };
  for (const auto& [args, needle] : cases) {
    const auto out = run(kDtrain + args);
    EXPECT_EQ(out.code, 2) << args << "\n" << out.text;
    EXPECT_TRUE(has(out, needle)) << args << "\n" << out.text;
    EXPECT_LE(std::count(out.text.begin(), out.text.end(), '\n'), 1) << args << "\n" << out.text;
  }
}

TEST(Cli, PlanPredictsSearchesAndDrawsScaling) {
  TempDir dir;
  const auto text = run(kDtrain +
                        " plan --model gpt-1.7b --cluster a100-selene --nodes 4 "
                        "--global-batch 512 --micro-batch-size 4 --checkpointing");
  ASSERT_EQ(text.code, 0) << text.text;
  EXPECT_TRUE(has(text, "layout            ddp dp32 pp1 tp1 mb4x4 bf16-mixed ckpt")) << text.text;
  EXPECT_TRUE(has(text, "MFU")) << text.text;
  const auto json = run(kDtrain +
                        " plan --json --model gpt-1.7b --cluster a100-selene --nodes 4 "
                        "--global-batch 512 --micro-batch-size 4 --checkpointing");
  ASSERT_EQ(json.code, 0) << json.text;
  const auto record = nlohmann::json::parse(json.text);
  EXPECT_GT(record["step_s"].get<double>(), 0);
  EXPECT_EQ(record["global_batch"].get<int>(), 512);
  EXPECT_FALSE(record["tight"].get<bool>());
  // On a device with 5% of its memory left over, the same layout fits but is flagged: the CUDA
  // context, communication buffers and fragmentation need more than the model counts.
  {
    const double total = record["memory_bytes"]["total"].get<double>();
    EXPECT_NEAR(record["memory_headroom"].get<double>(), 1 - total / (80 * std::pow(2.0, 30)),
                1e-9);
    std::ifstream in(DTRAIN_SOURCE_DIR "/configs/hardware/a100-selene.toml");
    const std::string profile((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
    char gib[64];
    std::snprintf(gib, sizeof(gib), "memory_gib = %.9f", total / 0.95 / std::pow(2.0, 30));
    std::ofstream(dir / "tight.toml")
        << std::regex_replace(profile, std::regex("memory_gib = [0-9.]+"), gib);
    const std::string tight_plan = " plan --model gpt-1.7b --cluster " + (dir / "tight.toml") +
                                   " --nodes 4 --global-batch 512 --micro-batch-size 4 "
                                   "--checkpointing";
    const auto flagged = run(kDtrain + tight_plan);
    ASSERT_EQ(flagged.code, 0) << flagged.text;
    EXPECT_TRUE(has(flagged, "TIGHT: 95.0% of the device")) << flagged.text;
    const auto tight_json = nlohmann::json::parse(run(kDtrain + tight_plan + " --json").text);
    EXPECT_TRUE(tight_json["tight"].get<bool>());
    EXPECT_FALSE(has(text, "TIGHT")) << text.text;
  }
  const auto search = run(kDtrain +
                          " plan --search --top 3 --model gpt-1.7b --cluster a100-selene "
                          "--global-batch 64");
  ASSERT_EQ(search.code, 0) << search.text;
  EXPECT_TRUE(has(search, "  3  ")) << search.text;
  // A Llama from a config file as dtrain train reads it, answered with the cluster's command;
  // on this machine, the command trains.
  {
    const auto llama = run(kDtrain + " plan --config " DTRAIN_SOURCE_DIR
                                     "/configs/llama-70b.toml --vocab 128256 --cluster h100-dgx "
                                     "--nodes 64 --search --global-batch 1024 --top 1");
    ASSERT_EQ(llama.code, 0) << llama.text;
    EXPECT_TRUE(has(llama, "64 heads / 8 kv, context 8192, vocabulary 128256")) << llama.text;
    EXPECT_TRUE(has(llama,
                    "the best as a command: dtrain launch --nnodes 64 --nproc-per-node 8 "
                    "--node-rank <0..63> --master-addr <node 0's address> -- dtrain train "
                    "--model llama --layers 80 --width 8192 --heads 64 --kv-heads 8 "
                    "--ffn-width 28672 --context 8192 --rope-theta 500000 --dataset <yours> "
                    "--device cuda --backend nccl --strategy "))
        << llama.text;
    EXPECT_TRUE(has(llama, " --global-batch 1024 ")) << llama.text;
    const auto tiny = run(kDtrain +
                          " plan --model llama --layers 2 --width 64 --heads 4 --kv-heads 2 "
                          "--context 32 --vocab 300 --cluster this-machine --global-batch 8 "
                          "--search --json --top 1");
    ASSERT_EQ(tiny.code, 0) << tiny.text;
    const auto planned = nlohmann::json::parse(tiny.text);
    std::string command = planned["best"][0]["command"].get<std::string>();
    ASSERT_EQ(command.rfind("dtrain train --nproc 2 --model llama --layers 2", 0), 0) << command;
    command.replace(command.find("<yours>"), 7, "text --max-steps 2 --no-progress");
    const auto trained = run(kDtrain + command.substr(6) + " --run-dir " + (dir / "llama-run"));
    EXPECT_EQ(trained.code, 0) << command << "\n" << trained.text;
    EXPECT_TRUE(has(trained, "trained 2 steps (global batch 8, 2 ranks")) << trained.text;
  }
  // The search decides sequence parallelism and the overlaps unless a flag pins them.
  {
    const std::string searched =
        " plan --search --json --top 20 --model gpt-1.7b --cluster "
        "a100-selene --global-batch 64";
    auto count = [&](const std::string& flags, const std::string& key) {
      const auto out = run(kDtrain + searched + flags);
      EXPECT_EQ(out.code, 0) << out.text;
      int on = 0;
      const auto result = nlohmann::json::parse(out.text);
      for (const auto& entry : result["best"]) {
        on += entry["train_flags"].get<std::string>().find(key) != std::string::npos;
      }
      return on;
    };
    EXPECT_GT(count("", "--sequence-parallel"), 0);
    EXPECT_EQ(count(" --no-sequence-parallel", "--sequence-parallel"), 0);
    EXPECT_EQ(
        count(" --sequence-parallel --strategies ddp --no-tp-comm-overlap", "--tp-comm-overlap"),
        0);
  }
  // PipeDream's layouts: a VGG on 3 ranks of a slow network; among 1F1B's pipelines (--schedules
  // 1f1b: PipeDream's schedule) the search picks stages replicated unequally, printed as dtrain
  // train flags, and dtrain train runs them. Every registered schedule competes without
  // --schedules: there GPipe's, whose forwards stream while 1F1B's wait on each round trip of
  // these slow links, is faster still.
  {
    std::ifstream in(DTRAIN_SOURCE_DIR "/configs/hardware/this-machine.toml");
    const std::string profile((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
    // 3 one-rank nodes on 100 Mbit/s links.
    std::ofstream(dir / "slow.toml") << std::regex_replace(
        std::regex_replace(profile, std::regex("node_gbit_s = [0-9.]+"), "node_gbit_s = 0.1"),
        std::regex("\\[node\\]\\s*gpus = [0-9]+"), "[node]\ngpus = 1");
  }
  const std::string pipedream = kDtrain +
                                " plan --search --replicated-stages --top 3 --model vgg-small "
                                "--cluster " +
                                (dir / "slow.toml") +
                                " --nodes 3 --global-batch 24 --strategies ddp --precision fp32 "
                                "--optimizer momentum";
  const auto picked = run(pipedream + " --schedules 1f1b");
  ASSERT_EQ(picked.code, 0) << picked.text;
  const auto any_schedule = run(pipedream);
  EXPECT_TRUE(has(any_schedule,
                  "the best as dtrain train flags: --nproc 3 --strategy ddp "
                  "--pipeline-parallel 3 --schedule gpipe"))
      << any_schedule.text;
  const std::string marker = "the best as dtrain train flags: ";
  const size_t at = picked.text.find(marker);
  ASSERT_NE(at, std::string::npos) << picked.text;
  const std::string flags =
      picked.text.substr(at + marker.size(), picked.text.find('\n', at) - at - marker.size());
  EXPECT_NE(flags.find("--stage-replicas"), std::string::npos) << picked.text;
  const auto trained = run(kDtrain + " train --model vgg --max-steps 2 --no-progress " + flags);
  EXPECT_EQ(trained.code, 0) << flags << "\n" << trained.text;
  EXPECT_TRUE(has(trained, "trained 2 steps (global batch 24, 3 ranks")) << trained.text;
  const auto svg = dir / "scaling.svg";
  const auto scaling = run(kDtrain +
                           " plan --model resnet50 --cluster p100-bigbasin --precision fp32 "
                           "--micro-batch-size 32 --scaling 1,2,4,8 --plot " +
                           svg);
  ASSERT_EQ(scaling.code, 0) << scaling.text;
  EXPECT_TRUE(has(scaling, "100.0%")) << scaling.text;  // the first row is the reference
  std::ifstream in(svg);
  const std::string drawn((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(drawn.find("<polyline"), std::string::npos);
}

TEST(Cli, PlanCalibrateWritesAProfileThePlannerReads) {
  TempDir dir;
  const auto profile = dir / "here.toml";
  const auto calibrate =
      run(kDtrain + " plan calibrate --threads 1 --probe-seconds 0.02 --out " + profile);
  ASSERT_EQ(calibrate.code, 0) << calibrate.text;
  EXPECT_TRUE(has(calibrate, "gloo all-reduce on loopback")) << calibrate.text;
  std::ifstream in(profile);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("matmul_tflops_by_dim"), std::string::npos) << text;
  EXPECT_NE(text.find("cores = "), std::string::npos) << text;
  // The planner runs on it: two ranks of this machine, then four sharing its cores.
  const std::string model =
      " plan --model transformer:layers=2,hidden=64,heads=2,seq=32,vocab=50,tied=0,dropout=0,"
      "fused=0 --precision fp32 --micro-batch-size 4 --cluster " +
      profile;
  const auto two = run(kDtrain + model + " --gpus-per-node 2 --json");
  ASSERT_EQ(two.code, 0) << two.text;
  const auto four = run(kDtrain + model + " --gpus-per-node 4 --json");
  ASSERT_EQ(four.code, 0) << four.text;
  const double compute_two = nlohmann::json::parse(two.text)["compute_s"].get<double>();
  const double compute_four = nlohmann::json::parse(four.text)["compute_s"].get<double>();
  EXPECT_GT(compute_two, 0);
  // The profile counts one accelerator per core (1 thread per rank): ranks beyond the cores
  // share them.
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  const double expected = std::max(1.0, 4 / cores) / std::max(1.0, 2 / cores);
  EXPECT_NEAR(compute_four / compute_two, expected, 1e-6 * expected);
}

// `dtrain ps serve` runs a shard until SIGTERM, saying where it listens and where it stopped.
TEST(Cli, PsServeRunsAShardUntilTerminated) {
  TempDir dir;
  const std::string log = dir.path() + "/serve.log";
  // Waits (at most 10 s) for the shard to say it listens, then stops it.
  const auto out = run("sh -c '" + kDtrain + " ps serve --listen 127.0.0.1:0 --shard 1/2 > " + log +
                       " 2>&1 & for i in $(seq 100); do grep -q listening " + log +
                       " && break; sleep 0.1; done; kill -TERM $!; wait $!; code=$?; cat " + log +
                       "; exit $code'");
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "parameter-server shard 1/2 listening on 127.0.0.1:0 (port ")) << out.text;
  EXPECT_TRUE(has(out, "optimizer adagrad")) << out.text;
  EXPECT_TRUE(has(out, "parameter-server shard 1/2 stopped at version 0")) << out.text;
}

// One command starts the shards and the workers; rank 0 writes the final model as a normal
// checkpoint, which the checkpoint tools read.
TEST(Cli, DownpourStartsShardsAndWorkers) {
  TempDir dir;
  const auto out = run(kDtrain +
                       " train --strategy downpour --nproc 2 --ps-shards 2 --threads 1 "
                       "--dataset synthetic --model mlp --synthetic-examples 512 "
                       "--max-steps 12 --no-progress --checkpoint-dir " +
                       (dir / "ckpt") + " --metrics " + (dir / "m.jsonl"));
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "parameter server: 2 shards at 127.0.0.1:")) << out.text;
  EXPECT_TRUE(has(out, "test accuracy")) << out.text;
  const auto verify = run(kDtrain + " ckpt verify " + (dir / "ckpt"));
  EXPECT_EQ(verify.code, 0) << verify.text;
  const auto inspect = run(kDtrain + " ckpt inspect " + (dir / "ckpt"));
  EXPECT_TRUE(has(inspect, "strategy downpour")) << inspect.text;
  std::ifstream metrics(dir / "m.jsonl");
  std::string all((std::istreambuf_iterator<char>(metrics)), std::istreambuf_iterator<char>());
  EXPECT_NE(all.find("\"staleness\""), std::string::npos) << all;
}

// Faults with processes. A Downpour worker killed mid-run: the launcher reports it and keeps
// the others, which finish the run's budget; rank 0 names the worker that never finished.
TEST(Cli, DownpourGoesOnWhenAWorkerIsKilled) {
  TempDir dir;
  const auto out = run("DTRAIN_SIMULATE_FAILURE=1:8 " + kDtrain +
                       " train --strategy downpour --nproc 3 --ps-shards 2 --threads 1 "
                       "--dataset synthetic --model mlp --synthetic-examples 768 --max-steps 20 "
                       "--no-progress --checkpoint-dir " +
                       (dir / "ckpt") + " --metrics " + (dir / "m.jsonl"));
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "rank 1 kills itself at step 8")) << out.text;
  EXPECT_TRUE(has(out, "the other ranks go on")) << out.text;
  EXPECT_TRUE(has(out, "worker(s) 1 (quiet for")) << out.text;
  EXPECT_TRUE(has(out, "test accuracy")) << out.text;
  EXPECT_EQ(run(kDtrain + " ckpt verify " + (dir / "ckpt")).code, 0);
  // The budget (20 steps x 3 workers) was made by the two that lived.
  std::ifstream metrics(dir / "m.jsonl");
  std::string all((std::istreambuf_iterator<char>(metrics)), std::istreambuf_iterator<char>());
  auto number = [&](const std::string& key) {
    const auto at = all.find("\"" + key + "\":");
    return at == std::string::npos ? -1.0 : std::atof(all.c_str() + at + key.size() + 3);
  };
  EXPECT_GE(number("worker1_pushes"), 7) << all;  // its 8th step's push may have been cut off
  EXPECT_LE(number("worker1_pushes"), 8) << all;
  EXPECT_GE(number("shard0_version"), 60) << all;
  EXPECT_GT(number("worker0_pushes") + number("worker2_pushes"), 2 * 20 - 8) << all;
}

// A shard process killed (SIGKILL) and started again: the workers retry until it is back, it
// resumes from its checkpoint, the run completes, and the updates it lost are reported.
TEST(Cli, DownpourSurvivesAShardKilledAndRestarted) {
  TempDir dir;
  const int port0 = dtrain::free_port(), port1 = dtrain::free_port();
  const std::string serve = kDtrain + " ps serve --checkpoint-dir " + dir.path() +
                            " --checkpoint-interval 0.3 --report-every 0";
  const std::string script =
      serve + " --listen 127.0.0.1:" + std::to_string(port0) + " --shard 0/2 > " +
      (dir / "s0.log") + " 2>&1 & s0=$!\n" + serve +
      " --listen 127.0.0.1:" + std::to_string(port1) + " --shard 1/2 > " + (dir / "s1.log") +
      " 2>&1 & s1=$!\n"
      "DTRAIN_SIMULATE_SLOW_STEP_MS=25 " +
      kDtrain +
      " train --strategy downpour --nproc 2 --threads 1 --ps 127.0.0.1:" + std::to_string(port0) +
      ",127.0.0.1:" + std::to_string(port1) +
      " --dataset synthetic --model mlp --synthetic-examples 2048 --max-steps 120 --no-progress "
      "--ps-timeout-ms 5000 > " +
      (dir / "train.log") +
      " 2>&1 & t=$!\n"
      "for i in $(seq 200); do grep -q 'resumed\\|version [1-9]' " +
      (dir / "s1.log") + " 2>/dev/null; [ -s " + (dir / "shard-1-of-2.pt") +
      " ] && break; sleep 0.05; done\n"
      "sleep 1; kill -KILL $s1; wait $s1; sleep 0.7\n" +
      serve + " --listen 127.0.0.1:" + std::to_string(port1) + " --shard 1/2 >> " +
      (dir / "s1.log") +
      " 2>&1 & s1=$!\n"
      "wait $t; code=$?; kill -TERM $s0 $s1; wait $s0 $s1; cat " +
      (dir / "train.log") + " " + (dir / "s1.log") + "; exit $code\n";
  std::ofstream(dir / "run.sh") << script;
  const auto out = run("sh " + (dir / "run.sh"));
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "parameter-server shard 1/2 resumed from")) << out.text;
  EXPECT_TRUE(has(out, "(shard 1) restarted from its checkpoint at version")) << out.text;
  EXPECT_TRUE(has(out, "updates lost")) << out.text;
  EXPECT_TRUE(has(out, "test accuracy")) << out.text;
}

// `dtrain train` with no flags trains the main job's model: its defaults are the config's.
TEST(Cli, DefaultsAreThoseOfTheMainJob) {
  const auto help = run(kDtrain + " train --help");
  std::ifstream config(std::string(DTRAIN_SOURCE_DIR) + "/configs/fashion-mnist-ddp.toml");
  std::string line;
  int checked = 0;
  while (std::getline(config, line)) {
    const auto eq = line.find(" = ");
    if (line.empty() || line[0] == '#' || eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq);
    std::string value = line.substr(eq + 3);
    value = value.substr(0, value.find(' '));
    if (!value.empty() && value.front() == '"') value = value.substr(1, value.size() - 2);
    if (key == "nproc" || key == "seed") continue;  // the job runs 2 ranks; any seed is good
    const auto at = help.text.find("--" + key + " ");
    ASSERT_NE(at, std::string::npos) << key;
    const auto end = help.text.find('\n', at);
    const std::string row = help.text.substr(at, end - at);
    const auto equals = row.find('=');  // "--lr FLOAT=0.05   Learning rate"
    ASSERT_NE(equals, std::string::npos) << row;
    const std::string shown = row.substr(equals + 1, row.find(' ', equals) - equals - 1);
    EXPECT_DOUBLE_EQ(std::atof(shown.c_str()), std::atof(value.c_str())) << key << ": " << row;
    if (std::atof(value.c_str()) == 0) {
      EXPECT_EQ(shown, value) << key;
    }
    ++checked;
  }
  EXPECT_GE(checked, 10);
}

TEST(Cli, ConfigFileSetsFlagsAndCommandLineWins) {
  TempDir dir;
  std::FILE* file = std::fopen((dir / "job.toml").c_str(), "w");
  std::fputs(
      "# a job\n[train]\ndataset = \"synthetic\"\nmodel = \"mlp\"\nhidden = [32]\n"
      "batch-size = 4\nsynthetic-examples = 256\nmax-steps = 3\n",
      file);
  std::fclose(file);
  auto out =
      run(kDtrain + " train --no-progress --config " + (dir / "job.toml") + " --batch-size 8");
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "trained 3 steps (global batch 8, 1 rank")) << out.text;
  file = std::fopen((dir / "bad.toml").c_str(), "w");
  std::fputs("learning_rate = 0.1\n", file);
  std::fclose(file);
  out = run(kDtrain + " train --config " + (dir / "bad.toml"));
  EXPECT_EQ(out.code, 2);
  EXPECT_TRUE(has(out, "unknown key 'learning_rate'")) << out.text;
}

// --sync-batchnorm on real processes (gloo), with bf16 activations (statistics in float32).
TEST(Cli, SyncBatchNormTrainsOnTwoRanks) {
  const auto out = run(kDtrain +
                       " train --nproc 2 --threads 1 --dataset synthetic --model resnet "
                       "--sync-batchnorm --synthetic-examples 256 --max-steps 4 --no-progress "
                       "--precision bf16-mixed");
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "trained 4 steps (global batch 128, 2 ranks, ddp)")) << out.text;
}

// --check-collectives reaches every rank (a pipeline's, a replicated stage's and the step's
// collectives all match: training runs as without it).
TEST(Cli, CheckedCollectivesTrainAsUsual) {
  const auto out = run(kDtrain +
                       " train --nproc 3 --threads 1 --dataset synthetic --model mlp "
                       "--synthetic-examples 256 --max-steps 4 --no-progress --stage-replicas 2,1 "
                       "--micro-batches 4 --check-collectives");
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "trained 4 steps")) << out.text;
}

TEST(Cli, MixedPrecisionAndCheckpointingTrain) {
  TempDir dir;
  const auto out = run(kDtrain +
                       " train --threads 1 --dataset synthetic --model cnn "
                       "--synthetic-examples 256 --max-steps 4 --no-progress "
                       "--precision bf16-mixed --checkpointing sqrt --loss-scaling "
                       "dynamic --metrics " +
                       (dir / "m.jsonl"));
  EXPECT_EQ(out.code, 0) << out.text;
  std::ifstream metrics(dir / "m.jsonl");
  std::string all((std::istreambuf_iterator<char>(metrics)), std::istreambuf_iterator<char>());
  EXPECT_NE(all.find("\"loss_scale\""), std::string::npos) << all;
  EXPECT_NE(all.find("\"skipped_steps\""), std::string::npos) << all;
}

TEST(Cli, TrainOnTwoRanksEndToEnd) {
  TempDir dir;
  int train_again_from = 8;
  const auto out = run(kDtrain +
                       " train --nproc 2 --threads 1 --dataset synthetic --model mlp "
                       "--strategy zero3 --synthetic-examples 512 --epochs 2 "
                       "--no-progress --metrics " +
                       (dir / "m.jsonl") + " --checkpoint-dir " + (dir / "ckpt"));
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "[rank 0] trained 8 steps (global batch 128, 2 ranks, zero3)")) << out.text;
  EXPECT_TRUE(has(out, "test accuracy")) << out.text;
  EXPECT_TRUE(std::filesystem::exists(dir / "ckpt/step-00000008/state-1-of-2.pt"));
  const auto inspect = run(kDtrain + " ckpt inspect " + (dir / "ckpt"));
  EXPECT_EQ(inspect.code, 0) << inspect.text;
  EXPECT_TRUE(has(inspect, "strategy zero3, world 2")) << inspect.text;
  EXPECT_TRUE(has(inspect, "layers.0.weight")) << inspect.text;
  const auto consolidated =
      run(kDtrain + " ckpt consolidate " + (dir / "ckpt") + " -o " + (dir / "model.pt"));
  EXPECT_EQ(consolidated.code, 0) << consolidated.text;
  EXPECT_TRUE(std::filesystem::exists(dir / "model.pt"));
  const auto missing = run(kDtrain + " ckpt consolidate " + (dir / "none"));
  EXPECT_EQ(missing.code, 2) << missing.text;
  auto verified = run(kDtrain + " ckpt verify " + (dir / "ckpt"));
  EXPECT_EQ(verified.code, 0) << verified.text;
  EXPECT_TRUE(has(verified, "ok       " + (dir / "ckpt/step-00000008"))) << verified.text;
  {  // one byte flipped in a state file: verify and consolidate refuse it, naming the file
    const std::string state = dir / "ckpt/step-00000008/state-1-of-2.pt";
    std::fstream file(state, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(200);
    const char byte = static_cast<char>(file.get() ^ 1);
    file.seekp(200);
    file.put(byte);
  }
  verified = run(kDtrain + " ckpt verify " + (dir / "ckpt"));
  EXPECT_EQ(verified.code, 2) << verified.text;
  EXPECT_TRUE(has(verified, "DAMAGED  " + (dir / "ckpt/step-00000008") + ": " +
                                (dir / "ckpt/step-00000008/state-1-of-2.pt") + " is damaged"))
      << verified.text;
  const auto refused = run(kDtrain + " ckpt consolidate " + (dir / "ckpt"));
  EXPECT_EQ(refused.code, 2) << refused.text;
  EXPECT_TRUE(has(refused, "state-1-of-2.pt is damaged")) << refused.text;
  std::filesystem::remove_all(dir / "ckpt/step-00000008");  // back to the epoch-1 checkpoint
  train_again_from = 4;
  // Running again resumes from the final checkpoint and trains no further.
  const auto again = run(kDtrain +
                         " train --nproc 2 --threads 1 --dataset synthetic --model mlp "
                         "--synthetic-examples 512 --epochs 2 --checkpoint-dir " +
                         (dir / "ckpt"));
  EXPECT_EQ(again.code, 0) << again.text;
  EXPECT_TRUE(has(again, "resumed from step " + std::to_string(train_again_from))) << again.text;
}

// Batch jobs log with --no-progress: a resumed run still says from which step and checkpoint,
// and under which layout it was saved and now runs (a TP=2 GPT resumed at TP=1); a `latest`
// file naming a checkpoint that does not exist is named, and the newest one resumed.
TEST(Cli, AResumedRunSaysSoWithoutProgressBars) {
  TempDir dir;
  {
    std::ofstream text(dir / "text.txt");
    for (int i = 0; i < 200; ++i)
      text << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  const std::string job = " train --threads 1 --model gpt --dataset text --text-file " +
                          (dir / "text.txt") +
                          " --layers 1 --heads 2 --width 16 --context 16 "
                          "--batch-size 8 --max-steps 6 --no-progress --checkpoint-dir " +
                          (dir / "ckpt");
  // (Selective recomputation under tensor parallelism; an asynchronous checkpoint resumed.)
  const auto first = run(kDtrain + job +
                         " --nproc 2 --tensor-parallel 2 --stop-at-step 2 --checkpointing "
                         "selective --async-checkpoint");
  ASSERT_EQ(first.code, 0) << first.text;
  EXPECT_FALSE(has(first, "resumed")) << first.text;
  const auto second = run(kDtrain + job + " --nproc 1 --stop-at-step 4");
  ASSERT_EQ(second.code, 0) << second.text;
  EXPECT_TRUE(has(second, "dtrain: resumed from step 2 of " + (dir / "ckpt/step-00000002") +
                              " (saved by ddp on 2 ranks (DP 1 x PP 1 x TP 2); now ddp on 1 rank "
                              "(DP 1 x PP 1 x TP 1); verified and read in "))
      << second.text;
  {
    std::ofstream latest(dir / "ckpt/latest", std::ios::trunc);
    latest << "step-00000099\n";
  }
  const auto third = run(kDtrain + job + " --nproc 1");
  ASSERT_EQ(third.code, 0) << third.text;
  EXPECT_TRUE(has(third, (dir / "ckpt") +
                             "/latest names checkpoint 'step-00000099', which does "
                             "not exist; resuming from the newest checkpoint that verifies"))
      << third.text;
  EXPECT_TRUE(has(third, "dtrain: resumed from step 4 of " + (dir / "ckpt/step-00000004")))
      << third.text;
}

// Each model trains with its own recipe unless told otherwise: the GPT gets AdamW, weight decay,
// its batch and clipping (not the image models' SGD), and a flag or a config key keeps its value;
// an image model's recipe is the defaults, so nothing is said.
TEST(Cli, EachModelTrainsWithItsRecipeAndFlagsOrConfigKeysWin) {
  TempDir dir;
  {
    std::ofstream text(dir / "text.txt");
    for (int i = 0; i < 100; ++i) text << "a recipe for every model " << i << "\n";
    std::ofstream config(dir / "gpt.toml");
    config << "batch-size = 8\nwarmup-steps = 3\n";
  }
  const std::string gpt = kDtrain + " train --threads 1 --model gpt --dataset text --text-file " +
                          (dir / "text.txt") +
                          " --layers 1 --heads 2 --width 16 --context 16 "
                          "--max-steps 2 --no-progress";
  const auto plain = run(gpt);
  ASSERT_EQ(plain.code, 0) << plain.text;
  EXPECT_TRUE(has(plain,
                  "model gpt: its training recipe sets --optimizer adamw, --lr 0.002, "
                  "--momentum 0, --weight-decay 0.1, --batch-size 32, --max-grad-norm 1 "
                  "(a flag or config key overrides each)"))
      << plain.text;
  const auto flags = run(gpt + " --lr 0.01 --config " + (dir / "gpt.toml"));
  ASSERT_EQ(flags.code, 0) << flags.text;
  EXPECT_TRUE(has(flags,
                  "model gpt: its training recipe sets --optimizer adamw, --momentum 0, "
                  "--weight-decay 0.1, --max-grad-norm 1 (a flag"))
      << flags.text;
  const auto image = run(kDtrain +
                         " train --threads 1 --dataset synthetic --model mlp "
                         "--synthetic-examples 256 --max-steps 1 --no-progress");
  ASSERT_EQ(image.code, 0) << image.text;
  EXPECT_FALSE(has(image, "training recipe")) << image.text;
  // Another optimizer than the recipe's trains at its own defaults (PyTorch's), not at the rate
  // and decay of the recipe's SGD (Adam at 0.05 diverged); a rate given stays.
  const std::string adam = kDtrain +
                           " train --threads 1 --dataset synthetic --model mlp "
                           "--synthetic-examples 256 --max-steps 1 --no-progress --optimizer adam";
  const auto own = run(adam);
  ASSERT_EQ(own.code, 0) << own.text;
  EXPECT_TRUE(has(own,
                  "--optimizer adam (model mlp's recipe trains with sgd): adam's own defaults, "
                  "as PyTorch's, set --lr 0.001, --momentum 0, --weight-decay 0\n"))
      << own.text;
  const auto rate = run(adam + " --lr 0.003");
  ASSERT_EQ(rate.code, 0) << rate.text;
  EXPECT_TRUE(has(rate, "adam's own defaults, as PyTorch's, set --momentum 0, --weight-decay 0\n"))
      << rate.text;
}

// A run without --metrics or --checkpoint-dir leaves a folder of its own (runs/MODEL-DATE-TIME:
// metrics, the options given, the command line); off a terminal it prints a line every
// --log-every steps, counted toward --max-steps, with the learning rate, the throughput and the
// peak memory; a warmup as long as the run is named; --run-dir keeps the checkpoints too, and
// every checkpoint says how it was made (ckpt inspect); config.toml trains the run again.
// A language model's lines and step records carry its model FLOP/s (the FLOPs per token of its
// shape, models::gpt_training_flops_per_token, x tokens/s) and, given the device's peak, its MFU.
TEST(Cli, ALanguageModelReportsItsFlopsAndUtilization) {
  TempDir dir;
  const auto out = run(kDtrain +
                       " train --model gpt --dataset text --layers 1 --width 32 --heads 2 "
                       "--context 32 --batch-size 4 --max-steps 4 --log-every 2 --threads 1 "
                       "--no-run-dir --peak-tflops 0.05 --metrics " +
                       (dir / "m.jsonl"));
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, " tokens/s | ")) << out.text;
  EXPECT_TRUE(has(out, " GFLOP/s | MFU ")) << out.text;
  std::ifstream in(dir / "m.jsonl");
  int steps = 0;
  for (std::string line; std::getline(in, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("event", "") == "summary") {  // the steps' time within the whole fit's
      EXPECT_GT(record.at("train_seconds").get<double>(), 0.0);
      EXPECT_LE(record.at("train_seconds").get<double>(), record.at("seconds").get<double>());
    }
    if (record.value("event", "") != "step") continue;
    ++steps;
    const double tokens = record.at("tokens_per_s").get<double>();
    EXPECT_NEAR(tokens, 32 * record.at("samples_per_s").get<double>(), 1e-6 * tokens);
    const double tflops = record.at("model_tflops").get<double>();
    EXPECT_GT(tflops, 0);
    EXPECT_NEAR(record.at("mfu").get<double>(), tflops / 0.05, 1e-12);
  }
  EXPECT_EQ(steps, 2);
  // Without the peak: the FLOP/s, no MFU.
  const auto plain = run(kDtrain +
                         " train --model gpt --dataset text --layers 1 --width 32 --heads 2 "
                         "--context 32 --batch-size 4 --max-steps 2 --log-every 2 --threads 1 "
                         "--no-run-dir");
  ASSERT_EQ(plain.code, 0) << plain.text;
  EXPECT_TRUE(has(plain, " GFLOP/s | ")) << plain.text;
  EXPECT_FALSE(has(plain, "MFU")) << plain.text;
}

TEST(Cli, ARunLeavesItsFolderAndSaysHowItWasMade) {
  TempDir dir;
  const std::string flags =
      " train --model mlp --hidden 16 --dataset synthetic --synthetic-examples 512 "
      "--batch-size 32 --max-steps 12 --log-every 4 --threads 1";
  const auto out = run("cd " + dir.path() + " && " + kDtrain + flags);
  ASSERT_EQ(out.code, 0) << out.text;
  for (const std::string line : {"step 4/12 | loss ", "step 8/12 | loss ", "step 12/12 | loss "}) {
    EXPECT_TRUE(has(out, line)) << line << "\n" << out.text;
  }
  EXPECT_FALSE(has(out, "step 2/12")) << out.text;
  EXPECT_TRUE(has(out, " | lr ")) << out.text;
  EXPECT_TRUE(has(out, " samples/s | ")) << out.text;
  EXPECT_TRUE(has(out, " | peak memory ")) << out.text;
  EXPECT_TRUE(has(out, "the warmup (--warmup-steps 100) is not shorter than the run's 12 steps"))
      << out.text;
  EXPECT_TRUE(has(out, "run folder: runs/mlp-")) << out.text;
  std::string folder;
  for (const auto& entry : std::filesystem::directory_iterator(dir / "runs")) {
    folder = entry.path().string();
  }
  ASSERT_FALSE(folder.empty());
  for (const char* file : {"/metrics.jsonl", "/config.toml", "/plan.toml", "/command.txt"}) {
    EXPECT_TRUE(std::filesystem::exists(folder + file)) << folder << file;
  }
  EXPECT_FALSE(std::filesystem::exists(folder + "/checkpoints"));
  std::ifstream command_file(folder + "/command.txt");
  std::string command;
  std::getline(command_file, command);
  EXPECT_EQ(command, kDtrain + flags);

  // The options given, read back: the same run, now with a folder of its own for checkpoints.
  const auto again = run(kDtrain + " train --config " + folder + "/config.toml --no-progress " +
                         "--run-dir " + (dir / "again"));
  ASSERT_EQ(again.code, 0) << again.text;
  EXPECT_TRUE(has(again, "trained 12 steps (global batch 32, 1 rank, ddp)")) << again.text;
  EXPECT_TRUE(has(again, "run folder: " + (dir / "again") + " (")) << again.text;
  const auto inspected = run(kDtrain + " ckpt inspect " + (dir / "again/checkpoints"));
  ASSERT_EQ(inspected.code, 0) << inspected.text;
  EXPECT_TRUE(has(inspected, "command: " + kDtrain + " train --config " + folder))
      << inspected.text;
  EXPECT_TRUE(has(inspected, "options given (config.toml):")) << inspected.text;
  EXPECT_TRUE(has(inspected, "max-steps=12")) << inspected.text;
  EXPECT_TRUE(has(inspected, "hidden=")) << inspected.text;
  EXPECT_TRUE(has(inspected, "the plan: 1 rank, strategy ddp, 1 data-parallel replica"))
      << inspected.text;
}

// --print-plan: every option's value (what the model's recipe sets as comments) as TOML that
// --config reads back to the same plan, and what the run makes of them; each run folder keeps
// it, and the run it describes is the one that trains.
TEST(Cli, PrintPlanIsTheRunAndConfigReadsItBack) {
  TempDir dir;
  const std::string flags =
      " train --model gpt --dataset text --layers 1 --width 32 --heads 2 --context 16 "
      "--nproc 2 --tensor-parallel 2 --sequence-parallel --micro-batches 2 --batch-size 4 "
      "--max-steps 2 --no-progress --threads 1";
  const auto printed = run("cd " + dir.path() + " && " + kDtrain + flags + " --print-plan");
  ASSERT_EQ(printed.code, 0) << printed.text;
  for (const std::string line :
       {"# the plan: 2 ranks, strategy ddp, 1 data-parallel replica x tensor-parallel 2 "
        "(sequence parallel)\n",
        "# batches: 4 examples a micro-batch x 2 micro-batches a step = 8 a replica, 8 a step "
        "(global batch), at most 2 steps\n",
        "# launch: 2 local ranks\n", "\nsequence-parallel=true\n", "\nmicro-batches=2\n",
        "\nno-progress=true\n", "\n# lr=0.002\n", "\nwidth=32\n", "\nepochs=5\n"}) {
    EXPECT_TRUE(has(printed, line)) << line << "\n" << printed.text;
  }
  EXPECT_FALSE(has(printed, "print-plan")) << printed.text;
  EXPECT_FALSE(std::filesystem::exists(dir / "runs"));  // (it trains nothing)
  const std::string plan = (dir / "plan.toml");
  std::ofstream(plan) << printed.text;
  const auto again = run(kDtrain + " train --config " + plan + " --print-plan");
  ASSERT_EQ(again.code, 0) << again.text;
  EXPECT_EQ(again.text, printed.text);
  // The plan trains, and its run folder keeps it.
  const auto trained = run(kDtrain + " train --config " + plan + " --run-dir " + (dir / "run"));
  ASSERT_EQ(trained.code, 0) << trained.text;
  EXPECT_TRUE(has(trained, "trained 2 steps (global batch 8, 2 ranks, ddp x tensor-parallel 2)"))
      << trained.text;
  std::ifstream kept_file(dir / "run/plan.toml");
  const std::string kept((std::istreambuf_iterator<char>(kept_file)),
                         std::istreambuf_iterator<char>());
  EXPECT_NE(kept.find("\nrun-dir=\"" + (dir / "run") + "\"\n"), std::string::npos) << kept;
  EXPECT_NE(kept.find(printed.text.substr(printed.text.find("# the plan"))), std::string::npos)
      << kept;
  // Ranks started by a launcher plan for the world they find: the checkpoints say so.
  const auto launched =
      run(kDtrain + " launch --nproc-per-node 2 -- " + kDtrain +
          " train --model mlp --hidden 16 --dataset synthetic --synthetic-examples 256 "
          "--max-steps 2 --no-progress --threads 1 --checkpoint-dir " +
          (dir / "launched"));
  ASSERT_EQ(launched.code, 0) << launched.text;
  const auto inspected = run(kDtrain + " ckpt inspect " + (dir / "launched"));
  EXPECT_TRUE(has(inspected, "the plan: 2 ranks, strategy ddp, 2 data-parallel replicas"))
      << inspected.text;
  // Options that make no plan are named.
  const auto bad = run(kDtrain + flags + " --global-batch 8 --print-plan");
  EXPECT_EQ(bad.code, 2) << bad.text;
  EXPECT_TRUE(has(bad, "give --micro-batches, --accumulation or --global-batch, not two of them"))
      << bad.text;
}

// --config on every subcommand, with train's rules: keys are the command's long flag names, at
// the top level or in a table named after the command; the command line wins; an unknown key is
// named with the command whose flags it is not.
TEST(Cli, EverySubcommandReadsAConfigFile) {
  TempDir dir;
  std::ofstream(dir / "launch.toml") << "[launch]\nnproc-per-node = 2\n";
  auto out = run(kDtrain + " launch --config " + (dir / "launch.toml") +
                 " -- sh -c 'echo world $WORLD_SIZE'");
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "[rank 1] world 2")) << out.text;
  out = run(kDtrain + " launch --config " + (dir / "launch.toml") +
            " --nproc-per-node 1 -- sh -c 'echo world $WORLD_SIZE'");
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "[rank 0] world 1")) << out.text;
  std::ofstream(dir / "fl.toml") << "rounds = 2\nround = 3\n";
  out = run(kDtrain + " fl simulate --config " + (dir / "fl.toml"));
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "unknown key 'round' (keys are `dtrain fl simulate` flag names)"))
      << out.text;
  std::ofstream(dir / "plan.toml") << "[plan]\nmodel = \"gpt-9\"\ncluster = \"a100-selene\"\n";
  out = run(kDtrain + " plan --config " + (dir / "plan.toml"));
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "unknown --model 'gpt-9'")) << out.text;
}

// A Llama with experts (issue 81's first part) from the command line: two ranks under zero3
// train it (the validation loss falls), its checkpoint rebuilds it for `dtrain generate`, and
// Hugging Face's names, which it does not have yet, are refused by name.
// --expert-parallel: the experts split over the two ranks train a llama that learns, its
// checkpoint (one file per expert rank) resumes without expert parallelism, then under zero3 with
// them split again, and generates.
TEST(Cli, ExpertsSplitOverRanksTrainResumeAndGenerate) {
  using namespace dtrain::test::cli;
  dtrain::test::TempDir dir;
  const std::string common =
      " train --model llama --dataset text --layers 2 --width 32 --heads 4 --context 32 "
      "--moe-experts 4 --moe-first-dense 1 --warmup-steps 0 --eval-every 15 --nproc 2 "
      "--threads 1 --no-progress --checkpoint-dir " +
      (dir / "ckpt") + " --metrics " + (dir / "m.jsonl");
  auto out = run(kDtrain + common + " --max-steps 30 --expert-parallel 2 --moe-bias-rate 0.01");
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "2 ranks, ddp, experts over 2 ranks)")) << out.text;
  std::vector<double> validation, imbalance;
  std::ifstream metrics(dir / "m.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("event", "") == "eval") validation.push_back(record["val_loss"].get<double>());
    if (record.value("event", "") == "step") {
      imbalance.push_back(record.at("moe_imbalance.blocks.1").get<double>());
      EXPECT_EQ(record.at("moe_dropped").get<double>(), 0.0);  // dropless
    }
  }
  ASSERT_GE(imbalance.size(), 3u) << out.text;  // a step record every 10 steps
  EXPECT_GE(*std::min_element(imbalance.begin(), imbalance.end()), 1.0);
  ASSERT_GE(validation.size(), 2u) << out.text;
  EXPECT_LT(validation.back(), validation.front());
  out = run(kDtrain + common + " --max-steps 35");
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "resumed from step 30")) << out.text;
  EXPECT_TRUE(has(out,
                  "(DP 2 x PP 1 x TP 1, experts over 2); now ddp on 2 ranks (DP 2 x PP 1 x "
                  "TP 1)"))
      << out.text;
  // zero3 with the experts split again: each rank cuts its shards of its experts from the pieces.
  out = run(kDtrain + common + " --max-steps 40 --strategy zero3 --expert-parallel 2");
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "resumed from step 35")) << out.text;
  EXPECT_TRUE(has(out, "zero3, experts over 2 ranks)")) << out.text;
  out = run(kDtrain + " generate --checkpoint " + (dir / "ckpt") +
            " --prompt 'The cat' --tokens 10 --seed 3");
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_EQ(out.text.rfind("The cat", 0), 0u) << out.text;
}

// --precision bf16-master with the experts split over 2 ranks, under zero3 (a bf16 shard of each
// rank's experts, its fp32 master, fp32 gradients reduce-scattered over the ranks holding the same
// experts), ddp (fp32 masters of the rank's experts, their gradients reduced in fp32 over their
// group), zero1 and zero2 (fp32 masters of the experts' shards): the losses and the final weights
// follow the same run with every expert on every rank to bf16's rounding, and it learns; zero2's
// stopped and resumed gives its uninterrupted losses exactly. Pipelines of 2 stages (4 ranks, the
// experts over each stage's 2) the same way: of ddp stages (fp32 masters of the rank's experts,
// as ddp's) and of zero1 stages (fp32 masters of the experts' shards, as zero1's).
TEST(Cli, SplitExpertsTrainInBf16MasterUnderDdpAndZero) {
  using namespace dtrain::test::cli;
  dtrain::test::TempDir dir;
  const std::string common =
      " train --model llama --dataset text --layers 2 --width 32 --heads 4 --context 32 "
      "--moe-experts 4 --moe-first-dense 1 --warmup-steps 0 --log-every 1 --eval-every 20 "
      "--max-steps 20 --threads 1 --no-progress --precision bf16-master --no-run-dir";
  for (const std::string strategy :
       {"zero3", "ddp", "zero1", "zero2", "pipeline-ddp", "pipeline-zero1"}) {
    const bool pipeline = strategy.rfind("pipeline-", 0) == 0;
    const std::string stages = pipeline ? strategy.substr(9) : strategy;
    const std::string flags =
        common + " --strategy " + stages +
        (pipeline ? " --pipeline-parallel 2 --micro-batches 2 --nproc 4" : " --nproc 2") +
        " --metrics ";
    auto out = run(kDtrain + flags + (dir / (strategy + "-whole.jsonl")) + " --checkpoint-dir " +
                   (dir / (strategy + "-whole")));
    ASSERT_EQ(out.code, 0) << out.text;
    out = run(kDtrain + flags + (dir / (strategy + "-split.jsonl")) + " --expert-parallel 2" +
              " --checkpoint-dir " + (dir / (strategy + "-split")));
    ASSERT_EQ(out.code, 0) << out.text;
    const double apart = max_difference(final_parameters(dir / (strategy + "-whole")),
                                        final_parameters(dir / (strategy + "-split")));
    // Every parameter (the masters) to bf16's noise: 0.0036 here, where experts left untrained
    // (their gradients dropped) end 0.024 apart.
    EXPECT_LT(apart, 0.012) << strategy;
    EXPECT_TRUE(has(
        out, (pipeline ? "2-stage pipeline x " + stages : strategy) + ", experts over 2 ranks)"))
        << out.text;
    const auto whole = metric_values(dir / (strategy + "-whole.jsonl"), "step", "loss");
    const auto split = metric_values(dir / (strategy + "-split.jsonl"), "step", "loss");
    ASSERT_EQ(whole.size(), 20u) << out.text;
    ASSERT_EQ(split.size(), 20u) << out.text;
    for (size_t i = 0; i < whole.size(); ++i) {
      EXPECT_NEAR(split[i], whole[i], 0.02 * whole[i]) << strategy << ", step " << i;
    }
    EXPECT_LT(split.back(), 0.9 * split.front()) << strategy;  // it learns (4.73 to 4.00)
    if (strategy != "zero2" && strategy != "pipeline-zero1") continue;
    // Stopped at step 10 and resumed: the uninterrupted run's losses (the experts' fp32 master
    // pieces and Adam state from the checkpoint).
    out = run(kDtrain + flags + (dir / (strategy + "-stopped.jsonl")) +
              " --expert-parallel 2 --checkpoint-dir " + (dir / (strategy + "-resumable")) +
              " --stop-at-step 10 --checkpoint-every 10");
    ASSERT_EQ(out.code, 0) << out.text;
    out = run(kDtrain + flags + (dir / (strategy + "-resumed.jsonl")) +
              " --expert-parallel 2 --checkpoint-dir " + (dir / (strategy + "-resumable")));
    ASSERT_EQ(out.code, 0) << out.text;
    EXPECT_TRUE(has(out, "resumed from step 10")) << out.text;
    const auto resumed = metric_values(dir / (strategy + "-resumed.jsonl"), "step", "loss");
    ASSERT_EQ(resumed.size(), 10u) << out.text;
    for (size_t i = 0; i < resumed.size(); ++i) {
      EXPECT_EQ(resumed[i], split[10 + i]) << strategy << ", resumed, step " << 10 + i;
    }
  }
}

// A pipeline of 2 stages whose experts are split over each stage's 2 data-parallel ranks (PP x
// EP, as DeepSeek-V3 trained), under DualPipe-V (its pairs on two threads): it learns, every
// stage's MoE layers report their balance, and its checkpoint resumes under ddp with tensor
// parallelism (TP x EP), then generates.
TEST(Cli, APipelineWithExpertsSplitTrainsAndResumesUnderDdp) {
  using namespace dtrain::test::cli;
  dtrain::test::TempDir dir;
  const std::string common =
      " train --model llama --dataset text --layers 3 --width 32 --heads 4 --context 32 "
      "--moe-experts 4 --moe-first-dense 1 --warmup-steps 0 --eval-every 10 --threads 1 "
      "--no-progress --checkpoint-dir " +
      (dir / "ckpt") + " --metrics " + (dir / "m.jsonl");
  auto out = run(kDtrain + common +
                 " --max-steps 20 --pipeline-parallel 2 --micro-batches 4 --schedule dualpipev "
                 "--nproc 4 --batch-size 16 --expert-parallel 2 --moe-bias-rate 0.01 "
                 "--checkpointing selective");
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "experts over 2 ranks")) << out.text;
  std::vector<double> validation;
  int steps = 0;
  std::ifstream metrics(dir / "m.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("event", "") == "eval") validation.push_back(record["val_loss"].get<double>());
    if (record.value("event", "") == "step") {
      ++steps;
      // Both stages' layers, their loads summed over the stage's ranks.
      EXPECT_GE(record.at("moe_imbalance.blocks.1").get<double>(), 1.0);
      EXPECT_GE(record.at("moe_imbalance.blocks.2").get<double>(), 1.0);
      EXPECT_GT(record.at("moe_aux_loss").get<double>(), 0.5);
    }
  }
  EXPECT_GE(steps, 2) << out.text;
  ASSERT_GE(validation.size(), 2u) << out.text;
  EXPECT_LT(validation.back(), validation.front());
  out = run(kDtrain + common +
            " --max-steps 23 --nproc 4 --tensor-parallel 2 --expert-parallel 2 --global-batch 128");
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "resumed from step 20")) << out.text;
  EXPECT_TRUE(has(out, "tensor")) << out.text;
  out = run(kDtrain + " generate --checkpoint " + (dir / "ckpt") +
            " --prompt 'The cat' --tokens 10 --seed 3");
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_EQ(out.text.rfind("The cat", 0), 0u) << out.text;
}

// --context-parallel 2 over 4 ranks (2 data-parallel x 2 context): the same losses as the
// whole sequences on 2 ranks (float32, ring attention), the same evaluation (loss and accuracy
// counted once); its checkpoint resumes without the split, and the finished run equals
// the uninterrupted one.
TEST(Cli, AContextSplitTrainsAsTheWholeSequenceAndResumesWithoutIt) {
  using namespace dtrain::test::cli;
  dtrain::test::TempDir dir;
  const std::string common =
      " train --model llama --dataset text --layers 2 --width 32 --heads 4 --kv-heads 2 "
      "--context 32 --warmup-steps 0 --eval-every 6 --log-every 1 --threads 1 --no-progress "
      "--max-steps 12 --global-batch 16 --batch-size 8";
  const auto& records = metric_values;
  auto out = run(kDtrain + common + " --nproc 2 --metrics " + (dir / "whole.jsonl"));
  ASSERT_EQ(out.code, 0) << out.text;
  const std::vector<double> losses = records(dir / "whole.jsonl", "step", "loss");
  const std::vector<double> evaluated = records(dir / "whole.jsonl", "eval", "val_loss");
  const std::vector<double> accuracy = records(dir / "whole.jsonl", "eval", "val_accuracy");
  ASSERT_EQ(losses.size(), 12u) << out.text;
  ASSERT_EQ(evaluated.size(), 2u) << out.text;
  out =
      run(kDtrain + common + " --nproc 4 --context-parallel 2 --stop-at-step 6 --metrics " +
          (dir / "split.jsonl") + " --checkpoint-dir " + (dir / "ckpt") + " --checkpoint-every 6");
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "x context-parallel 2")) << out.text;
  const std::vector<double> split = records(dir / "split.jsonl", "step", "loss");
  ASSERT_EQ(split.size(), 6u) << out.text;
  for (size_t i = 0; i < split.size(); ++i) EXPECT_NEAR(split[i], losses[i], 1e-4) << "step " << i;
  const std::vector<double> split_eval = records(dir / "split.jsonl", "eval", "val_loss");
  ASSERT_EQ(split_eval.size(), 1u) << out.text;
  EXPECT_NEAR(split_eval[0], evaluated[0], 1e-4);
  EXPECT_NEAR(records(dir / "split.jsonl", "eval", "val_accuracy")[0], accuracy[0], 1e-6);
  out = run(kDtrain + common + " --nproc 2 --metrics " + (dir / "resumed.jsonl") +
            " --checkpoint-dir " + (dir / "ckpt"));
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "resumed from step 6")) << out.text;
  const std::vector<double> resumed = records(dir / "resumed.jsonl", "step", "loss");
  ASSERT_EQ(resumed.size(), 6u) << out.text;
  EXPECT_NEAR(resumed.back(), losses.back(), 1e-4);
  EXPECT_NEAR(records(dir / "resumed.jsonl", "eval", "val_loss").back(), evaluated.back(), 1e-4);
}

// Packed sequences: with --reset-attention-mask and the newline (token 0 of a text of lines
// without tabs) as the end of each document, a llama trains (2 context-parallel ranks) to other
// losses than without the mask, and split into 2 pipeline stages instead (the second stage
// learns the documents from the micro-batch's tokens) to the same ones, and with dropout; without
// a token that ends documents the flag is refused.
TEST(Cli, PackedDocumentsTrainWithTheirOwnMask) {
  using namespace dtrain::test::cli;
  dtrain::test::TempDir dir;
  {
    std::ofstream text(dir / "lines.txt");
    for (int i = 0; i < 600; ++i) text << "line " << i % 17 << " of a short text " << i % 5 << "\n";
  }
  auto refused = run(kDtrain + " train --model llama --dataset text --text-file " +
                     (dir / "lines.txt") + " --reset-attention-mask --max-steps 1");
  EXPECT_EQ(refused.code, 2) << refused.text;
  EXPECT_TRUE(has(refused,
                  "--reset-attention-mask needs the end-of-document token: the data's "
                  "tokenizer names none; give --eod-token ID"))
      << refused.text;
  const std::string common =
      " train --model llama --dataset text --text-file " + (dir / "lines.txt") +
      " --layers 2 --width 32 --heads 4 --context 32 "
      "--warmup-steps 0 --log-every 1 --threads 1 --no-progress --max-steps 4 --global-batch 8 "
      "--batch-size 4 --nproc 2 --context-parallel 2";
  auto out = run(kDtrain + common + " --metrics " + (dir / "plain.jsonl"));
  ASSERT_EQ(out.code, 0) << out.text;
  out = run(kDtrain + common + " --reset-attention-mask --eod-token 0 --metrics " +
            (dir / "packed.jsonl"));
  ASSERT_EQ(out.code, 0) << out.text;
  auto last_loss = [](const std::string& path) {
    double loss = 0;
    std::ifstream metrics(path);
    for (std::string line; std::getline(metrics, line);) {
      const auto record = nlohmann::json::parse(line);
      if (record.value("event", "") == "step") loss = record["loss"].get<double>();
    }
    return loss;
  };
  EXPECT_GT(std::abs(last_loss(dir / "packed.jsonl") - last_loss(dir / "plain.jsonl")), 1e-4);
  std::string piped = common;
  piped.replace(piped.find("--context-parallel 2"), std::string("--context-parallel 2").size(),
                "--pipeline-parallel 2 --checkpointing 2");
  out = run(kDtrain + piped + " --reset-attention-mask --eod-token 0 --metrics " +
            (dir / "piped.jsonl"));
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_NEAR(last_loss(dir / "piped.jsonl"), last_loss(dir / "packed.jsonl"), 1e-4);
  // With dropout, split over the context group: it trains, to other losses.
  out = run(kDtrain + common + " --reset-attention-mask --eod-token 0 --dropout 0.2 --metrics " +
            (dir / "dropped.jsonl"));
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(std::isfinite(last_loss(dir / "dropped.jsonl")));
  EXPECT_GT(std::abs(last_loss(dir / "dropped.jsonl") - last_loss(dir / "packed.jsonl")), 1e-4);
}

// The named mixture-of-experts sizes of configs/: a dry run counts Mixtral 8x7B's shape (total
// and active, and the planner its memory per rank, with the experts split too) without building
// it, and the tiny one trains.
TEST(Cli, TheNamedMixtureOfExpertsSizesCountAndTrain) {
  using namespace dtrain::test::cli;
  // (It does not fit here: the dry run says so, exit 2.)
  auto out = run(kDtrain + " train --config " DTRAIN_SOURCE_DIR
                           "/configs/mixtral-8x7b.toml --dataset text --nproc 2 --dry-run");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "B parameters active per token of 46.442 B (8 experts, top-2)")) << out.text;
  EXPECT_TRUE(has(out, "memory per rank   step")) << out.text;  // the planner's count
  EXPECT_TRUE(has(out, "parameters 173.01")) << out.text;       // fp32, every expert
  EXPECT_TRUE(has(out, "the run does not fit")) << out.text;
  out = run(kDtrain + " train --config " DTRAIN_SOURCE_DIR
                      "/configs/mixtral-8x7b.toml --dataset text --nproc 2 --expert-parallel 2 "
                      "--dry-run");
  EXPECT_EQ(out.code, 2) << out.text;
  EXPECT_TRUE(has(out, "layout            ddp dp2 pp1 tp1 ep2")) << out.text;
  EXPECT_TRUE(has(out, "parameters 89.01")) << out.text;  // half the experts
  out = run(kDtrain + " train --config " DTRAIN_SOURCE_DIR
                      "/configs/moe-tiny.toml --dataset text --max-steps 3 --no-progress "
                      "--no-run-dir --threads 1");
  ASSERT_EQ(out.code, 0) << out.text;
  EXPECT_TRUE(has(out, "trained 3 steps")) << out.text;
}

TEST(Cli, AMixtureOfExpertsLlamaTrainsCheckpointsAndGenerates) {
  using namespace dtrain::test::cli;
  dtrain::test::TempDir dir;
  auto out = run(kDtrain +
                 " train --model llama --dataset text --layers 2 --width 32 --heads 4 --context "
                 "32 --moe-experts 4 --moe-shared-experts 1 --moe-first-dense 1 --max-steps 40 "
                 "--warmup-steps 0 --eval-every 20 --nproc 2 --strategy zero3 --threads 1 "
                 "--no-progress --checkpoint-dir " +
                 (dir / "ckpt") + " --metrics " + (dir / "m.jsonl"));
  ASSERT_EQ(out.code, 0) << out.text;
  std::vector<double> validation;
  std::ifstream metrics(dir / "m.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("event", "") == "eval") validation.push_back(record["val_loss"].get<double>());
  }
  ASSERT_GE(validation.size(), 2u) << out.text;
  EXPECT_LT(validation.back(), validation.front());
  out = run(kDtrain + " generate --checkpoint " + (dir / "ckpt") +
            " --prompt 'The cat' --tokens 10 --seed 3");
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_EQ(out.text.rfind("The cat", 0), 0u) << out.text;
  // Shared experts and a dense first block: no Mixtral names for them, so dtrain's.
  out = run(kDtrain + " ckpt export " + (dir / "ckpt") + " -o " + (dir / "st"));
  EXPECT_EQ(out.code, 0) << out.text;
  EXPECT_FALSE(std::filesystem::exists(dir / "st/config.json")) << out.text;
  EXPECT_TRUE(std::filesystem::exists(dir / "st/model.safetensors")) << out.text;
}
