// Accelerator: exporting a prepared model as Hugging Face does (save_model / load_model) and the main-process
// state dict. The engines hand the state over one piece (unit) at a time; only the main process writes.
#include <accel/accelerator/accelerator.hpp>

#include "checkpoint/model_export.hpp"
#include "distributed/rank_failures.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <optional>
#include <sstream>

namespace accel {
namespace {

std::uint64_t bytes_of(const NamedTensors& piece) {
  std::uint64_t total = 0;
  for (const auto& [name, t] : piece)
    total += detail::tensor_bytes(t);
  return total;
}

}  // namespace

namespace detail {

void gather_tensor_parallel(NamedTensors& piece, const std::map<std::string, tp::SplitParameter>& splits) {
  for (auto& [name, t] : piece) {
    const auto found = splits.find(name);
    if (found == splits.end()) continue;
    const auto& s = found->second;
    t = s.comm->all_gather(t.detach().movedim(s.dim, 0).contiguous()).movedim(0, s.dim).contiguous();
  }
}

void slice_tensor_parallel(std::map<std::string, torch::Tensor>& state,
                           const std::map<std::string, tp::SplitParameter>& splits,
                           const std::string& where) {
  for (const auto& [name, s] : splits) {
    const auto found = state.find(name);
    if (found == state.end()) continue;  // the engine names what is missing
    auto& t = found->second;
    if (t.dim() <= s.dim || t.size(s.dim) != s.full) {
      throw CheckpointError(fmt::format(
          "{}: '{}' has shape [{}] but its tensor-parallel layer is {} wide along dimension {} ({} on "
          "each of {} ranks); the file was written from another model",
          where, name, fmt::join(t.sizes(), ", "), s.full, s.dim, s.length, s.comm->world_size()));
    }
    t = t.narrow(s.dim, s.first, s.length);
  }
}

void visit_whole_model(Backend& engine, const std::map<std::string, tp::SplitParameter>& splits,
                       Communicator* pipe, bool share_stages, torch::Device device,
                       const std::function<void(NamedTensors)>& sink) {
  if (pipe == nullptr || pipe->world_size() == 1) {
    engine.visit_model_state([&](NamedTensors piece) {
      gather_tensor_parallel(piece, splits);
      sink(std::move(piece));
    });
    return;
  }
  NamedTensors mine;
  engine.visit_model_state([&](NamedTensors piece) {
    if (share_stages) gather_tensor_parallel(piece, splits);
    for (auto& entry : piece)
      mine.push_back(std::move(entry));
  });
  if (!share_stages) return;
  for (int stage = 0; stage < pipe->world_size(); ++stage) {
    std::string header;
    if (pipe->rank() == stage) {
      for (const auto& [name, t] : mine)
        header +=
            fmt::format("{}\t{}\t{}\n", name, static_cast<int>(t.scalar_type()), fmt::join(t.sizes(), ","));
    }
    header = pipe->exchange(header)[static_cast<std::size_t>(stage)];
    NamedTensors piece;
    std::istringstream lines(header);
    std::string line;
    for (std::size_t k = 0; std::getline(lines, line); ++k) {
      const auto tab1 = line.find('\t'), tab2 = line.find('\t', tab1 + 1);
      torch::Tensor t;
      if (pipe->rank() == stage) {
        t = mine.at(k).second.detach().contiguous();
      } else {
        std::vector<std::int64_t> shape;
        std::istringstream dims(line.substr(tab2 + 1));
        for (std::string d; std::getline(dims, d, ',');)
          shape.push_back(std::stoll(d));
        const auto dtype = static_cast<torch::ScalarType>(std::stoi(line.substr(tab1 + 1, tab2 - tab1 - 1)));
        t = torch::empty(shape, torch::TensorOptions().dtype(dtype).device(device));
      }
      pipe->broadcast(t, stage);
      piece.emplace_back(line.substr(0, tab1), t);
    }
    sink(std::move(piece));
  }
}

}  // namespace detail

NamedTensors Accelerator::main_process_state(std::size_t index) {
  auto& engine = *prepared_.models.at(index).engine;
  engine.sync_parameters();
  // With tensor parallelism the main process's group gathers the split parameters (the others need not).
  const auto splits = groups_.data->rank() == 0 ? tp::split_parameters(*prepared_.models.at(index).module)
                                                : std::map<std::string, tp::SplitParameter>{};
  NamedTensors out;
  detail::visit_whole_model(
      engine, splits, pipeline_.engine && index == pipeline_.model ? groups_.pipeline.get() : nullptr,
      groups_.data->rank() == 0, device_, [&](NamedTensors piece) {
        if (!is_main_process()) return;
        for (auto& [name, t] : piece)
          out.emplace_back(name, t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
      });
  detail::in_model_order(out, *prepared_.models.at(index).module);
  return out;
}

ModelExport Accelerator::save_model_at(std::size_t index, const std::string& dir,
                                       const std::string& max_shard_size) {
  // Every rank parses the size, so a bad one fails everywhere before any collective.
  const std::uint64_t max_bytes = detail::parse_shard_size(max_shard_size);
  auto& engine = *prepared_.models.at(index).engine;
  engine.sync_parameters();
  // With tensor parallelism the main process's group writes whole parameters (the layers' unsplit names and
  // shapes, which a model built without tensor parallelism loads).
  const auto splits = groups_.data->rank() == 0 ? tp::split_parameters(*prepared_.models.at(index).module)
                                                : std::map<std::string, tp::SplitParameter>{};

  std::optional<detail::ShardedExportWriter> writer;
  std::string failure;
  if (is_main_process()) {
    try {
      writer.emplace(dir, max_bytes);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  // A failure on the main process stops its writing but not its part in the gathers, so no rank hangs; all
  // ranks then throw the same error.
  std::uint64_t peak = 0;
  detail::visit_whole_model(engine, splits,
                            pipeline_.engine && index == pipeline_.model ? groups_.pipeline.get() : nullptr,
                            groups_.data->rank() == 0, device_, [&](NamedTensors piece) {
                              const std::uint64_t piece_bytes = bytes_of(piece);
                              peak = std::max(peak, (writer ? writer->held_bytes() : 0) + piece_bytes);
                              if (!writer || !failure.empty()) return;
                              try {
                                for (const auto& [name, t] : piece) {
                                  writer->add(name, t);
                                  peak = std::max(peak, writer->held_bytes() + piece_bytes);
                                }
                              } catch (const std::exception& e) {
                                failure = e.what();
                              }
                            });
  ModelExport out;
  if (writer && failure.empty()) {
    try {
      out = writer->finish();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  writer.reset();  // an unfinished export removes its temporary files
  detail::throw_first_failure(*groups_.job, failure, [&](std::size_t r, const std::string& what) {
    return fmt::format(
        "save_model to '{}' failed on rank {}: {}; the weights already in '{}' were left as they "
        "were",
        dir, r, what, dir);
  });
  out.peak_held_bytes = peak;
  return out;
}

void Accelerator::load_model_at(std::size_t index, const std::string& dir) {
  std::map<std::string, torch::Tensor> state;
  std::string failure;
  try {
    // Mapped, not read: each engine copies what this rank keeps (ZeRO-3 and FULL_SHARD: its slices only).
    state = detail::map_model_export(dir);
    detail::slice_tensor_parallel(state, tp::split_parameters(*prepared_.models.at(index).module),
                                  fmt::format("load_model from '{}'", dir));
  } catch (const std::exception& e) {
    failure = e.what();
  }
  detail::throw_first_failure(*groups_.job, failure, [](std::size_t r, const std::string& what) {
    return fmt::format("rank {}: {}", r, what);
  });
  auto& engine = *prepared_.models.at(index).engine;
  engine.sync_parameters();
  engine.load_model_state(state);
}

}  // namespace accel
