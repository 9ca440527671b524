// SyncBatchNorm (see SyncBatchNorm.h). The forward gathers [mean, M2, count] per rank (2C + 1
// values) and combines them as Chan et al. do, so no rank's statistics are re-derived from
// sums of squares (which lose digits when the mean is large against the spread); the backward
// allreduces [sum dy, sum dy * xhat] (2C values). Statistics are kept in float32 for 16-bit
// inputs, as torch does.
#include "dtrain/nn/SyncBatchNorm.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>
#include <torch/torch.h>

#include "dtrain/common/Error.h"
#include "dtrain/common/Trace.h"

namespace dtrain::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct BatchNormGroup : torch::CustomClassHolder {
  comm::CommunicatorPtr group;
};

// Every dimension but the channels' (1).
std::vector<int64_t> reduced_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// A per-channel vector [C] shaped to broadcast against x [B, C, ...].
at::Tensor per_channel(const at::Tensor& v, const at::Tensor& x) {
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[1] = v.size(0);
  return v.view(shape);
}

// y = xhat * weight + bias with xhat = (x - mean) * invstd for the group's mean and invstd
// (given, not differentiated: the backward accounts for them through the group's sums).
struct SyncBatchNormFunction : torch::autograd::Function<SyncBatchNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& mean,
                               const at::Tensor& invstd, double count,
                               const comm::CommunicatorPtr& group) {
    const at::Tensor xhat =
        (x.to(mean.scalar_type()) - per_channel(mean, x)) * per_channel(invstd, x);
    at::Tensor y = xhat;
    if (weight.defined()) y = y * per_channel(weight, x) + per_channel(bias, x);
    auto holder = c10::make_intrusive<BatchNormGroup>();
    holder->group = group;
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(holder));
    ctx->saved_data["count"] = count;
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->save_for_backward({xhat, invstd, weight});
    return {y.to(x.scalar_type())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& xhat = saved[0];
    const at::Tensor& invstd = saved[1];
    const at::Tensor& weight = saved[2];
    const comm::CommunicatorPtr group =
        c10::static_intrusive_pointer_cast<BatchNormGroup>(ctx->saved_data["group"].toCapsule())
            ->group;
    const double count = ctx->saved_data["count"].toDouble();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const at::Tensor dy = grads[0].to(xhat.scalar_type());
    const std::vector<int64_t> dims = reduced_dims(xhat);
    const at::Tensor sum_dy = dy.sum(dims);
    const at::Tensor sum_dy_xhat = (dy * xhat).sum(dims);
    at::Tensor grad_x, grad_weight, grad_bias;
    if (weight.defined()) {
      // This rank's share: data parallelism reduces them as every parameter's gradient.
      grad_weight = sum_dy_xhat.to(weight.scalar_type());
      grad_bias = sum_dy.to(weight.scalar_type());
    }
    if (ctx->needs_input_grad(0)) {
      at::Tensor sums = at::cat({sum_dy, sum_dy_xhat});
      {
        trace::Span span("comm", "sync batchnorm allreduce");
        group->allreduce(sums)->wait();
      }
      const int64_t channels = sum_dy.size(0);
      const at::Tensor mean_dy = sums.narrow(0, 0, channels) / count;
      const at::Tensor mean_dy_xhat = sums.narrow(0, channels, channels) / count;
      at::Tensor scale = weight.defined() ? invstd * weight.to(invstd.scalar_type()) : invstd;
      grad_x = ((dy - per_channel(mean_dy, dy) - xhat * per_channel(mean_dy_xhat, dy)) *
                per_channel(scale, dy))
                   .to(dtype);
    }
    return {grad_x, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

SyncBatchNorm2dImpl::SyncBatchNorm2dImpl(const torch::nn::BatchNormOptions& options_)
    : options(options_) {
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", torch::ones({c}));
    bias = register_parameter("bias", torch::zeros({c}));
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::tensor(0, torch::kLong));
  }
}

at::Tensor SyncBatchNorm2dImpl::forward(const at::Tensor& input) {
  DTRAIN_CHECK_INPUT(input.dim() == 4, "BatchNorm2d expects 4-D input [B, C, H, W], got ",
                     input.sizes());
  const bool tracked = options.track_running_stats() && running_mean.defined();
  if (!is_training() || !group || group->size() == 1) {
    // torch::nn::BatchNorm2d's forward.
    double factor = options.momentum().value_or(0.0);
    if (is_training() && tracked) {
      num_batches_tracked += 1;
      if (!options.momentum().has_value()) factor = 1.0 / num_batches_tracked.item<double>();
    }
    return at::batch_norm(input, weight, bias, running_mean, running_var, is_training() || !tracked,
                          factor, options.eps(), at::globalContext().userEnabledCuDNN());
  }
  const at::ScalarType stats_type =
      at::elementSize(input.scalar_type()) < 4 ? at::kFloat : input.scalar_type();
  const int64_t channels = input.size(1);
  const int ranks = group->size();
  at::Tensor mean, invstd;
  double count = 0;
  {
    torch::NoGradGuard no_grad;
    const at::Tensor x = input.detach().to(stats_type);
    const std::vector<int64_t> dims = reduced_dims(x);
    const double local = x.numel() == 0 ? 0.0 : static_cast<double>(x.numel() / channels);
    at::Tensor mine = at::zeros({2 * channels + 1}, x.options());
    if (local > 0) {
      mine.narrow(0, 0, channels).copy_(x.mean(dims));
      mine.narrow(0, channels, channels).copy_(x.var(dims, /*unbiased=*/false) * local);
    }
    mine[2 * channels].fill_(local);
    at::Tensor all = at::empty({ranks, 2 * channels + 1}, x.options());
    {
      trace::Span span("comm", "sync batchnorm allgather");
      group->allgather(all.view({-1}), mine)->wait();
    }
    const at::Tensor counts = all.narrow(1, 2 * channels, 1);  // [ranks, 1]
    const at::Tensor means = all.narrow(1, 0, channels);
    count = counts.sum().item<double>();
    DTRAIN_CHECK_INPUT(count > 1, "SyncBatchNorm over group '", group->name(),
                       "' needs more than one value per channel, got ", count);
    mean = (means * counts).sum(0) / count;
    const at::Tensor m2 =
        (all.narrow(1, channels, channels) + counts * (means - mean).pow(2)).sum(0);
    const at::Tensor var = m2 / count;
    invstd = (var + options.eps()).rsqrt();
    if (tracked) {
      num_batches_tracked += 1;
      const double factor = options.momentum().has_value()
                                ? *options.momentum()
                                : 1.0 / num_batches_tracked.item<double>();
      running_mean.mul_(1 - factor).add_(mean.to(running_mean.scalar_type()) * factor);
      running_var.mul_(1 - factor).add_((m2 / (count - 1)).to(running_var.scalar_type()) * factor);
    }
  }
  return SyncBatchNormFunction::apply(input, weight, bias, mean, invstd, count, group)[0];
}

void SyncBatchNorm2dImpl::pretty_print(std::ostream& stream) const {
  stream << "dtrain::nn::SyncBatchNorm2d(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum().has_value()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

int64_t set_sync_batchnorm(torch::nn::Module& model, const comm::CommunicatorPtr& group) {
  int64_t found = 0;
  for (const auto& module : model.modules(/*include_self=*/true)) {
    if (auto* layer = module->as<SyncBatchNorm2dImpl>()) {
      layer->group = group;
      ++found;
    }
  }
  return found;
}

}  // namespace dtrain::nn
