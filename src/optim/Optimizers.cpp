// Optimizers by name: one table for LibTorch's optimizers and the flat rules; validates values.
#include "dtrain/optim/Optimizers.h"

#include <torch/optim.h>

#include <cmath>

#include "dtrain/common/Error.h"
#include "dtrain/optim/Offload.h"
#include "optim/StateKey.h"

namespace dtrain::optim {

namespace {

// Adam or AdamW whose second moment stops moving after `freeze` steps (1-bit Adam's freeze_step,
// Tang et al. 2021): from then on the rule is momentum SGD preconditioned by a fixed diagonal,
// linear in the gradients, which is what 1-bit Adam's error-compensated compression needs (with
// PowerSGD on the GPT it changed nothing: BENCHMARKS). Until some parameter has made `freeze` steps
// it is LibTorch's own step; after, a parameter younger than that (a late first gradient) still
// updates its moment. The bias correction of the moment is the one of step `freeze`.
template <typename Base, typename Options, typename State, bool kDecoupled>
class FrozenVariance final : public Base {
 public:
  FrozenVariance(std::vector<at::Tensor> parameters, Options options, int64_t freeze)
      : Base(std::move(parameters), options), freeze_(freeze) {}

  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    if (!any_frozen()) return Base::step(std::move(closure));
    at::Tensor loss;
    if (closure) {
      at::AutoGradMode enable(true);
      loss = closure();
    }
    at::NoGradGuard no_grad;
    for (auto& group : this->param_groups()) {
      const auto& o = static_cast<const Options&>(group.options());
      const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        at::Tensor grad = p.grad();
        auto found = this->state_.find(key_of(p));
        if (found == this->state_.end()) {
          auto made = std::make_unique<State>();
          made->step(0);
          made->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
          made->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
          found = this->state_.emplace(key_of(p), std::move(made)).first;
        }
        auto& state = static_cast<State&>(*found->second);
        if (o.weight_decay() != 0) {
          if (kDecoupled) {
            p.mul_(1 - o.lr() * o.weight_decay());
          } else {
            grad = grad.add(p, o.weight_decay());
          }
        }
        const bool frozen = state.step() >= freeze_;
        state.step(state.step() + 1);
        state.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
        if (!frozen) state.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);
        const double correction1 = 1 - std::pow(beta1, static_cast<double>(state.step()));
        const double correction2 =
            1 - std::pow(beta2, static_cast<double>(frozen ? freeze_ : state.step()));
        const at::Tensor denominator =
            (state.exp_avg_sq().sqrt() / std::sqrt(correction2)).add_(o.eps());
        p.addcdiv_(state.exp_avg(), denominator, -o.lr() / correction1);
      }
    }
    return loss;
  }

 private:
  // Whether some parameter about to step has made its `freeze` steps.
  bool any_frozen() {
    for (auto& group : this->param_groups()) {
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto found = this->state_.find(key_of(p));
        if (found != this->state_.end() &&
            static_cast<const State&>(*found->second).step() >= freeze_) {
          return true;
        }
      }
    }
    return false;
  }

  int64_t freeze_;
};

// Adam (L2 weight decay) or AdamW (decoupled), with --freeze-variance-after when asked.
template <typename Base, typename Options, typename State, bool kDecoupled>
OptimizerPtr make_adam(std::vector<at::Tensor> parameters, const OptimizerSpec& spec) {
  const auto options = Options(spec.lr)
                           .betas({spec.beta1, spec.beta2})
                           .eps(spec.eps)
                           .weight_decay(spec.weight_decay);
  if (spec.freeze_variance_after > 0) {
    return std::make_unique<FrozenVariance<Base, Options, State, kDecoupled>>(
        std::move(parameters), options, spec.freeze_variance_after);
  }
  return std::make_unique<Base>(std::move(parameters), options);
}

// The one table of optimizers by name: LibTorch's optimizer for the Trainer's strategies, and
// whether a flat rule (FlatOptimizer.h: parameter-server shards, the federated server) exists.
struct Entry {
  const char* name;
  bool flat;
  OptimizerPtr (*make)(std::vector<at::Tensor> parameters, const OptimizerSpec& spec);
  double lr;  // PyTorch's defaults (torch.optim, 2.x)
  double weight_decay;
};

const Entry kOptimizers[] = {
    {"sgd", true,
     [](std::vector<at::Tensor> parameters, const OptimizerSpec& spec) -> OptimizerPtr {
       DTRAIN_CHECK_INPUT(spec.momentum >= 0, "momentum must be >= 0, got ", spec.momentum);
       DTRAIN_CHECK_INPUT(!spec.nesterov || spec.momentum > 0, "nesterov needs momentum > 0");
       return std::make_unique<torch::optim::SGD>(parameters, torch::optim::SGDOptions(spec.lr)
                                                                  .momentum(spec.momentum)
                                                                  .nesterov(spec.nesterov)
                                                                  .weight_decay(spec.weight_decay));
     },
     1e-3, 0},
    {"adam", true,
     make_adam<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState, false>,
     1e-3, 0},
    {"adamw", false,
     make_adam<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState,
               true>,
     1e-3, 1e-2},
    {"adagrad", true,
     [](std::vector<at::Tensor> parameters, const OptimizerSpec& spec) -> OptimizerPtr {
       return std::make_unique<torch::optim::Adagrad>(
           parameters, torch::optim::AdagradOptions(spec.lr).weight_decay(spec.weight_decay));
     },
     1e-2, 0},
};

std::string names_where(bool flat_only) {
  std::string out;
  for (const Entry& entry : kOptimizers) {
    if (flat_only && !entry.flat) continue;
    out += (out.empty() ? "" : ", ") + std::string(entry.name);
  }
  return out;
}

}  // namespace

OptimizerSpec optimizer_defaults(const std::string& name) {
  OptimizerSpec spec;
  spec.name = name;
  for (const Entry& entry : kOptimizers) {
    if (name != entry.name) continue;
    spec.lr = entry.lr;
    spec.weight_decay = entry.weight_decay;
  }
  return spec;
}

OptimizerPtr make_optimizer(std::vector<at::Tensor> parameters, const OptimizerSpec& spec) {
  DTRAIN_CHECK_INPUT(spec.lr > 0, "learning rate must be > 0, got ", spec.lr);
  DTRAIN_CHECK_INPUT(spec.weight_decay >= 0, "weight decay must be >= 0, got ", spec.weight_decay);
  DTRAIN_CHECK_INPUT(spec.freeze_variance_after >= 0, "--freeze-variance-after must be >= 0, got ",
                     spec.freeze_variance_after);
  DTRAIN_CHECK_INPUT(spec.freeze_variance_after == 0 || spec.name == "adam" || spec.name == "adamw",
                     "--freeze-variance-after is for adam and adamw (Adam's second moment), not "
                     "--optimizer ",
                     spec.name);
  for (const Entry& entry : kOptimizers) {
    if (spec.name == entry.name) return entry.make(std::move(parameters), spec);
  }
  DTRAIN_THROW(InputError, "unknown optimizer '", spec.name, "' (expected ", names_where(false),
               ")");
}

bool has_flat_rule(const std::string& name) {
  for (const Entry& entry : kOptimizers) {
    if (name == entry.name) return entry.flat;
  }
  return false;
}

std::string flat_rule_names() { return names_where(true); }

OptimizerFactory optimizer_factory(OptimizerSpec spec) {
  const OffloadSpec offload = parse_offload(spec.offload, spec.offload_bucket_mb);
  return offloaded_factory(
      [spec](std::vector<at::Tensor> parameters) {
        return make_optimizer(std::move(parameters), spec);
      },
      offload);
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

double learning_rate(const torch::optim::Optimizer& optimizer) {
  return optimizer.param_groups().at(0).options().get_lr();
}

}  // namespace dtrain::optim
