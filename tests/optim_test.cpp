// Schedules, the linear scaling rule, optimizer construction and model shapes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "dtrain/common/Error.h"
#include "dtrain/models/Zoo.h"
#include "dtrain/optim/FlatOptimizer.h"
#include "dtrain/optim/LrSchedule.h"
#include "dtrain/optim/Optimizers.h"
#include "dtrain/optim/StateSize.h"

using namespace dtrain;

TEST(LrSchedule, LinearWarmupThenCosineReachesFloor) {
  optim::LrScheduleSpec spec;
  spec.decay = "cosine";
  spec.warmup_steps = 4;
  spec.min_lr_fraction = 0.1;
  optim::LrSchedule schedule(1.0, 104, spec);
  EXPECT_DOUBLE_EQ(schedule.at(0), 0.25);
  EXPECT_DOUBLE_EQ(schedule.at(3), 1.0);
  EXPECT_DOUBLE_EQ(schedule.at(4), 1.0);
  EXPECT_NEAR(schedule.at(54), 0.55, 1e-12);  // halfway: floor + (1-floor)/2
  EXPECT_NEAR(schedule.at(104), 0.1, 1e-12);
  EXPECT_NEAR(schedule.at(500), 0.1, 1e-12);
}

TEST(LrSchedule, StepDecay) {
  optim::LrScheduleSpec spec;
  spec.decay = "step";
  spec.step_size = 10;
  spec.gamma = 0.5;
  optim::LrSchedule schedule(0.8, 100, spec);
  EXPECT_DOUBLE_EQ(schedule.at(9), 0.8);
  EXPECT_DOUBLE_EQ(schedule.at(10), 0.4);
  EXPECT_DOUBLE_EQ(schedule.at(25), 0.2);
}

TEST(LrSchedule, BadSpecsAreInputErrors) {
  optim::LrScheduleSpec spec;
  spec.decay = "linear-ish";
  EXPECT_THROW(optim::LrSchedule(0.1, 10, spec), InputError);
  EXPECT_THROW(optim::linear_scaled_lr(0.1, 256, 0), InputError);
}

TEST(LinearScaling, ScalesWithGlobalBatch) {
  EXPECT_DOUBLE_EQ(optim::linear_scaled_lr(0.1, 1024, 256), 0.4);
}

TEST(Optimizers, EveryNameBuildsAndStepsAndLrIsSettable) {
  for (const std::string name : {"sgd", "adam", "adamw", "adagrad"}) {
    auto w = torch::ones({3}, torch::requires_grad());
    optim::OptimizerSpec spec;
    spec.name = name;
    spec.lr = 0.1;
    spec.momentum = name == "sgd" ? 0.9 : 0.0;
    auto optimizer = optim::make_optimizer({w}, spec);
    (w * w).sum().backward();
    optimizer->step();
    EXPECT_TRUE((w < 1).all().item<bool>()) << name;
    optim::set_learning_rate(*optimizer, 0.02);
    EXPECT_DOUBLE_EQ(optim::learning_rate(*optimizer), 0.02);
  }
  optim::OptimizerSpec bad;
  bad.name = "lion";
  EXPECT_THROW(optim::make_optimizer({torch::ones({1}, torch::requires_grad())}, bad), InputError);
  bad.name = "sgd";
  bad.nesterov = true;
  EXPECT_THROW(optim::make_optimizer({torch::ones({1}, torch::requires_grad())}, bad), InputError);
}

// What a replacement replica fills while it waits for its admission (param_state_to_fill) has the
// keys, dtypes and sizes of the state each optimizer keeps after its first step (zeros before;
// the state itself after), for every optimizer dtrain builds and Adam's amsgrad.
TEST(Optimizers, TheStateToFillHasTheFormOfTheStateAfterAStep) {
  auto form = [](const optim::ParamState& state) {
    std::vector<std::string> out;
    for (const auto& [key, t] : state) {
      out.push_back(concat(key, " ", c10::toString(t.scalar_type()), " ", t.sizes()));
    }
    return out;
  };
  std::vector<std::pair<std::string, std::function<optim::OptimizerPtr(at::Tensor)>>> made;
  for (const std::string name : {"sgd", "sgd-momentum", "adam", "adamw", "adagrad"}) {
    made.emplace_back(name, [name](at::Tensor w) {
      optim::OptimizerSpec spec;
      spec.name = name == "sgd-momentum" ? "sgd" : name;
      spec.momentum = name == "sgd-momentum" ? 0.9 : 0.0;
      return optim::make_optimizer({w}, spec);
    });
  }
  made.emplace_back("adam amsgrad", [](at::Tensor w) -> optim::OptimizerPtr {
    return std::make_unique<torch::optim::Adam>(std::vector<at::Tensor>{w},
                                                torch::optim::AdamOptions(0.1).amsgrad(true));
  });
  for (const auto& [name, make] : made) {
    auto w = torch::ones({2, 3}, torch::requires_grad());
    auto optimizer = make(w);
    const optim::ParamState before = optim::param_state_to_fill(*optimizer, w);
    for (const auto& [key, t] : before) {
      EXPECT_EQ(t.abs().sum().item<double>(), 0.0) << name << " " << key;
    }
    (w * w).sum().backward();
    optimizer->step();
    const optim::ParamState after = optim::get_param_state(*optimizer, w);
    EXPECT_EQ(form(before), form(after)) << name;
    EXPECT_EQ(before.empty(), name == "sgd") << name;
    const optim::ParamState held = optim::param_state_to_fill(*optimizer, w);
    for (const auto& [key, t] : held) {  // (the step is a count, made into a tensor each time)
      if (t.dim() > 0) EXPECT_EQ(t.data_ptr(), after.at(key).data_ptr()) << name << " " << key;
    }
  }
}

// --freeze-variance-after F (1-bit Adam's freeze step): Adam and AdamW are LibTorch's own for F
// steps, then their second moment and its bias correction stay as they were after step F while
// the first moment and the weights go on: checked against the rule written out, in float64; the
// state saved mid-way resumes the same steps; other optimizers and negative steps are refused.
TEST(Optimizers, FrozenVarianceKeepsAdamsSecondMomentFromItsStepOn) {
  const int64_t freeze = 3, steps = 7;
  const double lr = 0.05, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, decay = 0.1;
  auto gradient = [](int64_t t) {  // varied in sign and size
    return torch::tensor({0.3, -1.2, 0.05, 2.0}, torch::kFloat64) * std::cos(0.7 * t) + 0.1 * t;
  };
  for (const std::string name : {"adam", "adamw"}) {
    const bool decoupled = name == "adamw";
    optim::OptimizerSpec spec;
    spec.name = name;
    spec.lr = lr;
    spec.weight_decay = decay;
    spec.freeze_variance_after = freeze;
    auto w = torch::tensor({1.0, -0.5, 0.25, 2.0}, torch::kFloat64).requires_grad_();
    auto plain_w = w.detach().clone().requires_grad_();
    auto optimizer = optim::make_optimizer({w}, spec);
    optim::OptimizerSpec plain_spec = spec;
    plain_spec.freeze_variance_after = 0;
    auto plain = optim::make_optimizer({plain_w}, plain_spec);
    // The rule written out.
    at::Tensor x = w.detach().clone(), m = torch::zeros_like(x), v = torch::zeros_like(x);
    optim::ParamState saved;
    at::Tensor saved_w;
    for (int64_t t = 1; t <= steps; ++t) {
      at::Tensor g = gradient(t);
      w.mutable_grad() = g.clone();
      plain_w.mutable_grad() = g.clone();
      optimizer->step();
      plain->step();
      if (decoupled) {
        x = x * (1 - lr * decay);
      } else {
        g = g + decay * x;
      }
      m = beta1 * m + (1 - beta1) * g;
      if (t <= freeze) v = beta2 * v + (1 - beta2) * g * g;
      const double c1 = 1 - std::pow(beta1, t), c2 = 1 - std::pow(beta2, std::min(t, freeze));
      x = x - lr / c1 * m / ((v / c2).sqrt() + eps);
      EXPECT_TRUE(torch::allclose(w.detach(), x, 1e-13, 1e-15)) << name << " step " << t;
      if (t <= freeze) {
        EXPECT_TRUE(torch::equal(w.detach(), plain_w.detach())) << name << " step " << t;
      } else {
        EXPECT_FALSE(torch::allclose(w.detach(), plain_w.detach())) << name << " step " << t;
      }
      const optim::ParamState state = optim::get_param_state(*optimizer, w);
      EXPECT_TRUE(torch::allclose(state.at("exp_avg_sq"), v, 1e-15, 1e-18)) << name;
      EXPECT_EQ(state.at("step").item<int64_t>(), t);
      if (t == freeze + 1) {
        for (const auto& [field, value] : state)
          saved[field] = value.clone();  // views of the live state
        saved_w = w.detach().clone();
      }
    }
    // Resumed after step freeze + 1: the same remaining steps.
    auto resumed_w = saved_w.clone().requires_grad_();
    auto resumed = optim::make_optimizer({resumed_w}, spec);
    optim::set_param_state(*resumed, resumed_w, saved);
    for (int64_t t = freeze + 2; t <= steps; ++t) {
      resumed_w.mutable_grad() = gradient(t);
      resumed->step();
    }
    EXPECT_TRUE(torch::equal(resumed_w.detach(), w.detach())) << name;
  }
  optim::OptimizerSpec bad;
  bad.name = "sgd";
  bad.freeze_variance_after = 10;
  EXPECT_THROW(optim::make_optimizer({torch::ones({1}, torch::requires_grad())}, bad), InputError);
  bad.name = "adam";
  bad.freeze_variance_after = -1;
  EXPECT_THROW(optim::make_optimizer({torch::ones({1}, torch::requires_grad())}, bad), InputError);
}

// The flat rules (the parameter server's shards, the federated server) are the same optimizers
// as LibTorch's: each name with a flat rule, stepped over a range at a time, lands where
// LibTorch's optimizer does on the whole tensor (float64).
TEST(FlatOptimizer, EachFlatRuleMatchesLibTorchsOptimizerOfTheSameName) {
  for (const std::string name : {"sgd", "adagrad", "adam"}) {
    ASSERT_TRUE(optim::has_flat_rule(name)) << name;
    optim::OptimizerSpec spec;
    spec.name = name;
    spec.lr = 0.05;
    spec.momentum = name == "sgd" ? 0.9 : 0.0;
    spec.eps = name == "adagrad" ? 1e-10 : 1e-8;
    at::Tensor reference = at::linspace(-1, 1, 12, at::kDouble).requires_grad_(true);
    auto torch_optimizer = optim::make_optimizer({reference}, spec);
    optim::FlatRule rule;
    rule.name = name;
    rule.momentum = spec.momentum;
    rule.adam_eps = spec.eps;
    optim::FlatOptimizer flat(rule);
    at::Tensor values = at::linspace(-1, 1, 12, at::kDouble);
    flat.init(values);
    for (int step = 0; step < 6; ++step) {
      const at::Tensor gradient = at::sin(values * (step + 1)) + 0.1 * step;
      reference.mutable_grad() = gradient.clone();
      torch_optimizer->step();
      // Two pushes of half the tensor each: ranges are stepped independently.
      flat.step(values, 0, gradient.narrow(0, 0, 6), spec.lr);
      flat.step(values, 6, gradient.narrow(0, 6, 6), spec.lr);
    }
    EXPECT_LE((values - reference.detach()).abs().max().item<double>(), 1e-12) << name;
    EXPECT_GT((values - at::linspace(-1, 1, 12, at::kDouble)).abs().max().item<double>(), 1e-2);
  }
  EXPECT_FALSE(optim::has_flat_rule("adamw"));
  optim::FlatRule unknown;
  unknown.name = "adamw";
  EXPECT_THROW(optim::FlatOptimizer{unknown}, InputError);
}

TEST(Models, ZooShapes) {
  for (const auto& name : models::model_names()) {
    // Language models: tests/gpt_test.cpp, tests/llama_test.cpp.
    if (models::model_info(name).language_model) continue;
    models::ModelSpec spec;
    spec.name = name;
    auto model = models::make_model(spec);
    auto out = model(torch::randn({2, 1, 28, 28}));
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 10})) << name;
  }
  // McMahan et al.'s FedAvg CNN has 1,663,370 parameters on 28x28 inputs (their count).
  models::ModelSpec fedavg;
  fedavg.name = "fedavg-cnn";
  int64_t parameters = 0;
  for (const auto& p : models::make_model(fedavg).module->parameters()) parameters += p.numel();
  EXPECT_EQ(parameters, 1663370);
  models::ModelSpec bad;
  bad.name = "gpt9";
  EXPECT_THROW(models::make_model(bad), InputError);
}
