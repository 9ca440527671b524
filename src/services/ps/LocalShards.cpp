// Parameter-server shards in the launching process, configured from a training job.
#include "dtrain/services/ps/LocalShards.h"

#include <algorithm>
#include <cstdio>

#include "dtrain/common/Error.h"
#include "dtrain/parallel/Strategies.h"
#include "dtrain/parallel/ps/PsOptions.h"

namespace dtrain::services::ps {

LocalShards start_local_shards(train::JobConfig& job) {
  LocalShards local;
  if (!train::uses_parameter_server(job) || job.ps_shards <= 0) return local;
  // Downpour's shards apply the updates (their optimizer, the job's schedule by version);
  // Sandblaster's apply none: L-BFGS steps through vector commands.
  const bool downpour = parallel::strategy_info(job.trainer.strategy).server_optimizer;
  auto& ps = job.trainer.strategy_options.of<parallel::ps::PsOptions>();
  const int n_push = job.trainer.strategy_options.of<parallel::ps::DownpourOptions>().n_push;
  const int64_t total_worker_steps = downpour ? train::planned_steps(job) : 0;
  for (int i = 0; i < job.ps_shards; ++i) {
    ShardServerOptions options;
    options.shard = i;
    options.shards = job.ps_shards;
    options.optimizer.name = job.ps_optimizer;
    options.optimizer.lr = job.ps_lr;
    // The job's schedule by version: one version per push, n_push worker steps each.
    const int64_t steps = std::max<int64_t>(1, job.nproc);
    if (downpour) options.optimizer.schedule = job.trainer.schedule;
    options.optimizer.schedule.warmup_steps = job.trainer.schedule.warmup_steps * steps / n_push;
    options.optimizer.schedule.step_size =
        std::max<int64_t>(1, job.trainer.schedule.step_size * steps / n_push);
    options.optimizer.total_versions = total_worker_steps * steps / n_push;
    options.auth_token = ps.auth_token;
    local.servers.push_back(std::make_unique<ShardServer>(options));
    local.addresses += (i == 0 ? "" : ",") + local.servers.back()->address();
    ps.addresses.push_back(local.servers.back()->address());
  }
  job.ps_shards = 0;
  std::printf("parameter server: %d shard%s at %s, %s\n", static_cast<int>(local.servers.size()),
              local.servers.size() == 1 ? "" : "s", local.addresses.c_str(),
              downpour ? concat(job.ps_optimizer, " at lr ", job.ps_lr, " (",
                                job.trainer.schedule.decay, ")")
                             .c_str()
                       : "vector commands of Sandblaster's L-BFGS");
  std::fflush(stdout);
  return local;
}

}  // namespace dtrain::services::ps
