// SyncBatchNorm: global-batch statistics through the Communicator, with the backward of batch normalisation
// over the global batch (PyTorch's SyncBatchNorm formulas: one all-reduce in forward, one in backward).
#include <accel/distributed/communicator.hpp>
#include <accel/errors.hpp>
#include <accel/nn/sync_batchnorm.hpp>

#include <ATen/Context.h>
#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <cmath>
#include <sstream>
#include <vector>

namespace accel::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// (1, C, 1, ...): broadcasts a per-channel vector against an (N, C, ...) input.
torch::Tensor per_channel(const torch::Tensor& v, std::int64_t dims) {
  std::vector<std::int64_t> shape(static_cast<std::size_t>(dims), 1);
  shape[1] = v.size(0);
  return v.reshape(shape);
}

std::vector<std::int64_t> all_but_channel(std::int64_t dims) {
  std::vector<std::int64_t> out{0};
  for (std::int64_t d = 2; d < dims; ++d)
    out.push_back(d);
  return out;
}

struct SyncBatchNormFunction : torch::autograd::Function<SyncBatchNormFunction> {
  // running_mean / running_var (may be undefined) are updated in place with `factor`.
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias, torch::Tensor running_mean,
                               torch::Tensor running_var, double factor, double eps, Communicator* comm) {
    const auto dims = x.dim();
    const auto channels = x.size(1);
    const auto reduce = all_but_channel(dims);
    // Per-rank sums in double, so that E[x^2] - E[x]^2 over the global batch keeps float precision.
    const auto xd = x.to(torch::kFloat64);
    auto stats = torch::cat({xd.sum(reduce), xd.pow(2).sum(reduce),
                             torch::full({1}, static_cast<double>(x.numel() / channels), xd.options())});
    comm->all_reduce(stats, ReduceOp::Sum);
    const auto count = stats[2 * channels].item<double>();
    if (count < 2) {
      throw UsageError(
          fmt::format("SyncBatchNorm: the global batch has {} value(s) per channel; batch normalisation in "
                      "training needs at least 2",
                      count));
    }
    const auto mean = stats.narrow(0, 0, channels) / count;
    const auto var = (stats.narrow(0, channels, channels) / count - mean.pow(2)).clamp_min(0);
    const auto invstd = (var + eps).rsqrt();
    if (running_mean.defined()) {
      torch::NoGradGuard no_grad;
      running_mean.mul_(1 - factor).add_(mean.to(running_mean.scalar_type()), factor);
      running_var.mul_(1 - factor).add_((var * (count / (count - 1))).to(running_var.scalar_type()), factor);
    }
    const auto mean_x = per_channel(mean.to(x.scalar_type()), dims);
    const auto invstd_x = per_channel(invstd.to(x.scalar_type()), dims);
    auto y = (x - mean_x) * invstd_x;
    if (weight.defined()) y = y * per_channel(weight, dims) + per_channel(bias, dims);
    ctx->save_for_backward({x, weight, mean_x, invstd_x});
    ctx->saved_data["count"] = count;
    ctx->saved_data["comm"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(comm));
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &mean_x = saved[2], &invstd_x = saved[3];
    const auto count = ctx->saved_data["count"].toDouble();
    auto* comm = reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(ctx->saved_data["comm"].toInt()));
    const auto& dy = grads[0];
    const auto dims = x.dim();
    const auto channels = x.size(1);
    const auto reduce = all_but_channel(dims);
    const auto xhat = (x - mean_x) * invstd_x;
    // This rank's sums: the weight and bias gradients (averaged across ranks by the backend, like every
    // parameter's), and, summed over the ranks, the two means the input gradient needs.
    const auto sum_dy = dy.sum(reduce);
    const auto sum_dy_xhat = (dy * xhat).sum(reduce);
    auto global = torch::cat({sum_dy, sum_dy_xhat}).to(torch::kFloat64);
    comm->all_reduce(global, ReduceOp::Sum);
    const auto mean_dy = per_channel((global.narrow(0, 0, channels) / count).to(x.scalar_type()), dims);
    const auto mean_dy_xhat =
        per_channel((global.narrow(0, channels, channels) / count).to(x.scalar_type()), dims);
    auto dx = (dy - mean_dy - xhat * mean_dy_xhat) * invstd_x;
    torch::Tensor dweight, dbias;
    if (weight.defined()) {
      dx = dx * per_channel(weight, dims);
      dweight = sum_dy_xhat;
      dbias = sum_dy;
    }
    return {dx,
            dweight,
            dbias,
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_) : options(options_) {
  reset();
}

void SyncBatchNormImpl::reset() {
  const auto c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", torch::empty({c}));
    bias = register_parameter("bias", torch::empty({c}));
  } else {
    weight = register_parameter("weight", torch::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked =
        register_buffer("num_batches_tracked", torch::tensor(0, torch::dtype(torch::kLong)));
  } else {
    running_mean = register_buffer("running_mean", torch::Tensor());
    running_var = register_buffer("running_var", torch::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", torch::Tensor());
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_parameters() {
  if (options.track_running_stats()) {
    running_mean.zero_();
    running_var.fill_(1);
    num_batches_tracked.zero_();
  }
  if (options.affine()) {
    torch::nn::init::ones_(weight);
    torch::nn::init::zeros_(bias);
  }
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "accel::nn::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine() << ", track_running_stats=" << options.track_running_stats()
         << ")";
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  if (input.dim() < 2 || input.size(1) != options.num_features()) {
    std::ostringstream shape;
    shape << input.sizes();
    throw UsageError(fmt::format("SyncBatchNorm({}): expected an input of shape (N, {}, ...), got {}",
                                 options.num_features(), options.num_features(), shape.str()));
  }
  // BatchNorm's running-average factor: `momentum`, or the cumulative average when momentum is None.
  double factor = options.momentum() ? *options.momentum() : 0.0;
  if (is_training() && options.track_running_stats()) {
    num_batches_tracked.add_(1);
    if (!options.momentum()) factor = 1.0 / num_batches_tracked.item<double>();
  }
  const bool batch_stats = is_training() || !options.track_running_stats();
  if (!batch_stats || comm_ == nullptr) {
    return torch::batch_norm(input, weight, bias, running_mean, running_var, batch_stats, factor,
                             options.eps(), at::globalContext().userEnabledCuDNN());
  }
  return SyncBatchNormFunction::apply(input, weight, bias, is_training() ? running_mean : torch::Tensor(),
                                      is_training() ? running_var : torch::Tensor(), factor, options.eps(),
                                      comm_);
}

}  // namespace accel::nn
