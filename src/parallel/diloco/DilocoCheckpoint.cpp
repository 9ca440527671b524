// DiLoCo's checkpoints: the outer state (parameters and optimizer, any strategy resumes from
// them), every island's own, the step counters and the fragments' exchanges.
#include "parallel/diloco/DilocoStrategy.h"

#include <torch/torch.h>

#include <filesystem>

#include "common/PickledFile.h"
#include "dtrain/common/Error.h"
#include "dtrain/optim/StateSize.h"
#include "dtrain/parallel/StateShards.h"

namespace fs = std::filesystem;

namespace dtrain::parallel::diloco {

namespace {

constexpr const char* kStateFile = "diloco.pt";
constexpr const char* kFormat = "dtrain-diloco-1";

}  // namespace

// A checkpoint holds: the outer parameters as the model (state-0-of-1.pt, values only: any
// strategy resumes from them), the outer optimizer's state (outer/), each island's own state
// (island-I/: its parameters since the last outer step and its inner optimizer, written by its
// inner strategy), and the step counters with each fragment's last exchange (diloco.pt).
// Exchanges in flight are completed first: a run that saves at a step goes on as one resumed
// from that step does.
void DilocoStrategy::save(const std::string& directory) {
  if (outer_in_model_) swap_in_outer();
  drain();
  const SaveRole role = save_role();
  const bool leader = role.leader;
  // The outer parameters and their optimizer: rank 0's, or island 0's shards, one file each.
  if (leader || (sharded_ && role.island == 0)) {
    NamedTensors buffers;
    for (const auto& item : inner_->model().module->named_buffers()) {
      if (leader) buffers.emplace_back(item.key(), item.value());
    }
    const int rank = sharded_ ? island_->rank() : 0, ranks = sharded_ ? island_->size() : 1;
    write_state_shard(directory, rank, ranks, outer_pieces(), nullptr, buffers);
    write_state_shard(directory + "/outer", rank, ranks, outer_pieces(), outer_optimizer_.get(),
                      {});
  }
  if (leader) {
    std::vector<int64_t> last_sync;
    for (const auto& f : fragments_) last_sync.push_back(f.last_sync);
    c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
    state.insert("format", kFormat);
    state.insert("pending", inner_done_ - fragments_.front().last_sync);
    state.insert("inner_steps", inner_done_);
    state.insert("last_sync", at::tensor(last_sync, at::kLong));
    state.insert("outer_steps", outer_done_);
    state.insert("islands", static_cast<int64_t>(role.islands));
    state.insert("island_size", static_cast<int64_t>(island_->size()));
    save_pickled_dict(directory + "/" + kStateFile, state);
  }
  const std::string mine = concat(directory, "/island-", role.island);
  std::error_code ignored;
  fs::create_directories(mine, ignored);
  inner_->save(mine);
  c10::impl::GenericDict residuals(c10::StringType::get(), c10::AnyType::get());
  for (size_t p = 0; p < fragments_.size(); ++p) {  // top-k's error feedback of this rank's slices
    if (!fragments_[p].residual.defined()) continue;
    residuals.insert(p == 0 ? std::string("residual") : concat("residual-", p),
                     fragments_[p].residual);
  }
  if (residuals.size() > 0) {
    residuals.insert("format", kFormat);
    // This rank's fragments' bounds (a zero3 rank's shares are of its own shards).
    residuals.insert("fragment_offsets", fragment_offsets());
    save_pickled_dict(concat(mine, "/residual-", island_->rank(), ".pt"), residuals);
  }
}

void DilocoStrategy::load(const std::string& directory) {
  torch::NoGradGuard no_grad;
  outer_in_model_ = false;
  in_flight_.clear();
  auto every_island_from_outer = [&] {
    for (size_t i = 0; i < outer_.size(); ++i) parameters_[i].copy_(outer_[i]);
    for (auto& f : fragments_) f.last_sync = inner_done_, f.residual = at::Tensor();
  };
  if (!fs::exists(directory + "/" + kStateFile)) {
    // Another strategy's checkpoint: its model becomes the outer parameters; every island
    // starts from them.
    inner_->load(directory);
    for (size_t i = 0; i < outer_.size(); ++i) outer_[i].copy_(parameters_[i]);
    inner_done_ = 0;
    every_island_from_outer();
    return;
  }
  const auto state = load_pickled_dict(directory + "/" + kStateFile, "DiLoCo state file", kFormat);
  read_state_shards(directory + "/outer", outer_pieces(), outer_optimizer_.get(), outer_pieces(),
                    nullptr);
  outer_done_ = state.at("outer_steps").toInt();
  const int64_t pending = state.at("pending").toInt();
  // Checkpoints before streaming DiLoCo counted whole-model outer steps of H inner steps.
  inner_done_ = state.contains("inner_steps") ? state.at("inner_steps").toInt()
                                              : outer_done_ * diloco_.outer_steps + pending;
  const std::string mine = concat(directory, "/island-", island_index_);
  const bool same_layout = state.at("islands").toInt() == islands_ &&
                           state.at("island_size").toInt() == island_->size() && fs::exists(mine);
  if (!same_layout) {
    // Another layout: island 0's inner state (resharded to this island's ranks), and every
    // island from the outer parameters (the steps since the last outer step are not replayed).
    inner_->load(directory + "/island-0");
    every_island_from_outer();
    return;
  }
  inner_->load(mine);  // each island continues where it was
  std::vector<int64_t> last_sync;
  if (state.contains("last_sync")) {
    const at::Tensor saved = state.at("last_sync").toTensor();
    last_sync.assign(saved.data_ptr<int64_t>(), saved.data_ptr<int64_t>() + saved.numel());
  }
  for (size_t p = 0; p < fragments_.size(); ++p) {
    Fragment& f = fragments_[p];
    if (last_sync.size() == fragments_.size()) {
      f.last_sync = last_sync[p];
    } else {  // saved before fragments, or with others: the last step of this fragment's phase
      const int64_t h = diloco_.outer_steps;
      const int64_t since = ((inner_done_ - f.phase) % h + h) % h;
      f.last_sync = std::max<int64_t>(0, inner_done_ - since);
    }
  }
  const std::string residual = concat(mine, "/residual-", island_->rank(), ".pt");
  if (fs::exists(residual)) {
    // Top-k residuals are per fragment: kept where this rank's fragments have the bounds they
    // had (files from before fragments cut tensors hold none: kept for one fragment only).
    const auto saved = load_pickled_dict(residual, "DiLoCo residual file", kFormat);
    const bool same_fragments =
        saved.contains("fragment_offsets")
            ? at::equal(saved.at("fragment_offsets").toTensor(), fragment_offsets())
            : fragments_.size() == 1;
    for (size_t p = 0; same_fragments && p < fragments_.size(); ++p) {
      const std::string key = p == 0 ? std::string("residual") : concat("residual-", p);
      if (saved.contains(key)) fragments_[p].residual = saved.at(key).toTensor();
    }
  }
}

MemoryReport DilocoStrategy::memory_report() const {
  MemoryReport report = inner_->memory_report();
  for (const auto& p : outer_) report.parameter_bytes += p.numel() * p.element_size();
  report.gradient_bytes += flat_grad_.numel() * flat_grad_.element_size();
  report.optimizer_bytes += optim::optimizer_state_bytes(*outer_optimizer_);
  return report;
}

}  // namespace dtrain::parallel::diloco
