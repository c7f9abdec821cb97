#include "grad_utils.hpp"

#include <accel/errors.hpp>
#include <accel/optim.hpp>

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/utils/clip_grad.h>

#include <sstream>

namespace accel::backends::detail {

std::vector<std::string> offload_step_notices(const std::string& key,
                                              const torch::optim::Optimizer& optimizer) {
  const auto fused = optim::fused_replacement(optimizer);
  if (!fused) return {};
  const std::string kind = fused->substr(fused->rfind(':') + 1);
  // Speed-ups measured by bench_optim on a 21M-parameter MLP (BENCHMARKS.md).
  const char* gain = kind == "SGD" ? "the fused CPU step, about 2x faster per step"
                                   : "the fused CPU step (DeepSpeed's CPU-Adam role), 4-11x faster per step";
  return {fmt::format(
      "{}: torch::optim::{} steps the CPU shard with LibTorch's unfused update (several operators and "
      "temporaries per tensor); {} (#include <accel/optim.hpp>: same options and state names, checkpoints "
      "load "
      "both ways) is {} in bench_optim (BENCHMARKS.md)",
      key, kind, *fused, gain)};
}

std::optional<c10::ScalarType> wire_dtype(CommHook hook) {
  switch (hook) {
    case CommHook::Fp16:
      return torch::kHalf;
    case CommHook::Bf16:
      return torch::kBFloat16;
    case CommHook::No:
    case CommHook::PowerSgd:  // DDP's own algorithm, not a wire type (sharded engines refuse it)
      break;
  }
  return std::nullopt;
}

void refuse_power_sgd(const Config& config, const std::string& who) {
  if (config.ddp_comm_hook != CommHook::PowerSgd) return;
  throw UsageError(fmt::format(
      "ddp_comm_hook: power_sgd compresses DDP's all-reduce, but the {} backend reduces gradients to the "
      "rank "
      "that owns each shard (reduce-scatter), which low-rank factors cannot do; set ddp_comm_hook: fp16 or "
      "bf16 (half the bytes on every backend), or backend: ddp",
      who));
}

namespace {

// The collective runs on `sent` (compressed); wait() writes `received` x world size into `result`.
class Decompress final : public CollectiveHandle {
 public:
  Decompress(std::unique_ptr<CollectiveHandle> inner, torch::Tensor received, torch::Tensor result, int world)
      : inner_(std::move(inner)), received_(std::move(received)), result_(std::move(result)), world_(world) {}
  void wait() override {
    inner_->wait();
    torch::NoGradGuard no_grad;
    result_.copy_(received_).mul_(world_);
  }

 private:
  std::unique_ptr<CollectiveHandle> inner_;
  torch::Tensor received_, result_;
  int world_;
};

// Only gradients wider than the wire type (fp32, fp64): fp16 and bf16 gradients would save no bytes, and
// casting bf16 to fp16 could overflow where no GradScaler watches.
bool compress(const torch::Tensor& t, const std::optional<c10::ScalarType>& wire) {
  return wire && t.is_floating_point() &&
         static_cast<std::size_t>(t.element_size()) > c10::elementSize(*wire);
}

torch::Tensor compressed(const torch::Tensor& t, c10::ScalarType wire, int world) {
  torch::NoGradGuard no_grad;
  return t.div(world).to(wire);  // divided first, as PyTorch's hooks, so the sum cannot overflow fp16
}

}  // namespace

std::unique_ptr<CollectiveHandle> all_reduce_grads(Communicator& comm, torch::Tensor flat,
                                                   std::optional<c10::ScalarType> wire) {
  if (!compress(flat, wire)) return comm.all_reduce_async({flat});
  auto sent = compressed(flat, *wire, comm.world_size());
  auto inner = comm.all_reduce_async({sent});
  return std::make_unique<Decompress>(std::move(inner), sent, flat, comm.world_size());
}

std::unique_ptr<CollectiveHandle> reduce_scatter_grads(Communicator& comm, torch::Tensor output,
                                                       torch::Tensor input,
                                                       std::optional<c10::ScalarType> wire) {
  if (!compress(input, wire)) return comm.reduce_scatter_async(output, input);
  auto sent = compressed(input, *wire, comm.world_size());
  auto received = torch::empty(output.sizes(), sent.options());
  auto inner = comm.reduce_scatter_async(received, sent);
  return std::make_unique<Decompress>(std::move(inner), received, output, comm.world_size());
}

std::unique_ptr<CollectiveHandle> reduce_grads(Communicator& comm, torch::Tensor tensor, int root,
                                               std::optional<c10::ScalarType> wire) {
  if (!compress(tensor, wire)) return comm.reduce_async(tensor, root);
  auto sent = compressed(tensor, *wire, comm.world_size());
  auto inner = comm.reduce_async(sent, root);
  return std::make_unique<Decompress>(std::move(inner), sent, tensor, comm.world_size());
}

NamedTensors module_state(torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& item : module.named_parameters())
    out.emplace_back(item.key(), item.value().detach());
  for (const auto& item : module.named_buffers())
    out.emplace_back(item.key(), item.value().detach());
  return out;
}

NamedTensors module_state_copy(torch::nn::Module& module) {
  auto out = module_state(module);
  for (auto& [name, t] : out)
    t = t.clone();
  return out;
}

NamedTensors module_buffers(torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& item : module.named_buffers())
    out.emplace_back(item.key(), item.value().detach());
  return out;
}

void load_module_state(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& state) {
  torch::NoGradGuard no_grad;
  auto load = [&](const std::string& name, torch::Tensor& dst) {
    auto it = state.find(name);
    if (it == state.end()) {
      throw CheckpointError(fmt::format(
          "checkpoint has no tensor '{}' for the model; was it saved from the same model architecture?",
          name));
    }
    if (it->second.sizes() != dst.sizes()) {
      throw CheckpointError(fmt::format("checkpoint tensor '{}' has shape [{}] but the model expects [{}]",
                                        name, fmt::join(it->second.sizes(), ", "),
                                        fmt::join(dst.sizes(), ", ")));
    }
    dst.copy_(it->second);
  };
  for (auto& item : module.named_parameters())
    load(item.key(), item.value());
  for (auto& item : module.named_buffers())
    load(item.key(), item.value());
}

std::vector<torch::Tensor> loose_parameters(const std::vector<torch::Tensor>& params,
                                            const std::function<bool(std::size_t)>& owned) {
  std::vector<torch::Tensor> out;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!owned(i) && params[i].requires_grad()) out.push_back(params[i]);
  }
  return out;
}

bool any_grad(const std::vector<torch::Tensor>& params) {
  return std::any_of(params.begin(), params.end(), [](const torch::Tensor& p) { return p.grad().defined(); });
}

void end_sync_step(Communicator& comm, torch::nn::Module& model, const Config& config,
                   const std::vector<torch::Tensor>& loose) {
  all_reduce_mean_grads(comm, loose);
  if (config.ddp_broadcast_buffers) broadcast_buffers(comm, model);
}

std::vector<std::pair<std::string, NamedTensors>> model_16bit_files(
    const NamedTensors& full_state, const std::optional<c10::ScalarType>& dtype) {
  if (!dtype) return {};
  return {{"model_16bit", converted(full_state, *dtype)}};
}

GradientTensors sharded_gradients(std::vector<torch::Tensor> masters) {
  GradientTensors out;
  out.tensors = std::move(masters);
  out.sharded = true;
  return out;
}

void check_unused(const std::string& who, const std::vector<std::string>& unused, bool tolerate) {
  if (unused.empty() || tolerate) return;
  throw UsageError(
      fmt::format("{}: parameter(s) {} received no gradient in this backward while others of the same model "
                  "did, so their gradients cannot be reduced; make every parameter take part in the loss, or "
                  "set `ddp_find_unused_parameters: true` in the config to reduce them as zeros",
                  who, fmt::join(unused, ", ")));
}

namespace {

// Runs `f(flat)` on the concatenation of `tensors` (grouped by dtype and device), then copies the result
// back; one collective per group instead of one per tensor.
template <class F>
void flat_in_place(const std::vector<torch::Tensor>& tensors, F f) {
  std::vector<std::vector<torch::Tensor>> groups;
  for (const auto& t : tensors) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) {
      return g.front().scalar_type() == t.scalar_type() && g.front().device() == t.device();
    });
    if (it == groups.end()) {
      groups.push_back({t});
    } else {
      it->push_back(t);
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& g : groups) {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : g)
      flat_parts.push_back(t.reshape({-1}));
    auto flat = torch::cat(flat_parts);
    f(flat);
    std::int64_t at = 0;
    for (auto& t : g) {
      t.copy_(flat.narrow(0, at, t.numel()).view(t.sizes()));
      at += t.numel();
    }
  }
}

}  // namespace

void all_reduce_mean_grads(Communicator& comm, const std::vector<torch::Tensor>& params) {
  if (comm.world_size() == 1) return;
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return;
  flat_in_place(grads, [&](torch::Tensor& flat) {
    comm.all_reduce(flat, ReduceOp::Sum);
    flat.div_(comm.world_size());
  });
}

NamedTensors converted(const NamedTensors& state, c10::ScalarType dtype) {
  NamedTensors out;
  for (const auto& [name, t] : state)
    out.emplace_back(name, t.is_floating_point() ? t.to(dtype) : t);
  return out;
}

void broadcast_buffers(Communicator& comm, torch::nn::Module& model) {
  if (comm.world_size() == 1) return;
  std::vector<torch::Tensor> buffers;
  for (const auto& b : model.buffers()) {
    if (b.defined() && b.numel() > 0) buffers.push_back(b);
  }
  if (buffers.empty()) return;
  flat_in_place(buffers, [&](torch::Tensor& flat) { comm.broadcast(flat, 0); });
}

std::vector<std::pair<std::string, torch::Tensor>> take_over_model(Communicator& comm,
                                                                   torch::nn::Module& model,
                                                                   const std::string& who) {
  check_same_model_everywhere(comm, model, who);
  broadcast_module(comm, model);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : model.named_parameters())
    out.emplace_back(item.key(), item.value());
  return out;
}

std::size_t parameter_index(const std::vector<torch::Tensor>& params, const torch::Tensor& p,
                            const std::string& who) {
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return i;
  }
  throw UsageError(
      fmt::format("{}: the optimizer holds a tensor that is not a parameter of the prepared model", who));
}

std::int64_t shard_size(std::int64_t numel, int world) {
  return std::max<std::int64_t>(1, (numel + world - 1) / world);
}

torch::Tensor flat_slice(const std::vector<torch::Tensor>& params, const std::vector<std::size_t>& indices,
                         const std::vector<std::int64_t>& offsets, std::int64_t shard,
                         const Communicator& comm, bool to_cpu) {
  torch::NoGradGuard no_grad;
  const auto& first = params[indices.front()];
  auto flat = torch::zeros({shard * comm.world_size()}, first.options().requires_grad(false));
  for (std::size_t m = 0; m < indices.size(); ++m) {
    const auto& p = params[indices[m]];
    flat.narrow(0, offsets[m], p.numel()).copy_(p.detach().reshape({-1}));
  }
  auto slice = flat.narrow(0, comm.rank() * shard, shard).clone();
  return to_cpu ? slice.to(torch::kCPU) : slice;
}

void check_shardable_optimizer(const torch::nn::Module* model, const torch::optim::Optimizer& optimizer,
                               const std::string& who) {
  if (model == nullptr) {
    throw UsageError(
        fmt::format("{}: prepare the model before (or together with) its optimizer: "
                    "accelerator.prepare(model, optimizer)",
                    who));
  }
  if (!optimizer.state().empty()) {
    throw UsageError(
        fmt::format("{}: the optimizer already has state (it has stepped); prepare it before the first "
                    "optimizer.step() so that its state can be sharded",
                    who));
  }
}

OptimizerTensorLayout flat_layout(const std::vector<std::string>& names,
                                  const std::vector<torch::Tensor>& params,
                                  const std::vector<std::size_t>& indices,
                                  const std::vector<std::int64_t>& offsets, std::int64_t shard,
                                  const Communicator& comm) {
  OptimizerTensorLayout l;
  for (std::size_t m = 0; m < indices.size(); ++m)
    l.pieces.push_back({names[indices[m]], offsets[m], params[indices[m]].numel()});
  l.flat_numel = shard * comm.world_size();
  l.begin = shard * comm.rank();
  l.length = shard;
  return l;
}

std::vector<OptimizerTensorLayout> layouts_for(
    const torch::optim::Optimizer& optimizer,
    const std::vector<std::pair<torch::Tensor, OptimizerTensorLayout>>& known, const std::string& who) {
  std::vector<OptimizerTensorLayout> out;
  for (const auto& pg : optimizer.param_groups()) {
    for (const auto& t : pg.params()) {
      const auto it = std::find_if(known.begin(), known.end(), [&](const auto& k) {
        return k.first.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
      });
      if (it == known.end()) {
        throw UsageError(
            fmt::format("{}: the optimizer holds a tensor this backend did not create; prepare it with "
                        "accelerator.prepare",
                        who));
      }
      out.push_back(it->second);
    }
  }
  return out;
}

void check_same_model_everywhere(Communicator& comm, torch::nn::Module& model, const std::string& who) {
  std::string signature;
  for (const auto& item : model.named_parameters()) {
    signature += fmt::format("{}:[{}];", item.key(), fmt::join(item.value().sizes(), ","));
  }
  for (const auto& item : model.named_buffers()) {
    signature += fmt::format("{}:[{}];", item.key(), fmt::join(item.value().sizes(), ","));
  }
  const auto all = comm.exchange(signature);
  for (int r = 1; r < comm.world_size(); ++r) {
    if (all[static_cast<std::size_t>(r)] != all[0]) {
      throw DistributedError(
          fmt::format("{}: the model on rank {} differs from rank 0's: {}; every rank must build "
                      "the same model",
                      who, r, first_difference(all[0], all[static_cast<std::size_t>(r)])));
    }
  }
}

void broadcast_module(Communicator& comm, torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (auto& p : model.parameters())
    comm.broadcast(p, 0);
  for (auto& b : model.buffers())
    comm.broadcast(b, 0);
}

std::string first_difference(const std::string& a, const std::string& b) {
  std::istringstream sa(a), sb(b);
  std::string ea, eb;
  while (true) {
    const bool ga = static_cast<bool>(std::getline(sa, ea, ';'));
    const bool gb = static_cast<bool>(std::getline(sb, eb, ';'));
    if (!ga && !gb) return "identical";
    if (!ga) ea = "<nothing>";
    if (!gb) eb = "<nothing>";
    if (ea != eb) return fmt::format("'{}' on rank 0 vs '{}'", ea, eb);
  }
}

}  // namespace accel::backends::detail
