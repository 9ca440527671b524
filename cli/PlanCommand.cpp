// `dtrain plan`: predicted step time and memory of a layout on a cluster (or the best layouts,
// --search), from the planner's simulation (dtrain/plan/Planner.h, docs/PLAN.md).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "Command.h"
#include "CommonFlags.h"
#include "ConfigFile.h"
#include "Units.h"
#include "dtrain/common/Error.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/parallel/pipeline/Schedule.h"
#include "dtrain/plan/Calibrate.h"
#include "dtrain/plan/Planner.h"

namespace dtrain::cli {

namespace {

using plan::Layout;
using plan::Prediction;

std::vector<std::string> hardware_dirs(const std::vector<std::string>& extra) {
  std::vector<std::string> dirs = extra;
  if (const char* env = std::getenv("DTRAIN_HARDWARE_DIR")) dirs.push_back(env);
#ifdef DTRAIN_HARDWARE_DIR
  dirs.push_back(DTRAIN_HARDWARE_DIR);
#endif
  return dirs;
}

/// "a, b, c" (for a flag's help).
std::string joined(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

std::string seconds(double s) {
  char text[32];
  if (s >= 1) {
    std::snprintf(text, sizeof text, "%.3f s", s);
  } else if (s >= 1e-3) {
    std::snprintf(text, sizeof text, "%.2f ms", s * 1e3);
  } else {
    std::snprintf(text, sizeof text, "%.1f us", s * 1e6);
  }
  return text;
}

nlohmann::json to_json(const plan::Memory& m) {
  return {{"parameters", m.parameters},
          {"gradients", m.gradients},
          {"optimizer", m.optimizer},
          {"activations", m.activations},
          {"buffers", m.buffers},
          {"total", m.total()},
          {"setup", m.setup},
          {"peak", m.peak()},
          {"host", m.host},
          {"disk", m.disk}};
}

/// The share of a rank's memory a prediction leaves free.
double headroom(const Prediction& p, const plan::Cluster& cluster) {
  return 1.0 - p.memory.total() / plan::rank_memory_bytes(cluster);
}

/// A layout that fits with less than kMinHeadroom of the device free: not a plan (the CUDA
/// context, the communication libraries' buffers and the allocator's fragmentation take a few
/// GiB the model does not count).
constexpr double kMinHeadroom = 0.10;
bool tight(const Prediction& p, const plan::Cluster& cluster) {
  return p.fits && headroom(p, cluster) < kMinHeadroom;
}

nlohmann::json to_json(const Prediction& p, const plan::Cluster& cluster) {
  const Layout& l = p.layout;
  nlohmann::json stages = nlohmann::json::array();
  for (const auto& m : p.stage_memory) stages.push_back(to_json(m));
  return {{"layout", l.describe()},
          {"strategy", l.strategy},
          {"dp", l.dp},
          {"pp", l.pp},
          {"tp", l.tp},
          {"ep", l.ep},
          {"cp", l.cp},
          {"cp_method", l.cp > 1 ? l.cp_method : "none"},
          {"micro_batch_size", l.micro_batch_size},
          {"micro_batches", l.micro_batches},
          {"global_batch", l.global_batch()},
          {"schedule", l.pp > 1 ? l.schedule : "none"},
          {"chunks", l.chunks},
          {"pipeline_sync", l.pp > 1 ? l.pipeline_sync : "none"},
          {"precision", l.precision},
          {"checkpointing", l.checkpointing},
          {"selective_recompute", l.selective_recompute && !l.checkpointing},
          {"gpus", cluster.gpus()},
          {"step_s", p.step_s},
          {"compute_s", p.compute_s},
          {"bubble", p.bubble},
          {"exposed_comm_s", p.exposed_comm_s},
          {"optimizer_s", p.optimizer_s},
          {"samples_per_s", p.samples_per_s},
          {"model_tflops_per_gpu", p.model_flops_per_step / p.step_s / cluster.gpus() / 1e12},
          {"mfu", p.mfu},
          {"memory_bytes", to_json(p.memory)},
          {"memory_bytes_per_stage", stages},
          {"fits", p.fits},
          {"setup_fits", p.setup_fits},
          {"memory_headroom", headroom(p, cluster)},
          {"tight", tight(p, cluster)}};
}

void print_prediction(const Prediction& p, const plan::Cluster& cluster) {
  const auto& m = p.memory;
  std::printf("layout            %s\n", p.layout.describe().c_str());
  std::printf(
      "step time         %s  (busiest rank computes %s, pipeline bubble %.1f%%, "
      "exposed communication %s, optimizer %s)\n",
      seconds(p.step_s).c_str(), seconds(p.compute_s).c_str(), 100 * p.bubble,
      seconds(p.exposed_comm_s).c_str(), seconds(p.optimizer_s).c_str());
  std::printf("throughput        %.1f samples/s  (global batch %lld)\n", p.samples_per_s,
              static_cast<long long>(p.layout.global_batch()));
  std::printf("model flops       %.1f TFLOP/s per GPU, MFU %.1f%%\n",
              p.model_flops_per_step / p.step_s / cluster.gpus() / 1e12, 100 * p.mfu);
  std::printf(
      "memory per rank   %.2f GiB of %.2f  (parameters %.2f, gradients %.2f, optimizer "
      "%.2f, activations %.2f, buffers %.2f)%s\n",
      m.total() / kGiB, plan::rank_memory_bytes(cluster) / kGiB, m.parameters / kGiB,
      m.gradients / kGiB, m.optimizer / kGiB, m.activations / kGiB, m.buffers / kGiB,
      p.fits ? "" : "  DOES NOT FIT");
  std::printf("setup per rank    %.2f GiB  (building the model and cutting its shards)%s\n",
              m.setup / kGiB,
              p.setup_fits ? ""
                           : "  MORE THAN A RANK HAS: a pipeline rank builds every stage today "
                             "(issue 80); zero3 without a pipeline draws only its shard");
  if (m.host > 0) std::printf("host memory       %.2f GiB per rank (offloaded)\n", m.host / kGiB);
  if (m.disk > 0) std::printf("disk              %.2f GiB per rank (offloaded)\n", m.disk / kGiB);
  if (tight(p, cluster)) {
    std::printf(
        "                  TIGHT: %.1f%% of the device, less than %.0f%% left for the CUDA "
        "context, communication buffers and the allocator's fragmentation (not a plan: more "
        "ranks per stage, recomputation or a smaller micro-batch)\n",
        100 * (1 - headroom(p, cluster)), 100 * kMinHeadroom);
  }
}

/// A line chart as SVG: throughput (left axis) and scaling efficiency (right axis) against
/// GPUs (log scale).
void write_scaling_svg(const std::string& file, const std::string& title,
                       const std::vector<int>& gpus, const std::vector<double>& throughput,
                       const std::vector<double>& efficiency) {
  std::ofstream out(file);
  DTRAIN_CHECK_INPUT(out.good(), "--plot: cannot write '", file, "'");
  const double W = 720, H = 420, left = 80, right = 80, top = 50, bottom = 60;
  const double lo = std::log2(std::max(1, gpus.front())),
               hi = std::log2(std::max(gpus.back(), gpus.front() * 2));
  double tmax = 0;
  for (double t : throughput) tmax = std::max(tmax, t);
  tmax *= 1.1;
  auto x = [&](int g) { return left + (std::log2(g) - lo) / (hi - lo) * (W - left - right); };
  auto yt = [&](double t) { return H - bottom - t / tmax * (H - top - bottom); };
  auto ye = [&](double e) { return H - bottom - e / 1.1 * (H - top - bottom); };
  out << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
      << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' "
         "fill='white'/>\n";
  out << "<text x='" << W / 2 << "' y='24' text-anchor='middle' font-size='14'>" << title
      << "</text>\n";
  out << "<line x1='" << left << "' y1='" << H - bottom << "' x2='" << W - right << "' y2='"
      << H - bottom << "' stroke='black'/>\n";
  for (size_t i = 0; i < gpus.size(); ++i) {
    out << "<text x='" << x(gpus[i]) << "' y='" << H - bottom + 18 << "' text-anchor='middle'>"
        << gpus[i] << "</text>\n";
  }
  out << "<text x='" << W / 2 << "' y='" << H - 15 << "' text-anchor='middle'>GPUs</text>\n";
  for (int k = 0; k <= 4; ++k) {
    const double t = tmax * k / 4.4 * 1.0;
    out << "<text x='" << left - 6 << "' y='" << yt(t) + 4 << "' text-anchor='end' fill='#1f77b4'>"
        << static_cast<long long>(t) << "</text>\n";
    out << "<text x='" << W - right + 6 << "' y='" << ye(k * 0.25) + 4 << "' fill='#d62728'>"
        << k * 25 << "%</text>\n";
  }
  out << "<text x='20' y='" << top - 12 << "' fill='#1f77b4'>samples/s</text>\n";
  out << "<text x='" << W - right << "' y='" << top - 12
      << "' fill='#d62728'>scaling efficiency</text>\n";
  auto polyline = [&](const std::vector<double>& ys, auto y, const char* colour) {
    out << "<polyline fill='none' stroke='" << colour << "' stroke-width='2' points='";
    for (size_t i = 0; i < gpus.size(); ++i) out << x(gpus[i]) << "," << y(ys[i]) << " ";
    out << "'/>\n";
    for (size_t i = 0; i < gpus.size(); ++i) {
      out << "<circle cx='" << x(gpus[i]) << "' cy='" << y(ys[i]) << "' r='3' fill='" << colour
          << "'/>\n";
    }
  };
  polyline(throughput, yt, "#1f77b4");
  polyline(efficiency, ye, "#d62728");
  out << "</svg>\n";
}

class PlanCommand final : public Command {
 public:
  explicit PlanCommand(CLI::App& app) {
    app_ = app.add_subcommand(
        "plan",
        "Predict step time and memory of a layout on a cluster, or search the best layouts "
        "(a simulation of dtrain's schedules, buckets and shards: docs/PLAN.md)");
    app_->add_option("--model", model_,
                     "gpt or llama (dtrain train's decoders: their shape from the flags below "
                     "or a config file, --config configs/llama-1b.toml, and --vocab), resnet50, "
                     "a paper's transformer (megatron-8.3b, gpt-1t, ...) or "
                     "transformer:layers=L,hidden=H,heads=A,seq=S,vocab=V[,ffn=F,tied=0,"
                     "dropout=0,fused=0,flash=1] (flash=1: attention in one FlashAttention "
                     "kernel)");
    // The decoders' shape flags, as the models declare them (those of dtrain train).
    FlagSet decoder;
    models::declare_model_flags(decoder, spec_,
                                [](const models::ModelInfo& info) { return info.language_model; });
    add_flags(*app_, decoder);
    app_->add_option("--vocab", vocab_,
                     "gpt, llama: the tokenizer's vocabulary (Llama 3's: 128256; GPT-2's: 50257)");
    app_->add_flag("--flash-attention,!--no-flash-attention", flash_,
                   "gpt, llama: attention in one fused kernel (LibTorch 2.x, GPUs; default), or "
                   "written out as on LibTorch 1.13")
        ->capture_default_str();
    app_->add_option("--cluster", cluster_,
                     "Hardware profile: a name (configs/hardware) or a .toml file");
    app_->add_option("--hardware-dir", hardware_dirs_, "More directories holding profiles");
    app_->add_option("--nodes", nodes_, "Nodes")->capture_default_str();
    app_->add_option("--gpus-per-node", gpus_per_node_, "GPUs per node (default: the profile's)");
    app_->add_option("--strategy", layout_.strategy, joined(plan::planned_strategies()))
        ->capture_default_str();
    app_->add_option("--dp", dp_, "Data-parallel size (default: the GPUs left by pp x tp)");
    app_->add_option("--pp", layout_.pp, "Pipeline stages")->capture_default_str();
    app_->add_option("--tp", layout_.tp, "Tensor-parallel size")->capture_default_str();
    app_->add_option("--ep", layout_.ep,
                     "Expert-parallel size: a mixture of experts' experts split over this many "
                     "data-parallel ranks")
        ->capture_default_str();
    app_->add_option("--cp", layout_.cp,
                     "Context-parallel size: each sample's sequence split over this many "
                     "data-parallel ranks (dtrain train --context-parallel; --search tries 2 to "
                     "16 for sequences of 8192 tokens and more)")
        ->capture_default_str();
    app_->add_option("--cp-method", layout_.cp_method,
                     "--cp: ring (transfers hidden behind each block's attention where they can "
                     "be), allgather or ulysses")
        ->capture_default_str();
    app_->add_option("--micro-batch-size", layout_.micro_batch_size, "Samples per micro-batch")
        ->capture_default_str();
    app_->add_option("--micro-batches", micro_batches_, "Micro-batches per step");
    app_->add_option("--global-batch", global_batch_,
                     "Samples per step (sets --micro-batches; required by --search)");
    app_->add_option("--schedule", layout_.schedule, joined(parallel::pipeline::schedule_names()))
        ->capture_default_str();
    app_->add_option("--pipeline-sync", layout_.pipeline_sync,
                     "flush, 2bw, eager or async (PipeDream's flush-free 1F1B, as dtrain train's)")
        ->capture_default_str();
    app_->add_option("--stage-replicas", layout_.stage_replicas,
                     "PipeDream's layouts: stage s on R_s GPUs (R0,R1,...; sets --pp; one data "
                     "stream, 1f1b or gpipe, ddp), as dtrain train's")
        ->delimiter(',');
    app_->add_flag("--replicated-stages", replicated_stages_,
                   "--search: also PipeDream's layouts, every uneven split of the GPUs (up to "
                   "16) over 2 to 4 stages");
    app_->add_option("--chunks", layout_.chunks,
                     "Model chunks per pipeline rank (interleaved; zb-v runs 2)")
        ->capture_default_str();
    app_->add_option("--precision", layout_.precision,
                     "fp32, bf16-mixed, fp16-mixed, bf16, bf16-master (dtrain train's and "
                     "Megatron's --bf16: bf16 weights, fp32 gradients and master weights), "
                     "fp16-master (Megatron's --fp16: fp16 weights and gradients, fp32 master)")
        ->capture_default_str();
    app_->add_flag("--checkpointing", layout_.checkpointing,
                   "Activation checkpointing of every layer");
    app_->add_flag("--selective-recompute", layout_.selective_recompute,
                   "Selective recomputation: only attention's core recomputed in backward "
                   "(dtrain train --checkpointing selective)");
    step_flags_.push_back(app_->add_flag("--sequence-parallel,!--no-sequence-parallel",
                                         layout_.sequence_parallel,
                                         "Megatron sequence parallelism; --search tries it "
                                         "wherever tp > 1 unless pinned on or off"));
    app_->add_option("--optimizer", layout_.optimizer, "adam, momentum, sgd")
        ->capture_default_str();
    app_->add_option("--bucket-mb", bucket_mb_, "Gradient bucket cap in MiB")
        ->capture_default_str();
    app_->add_flag("--hierarchical-allreduce", layout_.hierarchical_allreduce,
                   "Data-parallel buckets reduced inside nodes, then across");
    step_flags_.push_back(app_->add_flag(
        "--overlap-param-gather,!--no-overlap-param-gather", layout_.overlap_param_gather,
        "zero1, zero2: the update's parameter all-gathers overlapped with the next forward "
        "(dtrain train --overlap-param-gather); --search tries it for every zero1 and zero2 "
        "layout unless pinned on or off"));
    step_flags_.push_back(app_->add_flag(
        "--tp-comm-overlap,!--no-tp-comm-overlap", layout_.tp_comm_overlap,
        "tp > 1: backward's input-gradient all-reduces beside the weight gradients (dtrain train "
        "--tp-comm-overlap); --search tries it wherever tp > 1 unless pinned on or off"));
    app_->add_option("--ps-shards", layout_.ps_shards, "downpour: parameter-server shards")
        ->capture_default_str();
    app_->add_option("--offload", layout_.offload,
                     "Where the optimizer's state lives (dtrain train --offload): none, host "
                     "(with fp32 master weights; the step on the CPU), disk (files read and "
                     "written every step); --search tries host and disk for layouts that do not "
                     "fit, where the profile gives the rates (node.host_*, node.disk_*)")
        ->capture_default_str();
    app_->add_flag("--search", search_,
                   "Rank every valid layout that fits, by predicted step time");
    app_->add_option("--top", top_, "--search: layouts to print")->capture_default_str();
    app_->add_option("--strategies", strategies_,
                     "--search: the strategies to consider (default every synchronous one the "
                     "planner models)")
        ->delimiter(',');
    app_->add_option("--schedules", schedules_,
                     "--search: the pipeline schedules to consider (default all)")
        ->delimiter(',');
    app_->add_option("--scaling", scaling_,
                     "Node counts: the layout at each, data parallelism filling the GPUs (weak "
                     "scaling: the per-replica batch stays), with throughput and efficiency")
        ->delimiter(',');
    app_->add_option("--plot", plot_, "--scaling: write the curves to this SVG file");
    app_->add_flag("--json", json_, "Print JSON instead of text");
    calibrate_ = app_->add_subcommand(
        "calibrate",
        "Measure this machine (matrix products, memory, Gloo on loopback) and write "
        "a hardware profile of it");
    calibrate_->add_option("--out", calibrate_out_, "The profile to write (.toml)")->required();
    calibrate_->add_option("--threads", calibrate_options_.threads, "LibTorch threads per rank")
        ->capture_default_str();
    calibrate_
        ->add_option("--probe-seconds", calibrate_options_.probe_seconds, "Time per measurement")
        ->capture_default_str();
    calibrate_->add_option("--disk-dir", calibrate_options_.disk_dir,
                           "Also measure the disk under this folder (512 MiB written and read "
                           "with O_DIRECT), for --offload disk's predictions");
    add_config_option(*app_);
  }
  std::vector<std::string> expand(const std::vector<std::string>& args) override {
    return expand_config(args, *app_, {"plan"});
  }
  bool parsed() const override { return app_->parsed(); }

  int run(const std::vector<std::string>&) override {
    if (calibrate_->parsed()) {
      const std::string toml = plan::calibrate(calibrate_options_, [](const std::string& line) {
        std::printf("calibrate: %s\n", line.c_str());
        std::fflush(stdout);
      });
      std::ofstream out(calibrate_out_);
      DTRAIN_CHECK_INPUT(out.good(), "calibrate: cannot write '", calibrate_out_, "'");
      out << toml;
      std::printf("calibrate: wrote %s\n", calibrate_out_.c_str());
      return 0;
    }
    DTRAIN_CHECK_INPUT(!model_.empty(), "plan: --model is required");
    DTRAIN_CHECK_INPUT(!cluster_.empty(), "plan: --cluster is required (a profile: ",
                       "configs/hardware/*.toml, or `dtrain plan calibrate` for this machine)");
    const plan::ModelCost model = model_cost();
    plan::Cluster cluster;
    cluster.hardware = plan::load_hardware(cluster_, hardware_dirs(hardware_dirs_));
    cluster.nodes = nodes_;
    cluster.gpus_per_node = gpus_per_node_;
    DTRAIN_CHECK_INPUT(nodes_ >= 1, "--nodes must be >= 1, got ", nodes_);
    DTRAIN_CHECK_INPUT(gpus_per_node_ >= 0, "--gpus-per-node must be >= 1, got ", gpus_per_node_);
    DTRAIN_CHECK_INPUT(bucket_mb_ > 0, "--bucket-mb must be > 0");
    layout_.bucket_cap_bytes = static_cast<int64_t>(bucket_mb_ * 1024 * 1024);
    if (search_) return run_search(model, cluster);
    if (!scaling_.empty()) return run_scaling(model, cluster);
    const Prediction p = plan::predict(model, cluster, layout_for(cluster));
    // --json prints the prediction even when it does not fit (the memory is the answer).
    if (json_) {
      std::printf("%s\n", to_json(p, cluster).dump(2).c_str());
      std::fflush(stdout);  // (the refusal below ends the process without flushing a pipe)
    }
    const plan::Memory& m = p.memory;
    DTRAIN_CHECK_INPUT(p.fits, "layout ", p.layout.describe(), " does not fit: it needs ",
                       gib(m.total()), " GiB per rank to step (parameters ", gib(m.parameters),
                       ", gradients ", gib(m.gradients), ", optimizer ", gib(m.optimizer),
                       ", activations ", gib(m.activations), ")",
                       m.host > 0 ? concat(", ", gib(m.host * cluster.per_node()),
                                           " GiB of host memory per node (it has ",
                                           gib(cluster.hardware.host_memory_bytes), ")")
                                  : std::string(),
                       "; a rank of the ", cluster.hardware.device, " has ",
                       gib(plan::rank_memory_bytes(cluster)));
    if (!json_) {
      std::printf("dtrain plan: %s (%.2fB parameters) on %s: %d nodes x %d GPUs (%s)\n",
                  model.name.c_str(), model.parameters() / 1e9, cluster.hardware.name.c_str(),
                  cluster.nodes, cluster.per_node(), cluster.hardware.device.c_str());
      print_prediction(p, cluster);
      std::printf("dtrain train      %s\n",
                  p.layout.train_flags(static_cast<int>(model.layers.size())).c_str());
      std::printf("the command       %s\n", p.layout.command(model, cluster).c_str());
    }
    return 0;
  }

 private:
  /// --model: a registered language model (gpt, llama) from the decoder flags, as dtrain train
  /// builds it, or one of the planner's own.
  plan::ModelCost model_cost() const {
    const std::vector<std::string> names = models::model_names();
    if (std::find(names.begin(), names.end(), model_) != names.end() &&
        models::model_info(model_).language_model) {
      DTRAIN_CHECK_INPUT(vocab_ > 0, "plan --model ", model_,
                         " needs --vocab (the tokenizer's vocabulary, e.g. 128256 for Llama 3)");
      models::GptConfig config = spec_.gpt;
      const models::ModelInfo& info = models::model_info(model_);
      if (info.decoder_preset) info.decoder_preset(config);
      config.vocab = vocab_;
      return plan::decoder(config, model_, vocab_, flash_);
    }
    return plan::model_named(model_);
  }

  Layout layout_for(const plan::Cluster& cluster) {
    Layout layout = layout_;
    if (!layout.stage_replicas.empty()) {  // one pipeline: dp 1, pp its stages
      layout.pp = static_cast<int>(layout.stage_replicas.size());
      layout.dp = 1;
      DTRAIN_CHECK_INPUT(dp_ <= 1, "--stage-replicas is one data stream: leave --dp out");
      if (global_batch_ > 0) {
        DTRAIN_CHECK_INPUT(global_batch_ % layout.micro_batch_size == 0, "--global-batch ",
                           global_batch_, " is not a multiple of the micro-batch size ",
                           layout.micro_batch_size);
        layout.micro_batches = static_cast<int>(global_batch_ / layout.micro_batch_size);
      } else {
        // (Default: the fewest that give every replica one and fill 1F1B's warm-up.)
        layout.micro_batches =
            micro_batches_ > 0
                ? micro_batches_
                : std::max(layout.pp, *std::max_element(layout.stage_replicas.begin(),
                                                        layout.stage_replicas.end()));
      }
      return layout;
    }
    const int model_parallel = layout.pp * layout.tp * layout.cp;
    DTRAIN_CHECK_INPUT(model_parallel >= 1 && cluster.gpus() % model_parallel == 0,
                       "pp x tp x cp = ", model_parallel, " does not divide the cluster's ",
                       cluster.gpus(), " GPUs");
    layout.dp = dp_ > 0 ? dp_ : cluster.gpus() / model_parallel;
    // A schedule's fixed chunks per rank (zb-v's two) go without saying, as in dtrain train.
    const int fixed = parallel::pipeline::schedule_info(layout.schedule).chunks;
    if (fixed > 0 && layout.pp > 1 && layout.chunks == 1) layout.chunks = fixed;
    if (global_batch_ > 0) {
      const int64_t per_step = static_cast<int64_t>(layout.dp) * layout.micro_batch_size;
      DTRAIN_CHECK_INPUT(global_batch_ % per_step == 0, "--global-batch ", global_batch_,
                         " is not a multiple of dp x micro-batch size = ", per_step);
      layout.micro_batches = static_cast<int>(global_batch_ / per_step);
    } else if (micro_batches_ > 0) {
      layout.micro_batches = micro_batches_;
    } else {
      layout.micro_batches = layout.pp;  // a pipeline's smallest full schedule; else 1
    }
    return layout;
  }

  int run_search(const plan::ModelCost& model, const plan::Cluster& cluster) {
    DTRAIN_CHECK_INPUT(global_batch_ > 0, "--search needs --global-batch (samples per step)");
    plan::SearchOptions options;
    options.global_batch = global_batch_;
    options.precision = layout_.precision;
    options.optimizer = layout_.optimizer;
    // The step options a flag pins (on, or off with --no-...); the others the search decides.
    auto pinned = [](const CLI::Option* flag, bool value) {
      return flag->count() > 0 ? std::optional<bool>(value) : std::nullopt;
    };
    options.sequence_parallel = pinned(step_flags_[0], layout_.sequence_parallel);
    options.overlap_param_gather = pinned(step_flags_[1], layout_.overlap_param_gather);
    options.tp_comm_overlap = pinned(step_flags_[2], layout_.tp_comm_overlap);
    options.strategies = strategies_;
    options.schedules = schedules_;
    // --pipeline-sync 2bw|eager|async with --search: those layouts compete beside the flushed ones.
    if (layout_.pipeline_sync != "flush") options.pipeline_syncs.push_back(layout_.pipeline_sync);
    options.replicated_stages = replicated_stages_;
    if (layout_.cp > 1) options.context_parallel = {layout_.cp};
    const plan::SearchResult result = plan::search(model, cluster, options);
    if (result.ranked.empty()) {
      DTRAIN_THROW(InputError, "no layout of ", model.name, " fits ", cluster.gpus(), " x ",
                   cluster.hardware.device, " (", gib(plan::rank_memory_bytes(cluster)),
                   " GiB per rank) at global batch ", global_batch_, ": the smallest of ",
                   result.considered, " layouts needs ", gib(result.smallest_memory),
                   " GiB per rank");
    }
    const size_t shown = std::min<size_t>(top_, result.ranked.size());
    if (json_) {
      nlohmann::json list = nlohmann::json::array();
      for (size_t i = 0; i < shown; ++i) {
        nlohmann::json entry = to_json(result.ranked[i], cluster);
        entry["train_flags"] =
            result.ranked[i].layout.train_flags(static_cast<int>(model.layers.size()));
        entry["command"] = result.ranked[i].layout.command(model, cluster);
        list.push_back(entry);
      }
      std::printf("%s\n", nlohmann::json{{"considered", result.considered},
                                         {"step_option_variants", result.variants},
                                         {"fit", result.ranked.size()},
                                         {"best", list}}
                              .dump(2)
                              .c_str());
      return 0;
    }
    std::printf(
        "dtrain plan --search: %s on %d x %s, global batch %lld: %d layouts considered "
        "(and %d step-option variants of the fastest), %zu fit; the best %zu:\n",
        model.name.c_str(), cluster.gpus(), cluster.hardware.device.c_str(),
        static_cast<long long>(global_batch_), result.considered, result.variants,
        result.ranked.size(), shown);
    std::printf("%3s  %-52s %10s %11s %6s %7s %10s %9s\n", "#", "layout", "step", "samples/s",
                "MFU", "bubble", "exposed", "GiB/rank");
    for (size_t i = 0; i < shown; ++i) {
      const Prediction& p = result.ranked[i];
      std::printf("%3zu  %-52s %10s %11.1f %5.1f%% %6.1f%% %10s %9.1f%s\n", i + 1,
                  p.layout.describe().c_str(), seconds(p.step_s).c_str(), p.samples_per_s,
                  100 * p.mfu, 100 * p.bubble, seconds(p.exposed_comm_s).c_str(),
                  p.memory.total() / kGiB, tight(p, cluster) ? "  tight" : "");
    }
    const int layers = static_cast<int>(model.layers.size());
    std::printf("the best as dtrain train flags: %s\n",
                result.ranked.front().layout.train_flags(layers).c_str());
    std::printf("the best as a command: %s\n",
                result.ranked.front().layout.command(model, cluster).c_str());
    if (tight(result.ranked.front(), cluster)) {
      // "tight": under 10% of the device free; the best that leaves that much, too.
      for (const Prediction& p : result.ranked) {
        if (tight(p, cluster)) continue;
        std::printf("(tight: under %.0f%% of the memory free) the best with room: %s: %s\n",
                    100 * kMinHeadroom, p.layout.describe().c_str(),
                    p.layout.train_flags(layers).c_str());
        break;
      }
    }
    return 0;
  }

  int run_scaling(const plan::ModelCost& model, plan::Cluster cluster) {
    std::vector<int> gpus;
    std::vector<double> throughput, efficiency;
    nlohmann::json rows = nlohmann::json::array();
    if (!json_) {
      std::printf("%8s %8s %-44s %10s %11s %12s %10s\n", "nodes", "GPUs", "layout", "step",
                  "samples/s", "TFLOP/s/GPU", "efficiency");
    }
    for (int nodes : scaling_) {
      DTRAIN_CHECK_INPUT(nodes >= 1, "--scaling: node counts must be >= 1, got ", nodes);
      cluster.nodes = nodes;
      Layout layout = layout_for(cluster);
      const Prediction p = plan::predict(model, cluster, layout);
      gpus.push_back(cluster.gpus());
      throughput.push_back(p.samples_per_s);
      const double per_gpu = p.samples_per_s / cluster.gpus();
      efficiency.push_back(per_gpu / (throughput.front() / gpus.front()));
      const double tflops = p.model_flops_per_step / p.step_s / cluster.gpus() / 1e12;
      if (json_) {
        auto row = to_json(p, cluster);
        row["nodes"] = nodes;
        row["scaling_efficiency"] = efficiency.back();
        rows.push_back(row);
      } else {
        std::printf("%8d %8d %-44s %10s %11.1f %12.1f %9.1f%%%s\n", nodes, cluster.gpus(),
                    layout.describe().c_str(), seconds(p.step_s).c_str(), p.samples_per_s, tflops,
                    100 * efficiency.back(), p.fits ? "" : "  (does not fit)");
      }
    }
    if (json_) std::printf("%s\n", rows.dump(2).c_str());
    if (!plot_.empty()) {
      write_scaling_svg(plot_,
                        concat(model.name, " on ", cluster.hardware.name, ": ", layout_.describe()),
                        gpus, throughput, efficiency);
      if (!json_) std::printf("plot: %s\n", plot_.c_str());
    }
    return 0;
  }

  CLI::App* app_ = nullptr;
  CLI::App* calibrate_ = nullptr;
  std::string calibrate_out_;
  plan::CalibrateOptions calibrate_options_;
  std::string model_, cluster_, plot_;
  models::ModelSpec spec_;
  int64_t vocab_ = 0;
  bool flash_ = true;
  std::vector<std::string> hardware_dirs_, strategies_, schedules_;
  int nodes_ = 1, gpus_per_node_ = 0, dp_ = 0, micro_batches_ = 0, top_ = 10;
  int64_t global_batch_ = 0;
  double bucket_mb_ = 25;
  std::vector<CLI::Option*> step_flags_;  ///< sequence parallel, the two overlaps
  Layout layout_;
  bool search_ = false, json_ = false, replicated_stages_ = false;
  std::vector<int> scaling_;
};

}  // namespace

std::unique_ptr<Command> plan_command(CLI::App& app) { return std::make_unique<PlanCommand>(app); }

}  // namespace dtrain::cli
