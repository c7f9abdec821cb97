#include "checkpoint/tensor_io.hpp"

#include <accel/errors.hpp>

#include "checkpoint/safetensors_write.hpp"

#include <fmt/format.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/output-archive.h>
#include <torch/types.h>

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace accel::detail {

FileDigest write_archive(torch::serialize::OutputArchive& archive, const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) {
    throw CheckpointError(fmt::format("cannot create {}: {}", path, std::strerror(errno)));
  }
  std::uint64_t written = 0;
  int error = 0;
  Xxh64 hash;
  try {
    // Never a short count: LibTorch's zip writer would throw, and then abort from its destructor. The first
    // failure is remembered, the rest of the archive is dropped, and the error is raised below.
    archive.save_to([&](const void* data, std::size_t n) -> std::size_t {
      if (error == 0 && n > 0) {
        errno = 0;
        if (std::fwrite(data, 1, n, file) == n) {
          written += n;
          hash.update(data, n);
        } else {
          error = errno != 0 ? errno : EIO;
        }
      }
      return n;
    });
  } catch (...) {
    std::fclose(file);
    std::remove(path.c_str());
    throw;
  }
  if (std::fflush(file) != 0 && error == 0) error = errno;
  if (std::fclose(file) != 0 && error == 0) error = errno;
  if (error != 0) {
    std::remove(path.c_str());
    throw CheckpointError(
        fmt::format("writing {} failed after {} bytes: {}{}", path, written, std::strerror(error),
                    error == ENOSPC || error == EFBIG || error == EDQUOT
                        ? " (the disk, quota or file-size limit is full; free space and save "
                          "again: the previous checkpoint is untouched)"
                        : ""));
  }
  return {hash.size(), hash.digest()};
}

FileDigest write_optimizer(const torch::optim::Optimizer& optimizer, const std::string& path) {
  torch::serialize::OutputArchive archive;
  archive << optimizer;
  return write_archive(archive, path);
}

namespace {

safetensors::DType to_dtype(const torch::Tensor& t, const std::string& name) {
  switch (t.scalar_type()) {
    case torch::kFloat64:
      return safetensors::DType::F64;
    case torch::kFloat32:
      return safetensors::DType::F32;
    case torch::kFloat16:
      return safetensors::DType::F16;
    case torch::kBFloat16:
      return safetensors::DType::BF16;
    case torch::kInt64:
      return safetensors::DType::I64;
    case torch::kInt32:
      return safetensors::DType::I32;
    case torch::kInt16:
      return safetensors::DType::I16;
    case torch::kInt8:
      return safetensors::DType::I8;
    case torch::kUInt8:
      return safetensors::DType::U8;
    case torch::kBool:
      return safetensors::DType::Bool;
    default:
      throw CheckpointError(fmt::format("tensor '{}' has dtype {}, which safetensors cannot store", name,
                                        c10::toString(t.scalar_type())));
  }
}

torch::ScalarType to_scalar_type(safetensors::DType d, const std::string& name) {
  switch (d) {
    case safetensors::DType::F64:
      return torch::kFloat64;
    case safetensors::DType::F32:
      return torch::kFloat32;
    case safetensors::DType::F16:
      return torch::kFloat16;
    case safetensors::DType::BF16:
      return torch::kBFloat16;
    case safetensors::DType::I64:
      return torch::kInt64;
    case safetensors::DType::I32:
      return torch::kInt32;
    case safetensors::DType::I16:
      return torch::kInt16;
    case safetensors::DType::I8:
      return torch::kInt8;
    case safetensors::DType::U8:
      return torch::kUInt8;
    case safetensors::DType::Bool:
      return torch::kBool;
    default:
      throw CheckpointError(
          fmt::format("tensor '{}' has safetensors dtype {}, which accelerate-cpp does not load", name,
                      safetensors::dtype_name(d)));
  }
}

}  // namespace

FileDigest write_tensors(const std::string& path, const NamedTensors& tensors,
                         const std::map<std::string, std::string>& metadata) {
  std::vector<torch::Tensor> keep;  // contiguous CPU copies must outlive the views
  std::vector<safetensors::TensorView> views;
  keep.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    keep.push_back(t.detach().to(torch::kCPU).contiguous());
    const auto& c = keep.back();
    safetensors::TensorView v;
    v.name = name;
    v.dtype = to_dtype(c, name);
    v.shape.assign(c.sizes().begin(), c.sizes().end());
    v.data = c.data_ptr();
    v.nbytes = c.nbytes();
    views.push_back(std::move(v));
  }
  return write_safetensors(path, views, metadata);
}

torch::Tensor read_tensor(const safetensors::File& file, const std::string& name) {
  const auto& info = file.info(name);
  auto t = torch::empty(info.shape, torch::TensorOptions().dtype(to_scalar_type(info.dtype, name)));
  if (info.nbytes > 0) std::memcpy(t.data_ptr(), file.data(name), info.nbytes);
  return t;
}

torch::Tensor mapped_tensor(const std::shared_ptr<const safetensors::File>& file, const std::string& name) {
  const auto& info = file->info(name);
  const auto type = to_scalar_type(info.dtype, name);
  // The deleter holds the mapping: the view stays valid however long the caller keeps it.
  auto* keep = new std::shared_ptr<const safetensors::File>(file);
  return torch::from_blob(
      const_cast<std::uint8_t*>(file->data(name)), info.shape, [keep](void*) { delete keep; },
      torch::TensorOptions().dtype(type));
}

std::map<std::string, torch::Tensor> read_tensors(const safetensors::File& file) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& name : file.names())
    out.emplace(name, read_tensor(file, name));
  return out;
}

}  // namespace accel::detail
