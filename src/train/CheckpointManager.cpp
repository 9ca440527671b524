// A run's checkpoints (torchtitan's components/checkpoint.py): saving every rank's strategy
// state and random-generator state under a temporary name, verified and renamed, with the
// oldest pruned; on resume, choosing the newest checkpoint that verifies (damaged newer ones set
// aside) and restoring it into the strategy at whatever layout the run has now.
#include "dtrain/train/CheckpointManager.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <thread>

#include "common/Files.h"
#include "common/PickledFile.h"
#include "dtrain/common/Error.h"
#include "dtrain/nn/tensor/Split.h"
#include "dtrain/parallel/ft/Replicas.h"
#include "dtrain/train/Checkpoint.h"

namespace fs = std::filesystem;

namespace dtrain::train {

namespace {

// "4 ranks (DP 2 x PP 2 x TP 1)": how a run or a checkpoint is laid out (", experts over 2"
// with expert parallelism).
std::string describe_layout(int world, int dp, int pp, int tp, int ep) {
  return concat(world, world == 1 ? " rank" : " ranks", " (DP ", dp, " x PP ", pp, " x TP ", tp,
                ep > 1 ? concat(", experts over ", ep) : std::string(), ")");
}

std::string dtype_name(const at::Tensor& t) { return std::string(c10::toString(t.scalar_type())); }

// An asynchronous checkpoint's sign, in its staging directory, that a rank's files are there.
std::string written_marker(const std::string& staging, int rank) {
  return concat(staging, "/.written-rank", rank);
}

}  // namespace

// The checkpoint being written in the background.
struct CheckpointManager::Background {
  int64_t step = 0;
  double seconds = 0;  // the write's, once done
  std::thread thread;
  std::exception_ptr error;
  std::atomic<bool> cancel{false};
};

CheckpointManager::CheckpointManager(const TrainerOptions& options, comm::Communicator& world,
                                     const comm::ProcessGrid& grid, parallel::Strategy& strategy)
    : options_(options), world_(world), grid_(grid), strategy_(strategy) {}

CheckpointManager::~CheckpointManager() {
  if (!background_) return;
  background_->cancel = true;
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain: the checkpoint being written was not completed: %s\n", e.what());
  }
}

void CheckpointManager::wait() {
  if (!background_) return;
  if (background_->thread.joinable()) background_->thread.join();
  const std::exception_ptr error = background_->error;
  const int64_t step = background_->step;
  const double seconds = background_->seconds;
  background_.reset();
  if (error) std::rethrow_exception(error);
  if (on_written) on_written(step, seconds);
}

std::vector<TensorInfo> CheckpointManager::model_tensors() const {
  std::vector<TensorInfo> tensors;
  auto& module = *strategy_.model().module;
  // Full shapes: a tensor-parallel rank holds blocks of them.
  const auto splits = nn::tensor::parameter_splits(module);
  for (const auto& item : module.named_parameters()) {
    tensors.push_back({item.key(),
                       nn::tensor::full_shape(splits, item.key(), item.value().sizes().vec()),
                       dtype_name(item.value())});
  }
  for (const auto& item : module.named_buffers()) {
    tensors.push_back({item.key(), item.value().sizes().vec(), dtype_name(item.value()), true});
  }
  return tensors;
}

void CheckpointManager::publish(const std::string& staging, const std::string& name, int64_t step,
                                int64_t epoch, int64_t global_batch,
                                const std::vector<TensorInfo>& tensors) const {
  const std::string& root = options_.checkpoint_dir;
  CheckpointMeta meta;
  meta.strategy = strategy_.name();
  meta.world_size = world_.size();
  meta.dp = grid_.dp_size();
  meta.pp = grid_.pp_size();
  meta.tp = grid_.tp_size();
  meta.ep = grid_.ep_size();
  meta.step = step;
  meta.epoch = epoch;
  meta.seed = options_.seed;
  meta.global_batch = global_batch;
  meta.tensors = tensors;
  meta.extras = options_.checkpoint_extras;
  // Digests read back from the files on disk, so the checkpoint that replaces older ones has
  // been verified as written.
  record_files(staging, meta);
  write_meta(staging, meta);
  const std::string final_dir = root + "/" + name;
  fs::remove_all(final_dir);
  fs::rename(staging, final_dir);
  set_latest(root, name);
  prune_checkpoints(root, options_.keep_checkpoints, name);
}

namespace {

// A checkpoint of replicas that shard the state, one of which failed while it was written: its
// staging directory goes (what cannot be removed while a writer still writes stays, never read:
// checkpoints are the directories without ".tmp").
void leave_unpublished(const std::string& staging, const std::string& name,
                       const std::string& why) {
  std::error_code ignored;
  fs::remove_all(staging, ignored);
  std::fprintf(stderr,
               "dtrain: warning: checkpoint %s is not published: %s; the newest complete "
               "checkpoint stays `latest`, and training goes on\n",
               name.c_str(), why.c_str());
  std::fflush(stderr);
}

}  // namespace

void CheckpointManager::save(int64_t step, int64_t epoch, int64_t global_batch, bool alone) {
  wait();  // the previous asynchronous checkpoint is complete, or its error is thrown here
  const std::string root = options_.checkpoint_dir;
  const std::string name = checkpoint_name(step);
  const std::string staging = root + "/" + name + ".tmp";
  // Alone (one replica saves while the others train on: rank 0's, or the replica that leads
  // after it failed): this rank's replica (an asynchronous strategy's: its TP group, rank 0
  // alone), whose first rank publishes.
  comm::CommunicatorPtr replica = grid_.tp();
  parallel::ft::ReplaceableReplicas* const replicas = parallel::ft::replaceable(strategy_);
  if (replicas) replica = replicas->checkpoint_group();
  // Replicas that shard the state save together, over barriers a member's failure does not
  // break (it regroups them, as a step does); a checkpoint whose group changed meanwhile may
  // lack the failed member's files: it is left unpublished, and training goes on.
  const bool every_replica = alone && replicas && replicas->checkpoints_in_every_replica();
  comm::Communicator& savers = alone ? *replica : world_;
  bool leader = savers.rank() == 0;
  if (leader) {
    fs::remove_all(staging);
    fs::create_directories(staging);
  }
  int64_t formed = 0;
  std::vector<int> writers = savers.global_ranks();
  if (every_replica) {
    formed = replicas->checkpoint_barrier();
    fs::create_directories(staging);  // (in case the member that made it failed first)
    leader = replicas->checkpoint_group()->rank() == 0;
    writers = replicas->checkpoint_group()->global_ranks();
  } else if (savers.size() > 1) {
    savers.barrier()->wait();
  }
  const std::string rng = concat(staging, "/rng-rank", world_.rank(), ".pt");
  const std::vector<TensorInfo> tensors = leader ? model_tensors() : std::vector<TensorInfo>{};
  if (!options_.async_checkpoint) {
    strategy_.save(staging);
    save_tensor_file(rng, at::detail::getDefaultCPUGenerator().get_state());
    if (on_files) on_files(step);
    if (every_replica) {
      const bool whole = replicas->checkpoint_barrier() == formed;  // every rank's files are in
      if (replicas->checkpoint_group()->rank() == 0) {
        if (!whole) return leave_unpublished(staging, name, "a replica failed while it was written");
        publish(staging, name, step, epoch, global_batch, tensors);
      }
      if (whole) replicas->checkpoint_barrier();
      return;
    }
    if (savers.size() > 1) savers.barrier()->wait();  // every rank's files are in place
    if (leader) publish(staging, name, step, epoch, global_batch, tensors);
    if (savers.size() > 1) savers.barrier()->wait();
    return;
  }
  // Asynchronous: the state is copied now (collectives the strategy's save needs run here, on
  // every rank together); the files are written, and published by rank 0, in the background.
  auto files = std::make_shared<StagedFiles>();
  {
    StagingScope scope(*files);
    strategy_.save(staging);
    save_tensor_file(rng, at::detail::getDefaultCPUGenerator().get_state());
  }
  if (on_files) on_files(step);
  background_ = std::make_unique<Background>();
  background_->step = step;
  Background* background = background_.get();
  const int rank = world_.rank();
  const auto timeout = world_.timeout();
  // A failure reported after the state was staged may leave a writer's files missing: the
  // checkpoint is then left unpublished instead of waited for.
  const std::function<int64_t()> failures =
      every_replica ? replicas->failure_count() : std::function<int64_t()>();
  const int64_t failures_before = failures ? failures() : 0;
  background->thread = std::thread([=, this] {
    // The writer takes what the training threads leave (waits on peers, the data loader): on a
    // machine whose cores all train, an equal share would slow the steps while it writes.
    sched_param idle{};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
    const auto started = std::chrono::steady_clock::now();
    auto done = [&] {
      background->seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    };
    try {
      files->write();
      write_file_atomically(written_marker(staging, rank), "", 0);
      if (!leader) return done();
      // Every rank's files are in place when every rank's marker is.
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      std::vector<int> missing;
      const auto missing_ranks = [&] {  // after "rank": " 2" or "s 1, 2"
        std::string ranks;
        for (const int r : missing) ranks += concat(ranks.empty() ? "" : ", ", r);
        return concat(missing.size() == 1 ? " " : "s ", ranks);
      };
      const auto their = [&] { return missing.size() == 1 ? "its" : "their"; };
      while (true) {
        missing.clear();
        for (const int r : writers) {
          if (!fs::exists(written_marker(staging, r))) missing.push_back(r);
        }
        if (missing.empty() || background->cancel || std::chrono::steady_clock::now() >= deadline) {
          break;
        }
        if (failures && failures() > failures_before) {
          leave_unpublished(staging, name,
                            concat("a replica failed while it was written (world rank",
                                   missing_ranks(), " did not write ", their(), " files)"));
          return done();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      DTRAIN_CHECK(
          missing.empty(), "asynchronous checkpoint ", staging, ": rank", missing_ranks(),
          missing.size() == 1 ? " has" : " have", " not written ", their(), " files",
          background->cancel ? " (training stopped)" : concat(" within ", timeout.count(), " ms"),
          "; the newest complete checkpoint stays `latest`");
      for (const int r : writers) fs::remove(written_marker(staging, r));
      publish(staging, name, step, epoch, global_batch, tensors);
      done();
    } catch (...) {
      // A writer whose checkpoint was left unpublished meanwhile (the publishing replica removed
      // its staging directory): nothing to report.
      if (every_replica && !fs::exists(staging)) return done();
      background->error = std::current_exception();
    }
  });
}

std::string CheckpointManager::choose() {
  const std::string& root = options_.checkpoint_dir;
  // Rank 0 verifies; everyone loads what it chose. Candidates: the one `latest` names, then
  // older ones, newest first.
  int64_t chosen = -1;  // index into `names`; -1 none; -2 some exist, none verifies
  std::vector<std::string> names = list_checkpoints(root);
  std::string newest_problem;
  if (world_.rank() == 0 && !names.empty()) {
    std::string latest_name;
    if (const auto latest = latest_checkpoint_name(root)) latest_name = *latest;
    if (!latest_name.empty() && std::find(names.begin(), names.end(), latest_name) == names.end()) {
      std::fprintf(stderr,
                   "dtrain: warning: %s/latest names checkpoint '%s', which does not exist; "
                   "resuming from the newest checkpoint that verifies\n",
                   root.c_str(), latest_name.c_str());
      latest_name.clear();
    }
    int damaged = 0;
    std::vector<std::string> set_aside;
    for (int64_t i = static_cast<int64_t>(names.size()) - 1; i >= 0; --i) {
      if (!latest_name.empty() && names[i] > latest_name) continue;  // another run's, newer
      const std::string directory = root + "/" + names[i];
      bool unverifiable = false;
      const std::string problem = verify_checkpoint(directory, &unverifiable);
      if (problem.empty()) {
        if (unverifiable) {
          std::fprintf(stderr,
                       "dtrain: warning: checkpoint %s has no checksums (an older "
                       "dtrain wrote it); resuming from it unverified\n",
                       directory.c_str());
        }
        chosen = i;
        break;
      }
      if (damaged++ == 0) newest_problem = problem;
      std::fprintf(stderr, "dtrain: checkpoint %s does not verify: %s\n", directory.c_str(),
                   problem.c_str());
      set_aside.push_back(directory);
    }
    if (chosen >= 0) {
      // Damaged newer checkpoints move aside (kept, never loaded or counted by pruning again).
      for (const auto& directory : set_aside) {
        const std::string moved = set_aside_damaged(directory);
        std::fprintf(stderr,
                     "dtrain: kept it as %s; resuming from the newest checkpoint that "
                     "verifies, %s\n",
                     moved.c_str(), names[chosen].c_str());
      }
      if (!set_aside.empty()) set_latest(root, names[chosen]);
    } else if (damaged > 0) {
      chosen = -2;
    }
  }
  at::Tensor decision = at::tensor({chosen}, at::kLong);
  world_.broadcast(decision, {0})->wait();
  chosen = decision.item<int64_t>();
  DTRAIN_CHECK_INPUT(chosen != -2, "no checkpoint under ", root, " verifies (",
                     newest_problem.empty() ? "rank 0 names the damage" : newest_problem,
                     "; nothing was changed): repair or move them, or start fresh with "
                     "--no-resume");
  if (chosen < 0) return "";
  return root + "/" + names[chosen];
}

int64_t CheckpointManager::restore(int64_t global_batch) {
  if (options_.checkpoint_dir.empty() || !options_.resume) return 0;
  const auto started = std::chrono::steady_clock::now();
  const std::string directory = choose();
  if (directory.empty()) return 0;
  const CheckpointMeta meta = read_meta(directory);
  check_compatible(meta, model_tensors(), directory);
  DTRAIN_CHECK_INPUT(meta.global_batch == global_batch, "checkpoint ", directory,
                     " was trained with global batch ", meta.global_batch,
                     "; resuming with global batch ", global_batch,
                     " would change the data order: give --global-batch ", meta.global_batch,
                     " (the micro-batches then follow the world size), or --no-resume to start "
                     "afresh");
  strategy_.load(directory);
  std::string rng = concat(directory, "/rng-rank", world_.rank(), ".pt");
  if (!fs::exists(rng)) {
    // The world grew, or one replica saved alone (--fault-tolerance replicas: the leading one,
    // rank 0's only until it failed): the lowest rank's that saved.
    for (int r = 0; r < meta.world_size && !fs::exists(rng); ++r) {
      rng = concat(directory, "/rng-rank", r, ".pt");
    }
  }
  at::Tensor state;
  try {
    torch::load(state, rng);
  } catch (const c10::Error& e) {
    DTRAIN_THROW(InputError, rng,
                 " is not a random-generator state: ", first_line(e.what_without_backtrace()));
  }
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
  // What happened, whatever the progress display: batch logs run with --no-progress.
  if (world_.rank() == 0) {
    std::printf(
        "dtrain: resumed from step %lld of %s (saved by %s on %s; now %s on %s; verified and "
        "read in %.0f ms)\n",
        static_cast<long long>(meta.step), directory.c_str(), meta.strategy.c_str(),
        describe_layout(meta.world_size, meta.dp, meta.pp, meta.tp, meta.ep).c_str(),
        strategy_.name().c_str(),
        describe_layout(world_.size(), grid_.dp_size(), grid_.pp_size(), grid_.tp_size(),
                        grid_.ep_size())
            .c_str(),
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started)
            .count());
    std::fflush(stdout);
  }
  return meta.step;
}

}  // namespace dtrain::train
