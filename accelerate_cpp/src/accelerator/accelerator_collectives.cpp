// Accelerator: collectives over tensors (gather, reduce, broadcast, padding), synchronisation points and
// splitting work between processes.
#include <accel/accelerator/accelerator.hpp>

#include <fmt/format.h>

#include <algorithm>

namespace accel {

torch::Tensor Accelerator::gather(const torch::Tensor& t) {
  return gather_over(*groups_.job, t);
}

torch::Tensor Accelerator::gather_over(Communicator& comm, const torch::Tensor& t) {
  auto x = t.dim() == 0 ? t.reshape({1}) : t;
  const int ranks = comm.world_size();
  if (ranks == 1) return x;
  // Sizes along dim 0 may differ (even_batches off, last batches): gather them first, pad, gather, trim.
  auto size = torch::tensor({x.size(0)}, torch::TensorOptions().dtype(torch::kInt64).device(x.device()));
  const auto sizes = comm.all_gather(size).cpu();
  const auto* n = sizes.data_ptr<std::int64_t>();
  const auto longest = *std::max_element(n, n + ranks);
  if (std::all_of(n, n + ranks, [&](std::int64_t v) { return v == longest; })) return comm.all_gather(x);
  auto pad_shape = x.sizes().vec();
  pad_shape[0] = longest - x.size(0);
  auto gathered = comm.all_gather(torch::cat({x, torch::zeros(pad_shape, x.options())}));
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < ranks; ++r)
    parts.push_back(gathered.narrow(0, r * longest, n[r]));
  return torch::cat(parts);
}

torch::Tensor Accelerator::gather_for_metrics(const torch::Tensor& t) {
  // Prepared loaders shard the data over the data-parallel replicas (with tensor parallelism, the ranks of
  // one group read the same batches): each replica's predictions count once.
  auto all = gather_over(*groups_.data, t);
  // At the end of an epoch, the last round held `remainder` real samples and the rest were wrapped around.
  const auto* l = active_loader();
  if (groups_.data->world_size() > 1 && l != nullptr && l->in_epoch && l->at_last_batch && l->remainder > 0) {
    return all.narrow(0, 0, std::min<std::int64_t>(all.size(0), static_cast<std::int64_t>(l->remainder)));
  }
  return all;
}

torch::Tensor Accelerator::reduce(const torch::Tensor& t, ReduceOp op) {
  auto out = t.clone();
  groups_.job->all_reduce(out, op);
  return out;
}

torch::Tensor Accelerator::broadcast(const torch::Tensor& t, int from) {
  if (from < 0 || from >= state_.world_size) {
    throw UsageError(fmt::format("broadcast: source rank {} is outside 0..{}", from, state_.world_size - 1));
  }
  auto out = t.clone();
  groups_.job->broadcast(out, from);
  return out;
}

torch::Tensor Accelerator::pad_across_processes(const torch::Tensor& t, std::int64_t dim, double pad_index,
                                                bool pad_first) {
  if (state_.world_size == 1 || t.dim() == 0) return t;
  if (dim < 0) dim += t.dim();
  if (dim < 0 || dim >= t.dim()) {
    throw UsageError(
        fmt::format("pad_across_processes: dim {} is out of range for a {}-d tensor", dim, t.dim()));
  }
  auto size = torch::tensor({t.size(dim)}, torch::TensorOptions().dtype(torch::kInt64).device(t.device()));
  const auto longest = groups_.job->all_gather(size).max().item<std::int64_t>();
  if (longest == t.size(dim)) return t;
  auto shape = t.sizes().vec();
  shape[static_cast<std::size_t>(dim)] = longest;
  auto out = torch::full(shape, pad_index, t.options());
  const auto start = pad_first ? longest - t.size(dim) : 0;
  out.narrow(dim, start, t.size(dim)).copy_(t);
  return out;
}

void Accelerator::wait_for_everyone() {
  sync_parameters();  // the models are current afterwards, also for code that runs on one rank only
  groups_.job->barrier();
}

std::vector<std::string> Accelerator::exchange_bytes(const std::string& mine) {
  return groups_.job->exchange(mine);
}

void Accelerator::check_rank(int index, const char* what) const {
  if (index < 0 || index >= state_.world_size) {
    throw UsageError(fmt::format("{}: process {} does not exist; this run has processes 0..{}", what, index,
                                 state_.world_size - 1));
  }
}

bool Accelerator::check_trigger() {
  auto flag = torch::tensor({trigger_ ? 1.0f : 0.0f}, torch::TensorOptions().device(device_));
  if (state_.world_size > 1) groups_.job->all_reduce(flag, ReduceOp::Sum);
  trigger_ = false;
  return flag.item<float>() > 0;
}

void Accelerator::sync_parameters() {
  for (auto& m : prepared_.models)
    m.engine->sync_parameters();
}

Accelerator::SplitRange Accelerator::split_range(std::size_t n) const {
  const auto w = static_cast<std::size_t>(state_.world_size), r = static_cast<std::size_t>(state_.rank);
  const std::size_t per = n / w, extra = n % w;
  const std::size_t begin = r * per + std::min(r, extra);
  return {begin, begin + per + (r < extra ? 1 : 0), per + (extra > 0 ? 1 : 0)};
}

torch::Tensor Accelerator::split_between_processes(const torch::Tensor& t, bool apply_padding) const {
  const auto [begin, end, longest] = split_range(static_cast<std::size_t>(t.size(0)));
  auto out = t.narrow(0, static_cast<std::int64_t>(begin), static_cast<std::int64_t>(end - begin));
  if (apply_padding && t.size(0) > 0 && end - begin < longest) {
    out = torch::cat({out, t.narrow(0, t.size(0) - 1, 1).expand_as(t.narrow(0, 0, 1))});
  }
  return out;
}

Accelerator::MainProcessFirst::MainProcessFirst(Accelerator* acc, bool main) : acc_(acc), main_(main) {
  if (!main_) acc_->wait_for_everyone();  // wait until the main process finished the block
}

Accelerator::MainProcessFirst::~MainProcessFirst() noexcept(false) {
  if (acc_ != nullptr && main_) acc_->wait_for_everyone();  // release the others
}

Accelerator::MainProcessFirst Accelerator::main_process_first() {
  return MainProcessFirst(this, is_main_process());
}

Accelerator::MainProcessFirst Accelerator::local_main_process_first() {
  return MainProcessFirst(this, is_local_main_process());
}

}  // namespace accel
