#include <accel/errors.hpp>
#include <accel/nn/activation_checkpoint.hpp>
#include <accel/parallel/tensor_parallel.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/ivalue.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/autograd.h>
#include <torch/nn/functional/embedding.h>
#include <torch/nn/functional/linear.h>
#include <torch/utils.h>

#include <mutex>
#include <utility>

namespace accel {
namespace tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The autograd functions keep their communicator in the context, which holds only IValues; a capsule keeps
// the shared_ptr (and so the group) alive as long as the graph, even if the layer is destroyed before
// backward.
struct CommHolder : torch::CustomClassHolder {
  explicit CommHolder(std::shared_ptr<Communicator> c) : comm(std::move(c)) {}
  std::shared_ptr<Communicator> comm;
};

void hold(AutogradContext* ctx, std::shared_ptr<Communicator> comm) {
  ctx->saved_data["comm"] = c10::IValue::make_capsule(c10::make_intrusive<CommHolder>(std::move(comm)));
}

Communicator& held(AutogradContext* ctx) {
  return *c10::static_intrusive_pointer_cast<CommHolder>(ctx->saved_data.at("comm").toCapsule())->comm;
}

torch::Tensor summed(const torch::Tensor& t, Communicator& comm) {
  auto out = t.clone(at::MemoryFormat::Contiguous);
  comm.all_reduce(out, ReduceOp::Sum);
  return out;
}

// Every rank's `t` side by side along the last dimension, in rank order.
torch::Tensor gathered(const torch::Tensor& t, Communicator& comm) {
  return comm.all_gather(t.movedim(-1, 0).contiguous()).movedim(0, -1).contiguous();
}

struct CopyToTensorParallel : torch::autograd::Function<CopyToTensorParallel> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input,
                               std::shared_ptr<Communicator> comm) {
    hold(ctx, std::move(comm));
    return input;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {summed(grads[0], held(ctx)), torch::Tensor()};
  }
};

struct ReduceFromTensorParallel : torch::autograd::Function<ReduceFromTensorParallel> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& input,
                               std::shared_ptr<Communicator> comm) {
    return summed(input, *comm);
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], torch::Tensor()}; }
};

struct GatherFromTensorParallel : torch::autograd::Function<GatherFromTensorParallel> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input,
                               std::shared_ptr<Communicator> comm) {
    ctx->saved_data["first"] = comm->rank() * input.size(-1);
    ctx->saved_data["width"] = input.size(-1);
    return gathered(input, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0].narrow(-1, ctx->saved_data["first"].toInt(), ctx->saved_data["width"].toInt()),
            torch::Tensor()};
  }
};

struct ScatterToTensorParallel : torch::autograd::Function<ScatterToTensorParallel> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input,
                               std::shared_ptr<Communicator> comm) {
    const auto width = input.size(-1) / comm->world_size();
    auto slice = input.narrow(-1, comm->rank() * width, width).clone(at::MemoryFormat::Contiguous);
    hold(ctx, std::move(comm));
    return slice;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gathered(grads[0], held(ctx)), torch::Tensor()};
  }
};

void check_communicator(const char* layer, const std::shared_ptr<Communicator>& comm) {
  if (!comm) {
    throw UsageError(
        fmt::format("accel::tp::{}: the tensor-parallel communicator is null; pass the group's Communicator "
                    "(Communicator::create for all ranks, or one group of Communicator::split)",
                    layer));
  }
}

// The first index and the count of this rank's part of `size`; UsageError when `size` does not split evenly.
std::pair<std::int64_t, std::int64_t> split(const char* layer, const char* what, std::int64_t size,
                                            const Communicator& comm) {
  const int n = comm.world_size();
  if (size <= 0) {
    throw UsageError(fmt::format("accel::tp::{}: {} is {}; it must be positive", layer, what, size));
  }
  if (size % n != 0) {
    throw UsageError(fmt::format(
        "accel::tp::{}: {} {} is not divisible by the tensor-parallel size {} (rank {} of the group); make "
        "{} a multiple of {} (e.g. {}) or use a group of a size that divides it",
        layer, what, size, n, comm.rank(), what, n, (size / n + 1) * n));
  }
  return {comm.rank() * (size / n), size / n};
}

void check_positive(const char* layer, const char* what, std::int64_t value) {
  if (value <= 0)
    throw UsageError(fmt::format("accel::tp::{}: {} is {}; it must be positive", layer, what, value));
}

void check_last_dim(const char* layer, const torch::Tensor& input, std::int64_t expected,
                    const char* meaning) {
  if (input.dim() == 0 || input.size(-1) != expected) {
    throw UsageError(fmt::format("accel::tp::{}: input of shape {} where the last dimension must be {} ({})",
                                 layer, fmt::format("{}", input.sizes().vec()), expected, meaning));
  }
}

// What `build` returns when run right after torch::manual_seed(*seed) (the CPU generator's state is restored
// afterwards), or run as it is without a seed.
template <typename Build>
auto drawn(const std::optional<std::uint64_t>& seed, Build build) -> decltype(build()) {
  if (!seed) return build();
  auto gen = at::detail::getDefaultCPUGenerator();
  torch::Tensor saved;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved = gen.get_state();
    gen.set_current_seed(*seed);
  }
  auto restore = [&] {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(saved);
  };
  try {
    auto result = build();
    restore();
    return result;
  } catch (...) {
    restore();
    throw;
  }
}

torch::Tensor allocated(std::vector<std::int64_t> sizes, const torch::TensorOptions& options) {
  return torch::empty(sizes, options);
}

}  // namespace

torch::Tensor copy_to_tensor_parallel(const torch::Tensor& input, std::shared_ptr<Communicator> comm) {
  check_communicator("copy_to_tensor_parallel", comm);
  if (comm->world_size() == 1) return input;
  return CopyToTensorParallel::apply(input, std::move(comm));
}

torch::Tensor reduce_from_tensor_parallel(const torch::Tensor& input, std::shared_ptr<Communicator> comm) {
  check_communicator("reduce_from_tensor_parallel", comm);
  if (comm->world_size() == 1) return input;
  return ReduceFromTensorParallel::apply(input, std::move(comm));
}

torch::Tensor gather_from_tensor_parallel(const torch::Tensor& input, std::shared_ptr<Communicator> comm) {
  check_communicator("gather_from_tensor_parallel", comm);
  if (input.dim() == 0) {
    throw UsageError(
        "accel::tp::gather_from_tensor_parallel: the input is a scalar; it needs a last dimension");
  }
  if (comm->world_size() == 1) return input;
  return GatherFromTensorParallel::apply(input, std::move(comm));
}

torch::Tensor scatter_to_tensor_parallel(const torch::Tensor& input, std::shared_ptr<Communicator> comm) {
  check_communicator("scatter_to_tensor_parallel", comm);
  if (input.dim() == 0) {
    throw UsageError(
        "accel::tp::scatter_to_tensor_parallel: the input is a scalar; it needs a last dimension");
  }
  split("scatter_to_tensor_parallel", "the input's last dimension", input.size(-1), *comm);
  if (comm->world_size() == 1) return input;
  return ScatterToTensorParallel::apply(input, std::move(comm));
}

// ---- What the two parallel linear layers share

namespace detail {

template <typename Derived, typename Options>
void ParallelLinearImpl<Derived, Options>::reset_parameters() {
  load(drawn(options.seed(), [&] {
    return torch::nn::Linear(
        torch::nn::LinearOptions(options.in_features(), options.out_features()).bias(options.bias()));
  }));
}

template <typename Derived, typename Options>
void ParallelLinearImpl<Derived, Options>::init() {
  this->reset();
  reset_parameters();
}

template <typename Derived, typename Options>
void ParallelLinearImpl<Derived, Options>::init(const torch::nn::Linear& full) {
  options.bias(full->options.bias());
  tensor_options_ = full->weight.options();
  this->reset();
  load(full);
}

template class ParallelLinearImpl<ColumnParallelLinearImpl, ColumnParallelLinearOptions>;
template class ParallelLinearImpl<RowParallelLinearImpl, RowParallelLinearOptions>;

}  // namespace detail

// ---- ColumnParallelLinear

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options_,
                                                   std::shared_ptr<Communicator> comm)
    : ParallelLinearImpl(options_, std::move(comm)) {
  init();
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::Linear& full,
                                                   std::shared_ptr<Communicator> comm, bool gather_output)
    : ParallelLinearImpl(
          ColumnParallelLinearOptions(full->options.in_features(), full->options.out_features())
              .gather_output(gather_output),
          std::move(comm)) {
  init(full);
}

void ColumnParallelLinearImpl::reset() {
  constexpr const char* kLayer = "ColumnParallelLinear";
  check_communicator(kLayer, comm_);
  check_positive(kLayer, "in_features", options.in_features());
  std::tie(first_, local_) = split(kLayer, "out_features", options.out_features(), *comm_);
  weight = register_parameter("weight", allocated({local_, options.in_features()}, tensor_options_));
  bias = register_parameter("bias", options.bias() ? allocated({local_}, tensor_options_) : torch::Tensor(),
                            /*requires_grad=*/options.bias());
}

void ColumnParallelLinearImpl::load(const torch::nn::Linear& full) {
  torch::NoGradGuard no_grad;
  weight.copy_(full->weight.narrow(0, first_, local_));
  if (bias.defined()) bias.copy_(full->bias.narrow(0, first_, local_));
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& input) {
  check_last_dim("ColumnParallelLinear", input, options.in_features(), "in_features");
  auto out = torch::nn::functional::linear(copy_to_tensor_parallel(input, comm_), weight, bias);
  return options.gather_output() ? gather_from_tensor_parallel(out, comm_) : out;
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << fmt::format(
      "accel::tp::ColumnParallelLinear(in_features={}, out_features={}, bias={}, gather_output={}, rows [{}, "
      "{}) on rank {} of {})",
      options.in_features(), options.out_features(), options.bias(), options.gather_output(), first_,
      first_ + local_, comm_->rank(), comm_->world_size());
}

// ---- RowParallelLinear

RowParallelLinearImpl::RowParallelLinearImpl(const RowParallelLinearOptions& options_,
                                             std::shared_ptr<Communicator> comm)
    : ParallelLinearImpl(options_, std::move(comm)) {
  init();
}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::Linear& full,
                                             std::shared_ptr<Communicator> comm, bool input_is_parallel)
    : ParallelLinearImpl(RowParallelLinearOptions(full->options.in_features(), full->options.out_features())
                             .input_is_parallel(input_is_parallel),
                         std::move(comm)) {
  init(full);
}

void RowParallelLinearImpl::reset() {
  constexpr const char* kLayer = "RowParallelLinear";
  check_communicator(kLayer, comm_);
  check_positive(kLayer, "out_features", options.out_features());
  std::tie(first_, local_) = split(kLayer, "in_features", options.in_features(), *comm_);
  weight = register_parameter("weight", allocated({options.out_features(), local_}, tensor_options_));
  bias = register_parameter(
      "bias", options.bias() ? allocated({options.out_features()}, tensor_options_) : torch::Tensor(),
      /*requires_grad=*/options.bias());
}

void RowParallelLinearImpl::load(const torch::nn::Linear& full) {
  torch::NoGradGuard no_grad;
  weight.copy_(full->weight.narrow(1, first_, local_));
  if (bias.defined()) bias.copy_(full->bias);
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& input) {
  constexpr const char* kLayer = "RowParallelLinear";
  torch::Tensor x = input;
  if (options.input_is_parallel()) {
    check_last_dim(kLayer, input, local_,
                   "in_features / tensor-parallel size, as input_is_parallel: this rank's slice");
  } else {
    check_last_dim(kLayer, input, options.in_features(), "in_features");
    x = scatter_to_tensor_parallel(input, comm_);
  }
  // The bias is added once, after the sum: every rank holds all of it.
  auto out = reduce_from_tensor_parallel(torch::nn::functional::linear(x, weight), comm_);
  return bias.defined() ? out + bias : out;
}

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << fmt::format(
      "accel::tp::RowParallelLinear(in_features={}, out_features={}, bias={}, input_is_parallel={}, columns "
      "[{}, {}) on rank {} of {})",
      options.in_features(), options.out_features(), options.bias(), options.input_is_parallel(), first_,
      first_ + local_, comm_->rank(), comm_->world_size());
}

// ---- VocabParallelEmbedding

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const VocabParallelEmbeddingOptions& options_,
                                                       std::shared_ptr<Communicator> comm)
    : options(options_), comm_(std::move(comm)) {
  reset();
  reset_parameters();
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const torch::nn::Embedding& full,
                                                       std::shared_ptr<Communicator> comm)
    : options(full->options.num_embeddings(), full->options.embedding_dim()), comm_(std::move(comm)) {
  if (full->options.padding_idx() || full->options.max_norm()) {
    throw UsageError(fmt::format(
        "accel::tp::VocabParallelEmbedding: the full embedding has {}, which a vocabulary-parallel embedding "
        "does not support; build it without (zero the padding row yourself, or renormalise outside)",
        full->options.padding_idx() ? fmt::format("padding_idx {}", *full->options.padding_idx())
                                    : fmt::format("max_norm {}", *full->options.max_norm())));
  }
  tensor_options_ = full->weight.options();
  reset();
  load(full);
}

void VocabParallelEmbeddingImpl::reset() {
  constexpr const char* kLayer = "VocabParallelEmbedding";
  check_communicator(kLayer, comm_);
  check_positive(kLayer, "embedding_dim", options.embedding_dim());
  std::tie(first_, local_) = split(kLayer, "num_embeddings", options.num_embeddings(), *comm_);
  weight = register_parameter("weight", allocated({local_, options.embedding_dim()}, tensor_options_));
}

void VocabParallelEmbeddingImpl::reset_parameters() {
  load(drawn(options.seed(),
             [&] { return torch::nn::Embedding(options.num_embeddings(), options.embedding_dim()); }));
}

void VocabParallelEmbeddingImpl::load(const torch::nn::Embedding& full) {
  torch::NoGradGuard no_grad;
  weight.copy_(full->weight.narrow(0, first_, local_));
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& ids) {
  constexpr const char* kLayer = "VocabParallelEmbedding";
  if (at::isFloatingType(ids.scalar_type()) || at::isComplexType(ids.scalar_type()) ||
      ids.scalar_type() == torch::kBool) {
    throw UsageError(fmt::format("accel::tp::{}: ids of type {}; pass integer ids (torch::kLong)", kLayer,
                                 c10::toString(ids.scalar_type())));
  }
  // Every rank holds the same ids, so every rank throws here alike (out-of-range ids would otherwise be
  // looked up by no rank and silently become zeros).
  if (ids.numel() > 0) {
    const auto low = ids.min().item<std::int64_t>(), high = ids.max().item<std::int64_t>();
    if (low < 0 || high >= options.num_embeddings()) {
      throw UsageError(
          fmt::format("accel::tp::{}: id {} is outside the vocabulary [0, {}); check the tokenizer "
                      "against num_embeddings",
                      kLayer, low < 0 ? low : high, options.num_embeddings()));
    }
  }
  if (comm_->world_size() == 1) return torch::embedding(weight, ids);
  const auto outside = ids.lt(first_).logical_or(ids.ge(first_ + local_));
  auto looked_up = torch::embedding(weight, (ids - first_).masked_fill(outside, 0));
  return reduce_from_tensor_parallel(looked_up.masked_fill(outside.unsqueeze(-1), 0), comm_);
}

void VocabParallelEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << fmt::format(
      "accel::tp::VocabParallelEmbedding(num_embeddings={}, embedding_dim={}, rows [{}, {}) on rank {} of "
      "{})",
      options.num_embeddings(), options.embedding_dim(), first_, first_ + local_, comm_->rank(),
      comm_->world_size());
}

std::map<std::string, SplitParameter> split_parameters(const torch::nn::Module& model) {
  std::map<std::string, SplitParameter> out;
  auto note = [&](const std::string& prefix, const char* param, const torch::Tensor& t, std::int64_t dim,
                  std::int64_t first, std::int64_t length, const std::shared_ptr<Communicator>& comm) {
    if (!t.defined()) return;
    const std::string name = prefix.empty() ? param : prefix + "." + param;
    out[name] = SplitParameter{dim, first, length, length * comm->world_size(), comm};
  };
  auto visit = [&](const std::string& prefix, const torch::nn::Module& outer) {
    // An accel::Checkpointed layer (activation checkpointing from a config file wraps each block's layers)
    // registers the wrapped layer's parameters under the same names: the split is the wrapped layer's.
    const torch::nn::Module* inner = &outer;
    while (const auto* ck = dynamic_cast<const CheckpointedImpl*>(inner))
      inner = ck->module().get();
    const torch::nn::Module& m = *inner;
    // A LoRA adapter on the layer (accel::peft, PEFT's LoraParallelLinear) is split as the weight: B's rows
    // under a column split, A's columns under a row split; the other adapter is whole on every rank.
    const auto adapter = [&](const char* child) {
      const auto children = m.named_children();
      const auto* c = children.find(child);
      if (c == nullptr) return torch::Tensor();
      const auto params = (*c)->named_parameters(/*recurse=*/false);
      const auto* w = params.find("weight");
      return w == nullptr ? torch::Tensor() : *w;
    };
    const auto join = [](const std::string& prefix, const char* child) {
      return prefix.empty() ? std::string(child) : prefix + "." + child;
    };
    if (const auto* c = dynamic_cast<const ColumnParallelLinearImpl*>(&m)) {
      note(prefix, "weight", c->weight, 0, c->first_row(), c->local_rows(), c->communicator());
      note(prefix, "bias", c->bias, 0, c->first_row(), c->local_rows(), c->communicator());
      note(join(prefix, "lora_B"), "weight", adapter("lora_B"), 0, c->first_row(), c->local_rows(),
           c->communicator());
    } else if (const auto* r = dynamic_cast<const RowParallelLinearImpl*>(&m)) {
      note(prefix, "weight", r->weight, 1, r->first_column(), r->local_columns(), r->communicator());
      note(join(prefix, "lora_A"), "weight", adapter("lora_A"), 1, r->first_column(), r->local_columns(),
           r->communicator());
    } else if (const auto* e = dynamic_cast<const VocabParallelEmbeddingImpl*>(&m)) {
      note(prefix, "weight", e->weight, 0, e->first_row(), e->local_rows(), e->communicator());
    }
  };
  visit("", model);
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    visit(item.key(), *item.value());
  return out;
}

}  // namespace tp
}  // namespace accel
