#include "grad_reduce.hpp"

#include <accel/errors.hpp>
#include <accel/nn/constant_buffers.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <utility>

namespace accel::backends::detail {

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
      "rank that owns each shard (reduce-scatter), which low-rank factors cannot do; set ddp_comm_hook: fp16 "
      "or bf16 (half the bytes on every backend), or backend: ddp",
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

GradientTensors sharded_gradients(std::vector<torch::Tensor> masters, int copies,
                                  std::vector<torch::Tensor> loose) {
  GradientTensors out;
  out.tensors = std::move(masters);
  out.sharded = true;
  out.copies = copies;
  out.replicated = std::move(loose);
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

std::vector<torch::Tensor> broadcast_buffer_list(torch::nn::Module& model) {
  std::vector<torch::Tensor> buffers;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (dynamic_cast<const ConstantBuffers*>(m.get()) != nullptr) continue;
    for (const auto& b : m->buffers(/*recurse=*/false))
      if (b.defined() && b.numel() > 0) buffers.push_back(b);
  }
  return buffers;
}

void broadcast_buffers(Communicator& comm, torch::nn::Module& model) {
  if (comm.world_size() == 1) return;
  auto buffers = broadcast_buffer_list(model);
  if (buffers.empty()) return;
  flat_in_place(buffers, [&](torch::Tensor& flat) { comm.broadcast(flat, 0); });
}

}  // namespace accel::backends::detail
