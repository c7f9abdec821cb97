// from_pretrained / save_pretrained: Hugging Face's checkpoint layout (config.json, model.safetensors or
// model.safetensors.index.json with its shards), read through memory-mapped safetensors files.
#include <c10/core/StorageImpl.h>
#include <malloc.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "accel/checkpoint/safetensors.hpp"
#include "accel/errors.hpp"
#include "accel/llm/models/causal_lm.hpp"
#include "accel/llm/models/empty_weights.hpp"
#include "accel/nn/quant4bit.hpp"
#include "config/small_file.hpp"
#include "llm/models/tensor_parallel_detail.hpp"

namespace accel::llm {
namespace {

namespace fs = std::filesystem;
namespace st = accel::safetensors;

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::optional<torch::ScalarType> torch_type(st::DType dtype) {
  switch (dtype) {
    case st::DType::F32:
      return torch::kFloat32;
    case st::DType::BF16:
      return torch::kBFloat16;
    case st::DType::F16:
      return torch::kFloat16;
    case st::DType::F64:
      return torch::kFloat64;
    default:
      return std::nullopt;
  }
}

// Where each tensor of a checkpoint lives: the mapped files and, per tensor name, the file holding it.
struct Checkpoint {
  std::vector<std::unique_ptr<st::File>> files;
  std::map<std::string, const st::File*> where;
  std::string description;  // "model.safetensors" or the index, for messages
};

Checkpoint open_sharded(const fs::path& index_path) {
  Checkpoint ckpt;
  ckpt.description = index_path.string();
  const auto text = config_detail::read_small_file(index_path.string(), 64u << 20);
  if (!text.error.empty()) throw CheckpointError("cannot read '" + index_path.string() + "': " + text.error);
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(text.text);
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError("'" + index_path.string() + "' is not valid JSON (" + e.what() + ")");
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw CheckpointError("'" + index_path.string() +
                          "' has no \"weight_map\" object mapping tensors to shards");
  std::map<std::string, const st::File*> by_file;
  for (const auto& item : index["weight_map"].items()) {
    if (!item.value().is_string())
      throw CheckpointError("'" + index_path.string() + "': weight_map[\"" + item.key() +
                            "\"] is not a file name");
    const std::string shard = item.value().get<std::string>();
    auto found = by_file.find(shard);
    if (found == by_file.end()) {
      const fs::path shard_path = index_path.parent_path() / shard;
      if (!fs::exists(shard_path))
        throw CheckpointError("shard '" + shard_path.string() + "' named in '" + index_path.string() +
                              "' (for tensor '" + item.key() +
                              "') does not exist; the checkpoint is incomplete");
      ckpt.files.push_back(std::make_unique<st::File>(st::File::map(shard_path.string())));
      found = by_file.emplace(shard, ckpt.files.back().get()).first;
    }
    if (!found->second->contains(item.key()))
      throw CheckpointError("'" + found->second->path() + "' has no tensor '" + item.key() + "', which '" +
                            index_path.string() + "' says it holds");
    ckpt.where[item.key()] = found->second;
  }
  return ckpt;
}

Checkpoint open_checkpoint(const fs::path& dir) {
  const fs::path single = dir / "model.safetensors";
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) return open_sharded(index);
  if (!fs::exists(single))
    throw CheckpointError("'" + dir.string() +
                          "' holds neither model.safetensors nor model.safetensors.index.json; "
                          "save the model with save_pretrained (safetensors) first");
  Checkpoint ckpt;
  ckpt.description = single.string();
  ckpt.files.push_back(std::make_unique<st::File>(st::File::map(single.string())));
  for (const auto& name : ckpt.files[0]->names())
    ckpt.where[name] = ckpt.files[0].get();
  return ckpt;
}

// Checkpoint tensors the model may lack: the tied head (written by some exporters) and old rotary buffers.
bool ignorable(const std::string& name, const ModelConfig& config) {
  if (name == "lm_head.weight" && config.tie_word_embeddings) return true;
  const std::string rotary = "rotary_emb.inv_freq";
  return name.size() >= rotary.size() &&
         name.compare(name.size() - rotary.size(), rotary.size(), rotary) == 0;
}

// Every parameter present with its shape and a floating dtype, and nothing else: checked before a byte moves.
void check_tensors(const Checkpoint& ckpt, const std::vector<std::pair<std::string, torch::Tensor>>& params,
                   const ModelConfig& config) {
  std::set<std::string> expected;
  for (const auto& [name, param] : params) {
    expected.insert(name);
    auto found = ckpt.where.find(name);
    if (found == ckpt.where.end())
      throw CheckpointError("checkpoint '" + ckpt.description + "' has no tensor '" + name + "', which the " +
                            config.architecture() +
                            " of config.json needs; the checkpoint belongs to another "
                            "model or is incomplete");
    const auto& info = found->second->info(name);
    if (info.shape != param.sizes().vec())
      throw CheckpointError("tensor '" + name + "' in '" + found->second->path() + "' has shape " +
                            shape_text(info.shape) + " but config.json makes it " +
                            shape_text(param.sizes().vec()) +
                            "; the checkpoint and its config.json do not match");
    if (!torch_type(info.dtype))
      throw CheckpointError("tensor '" + name + "' in '" + found->second->path() + "' has dtype " +
                            st::dtype_name(info.dtype) + "; model weights must be F32, BF16, F16 or F64");
  }
  for (const auto& [name, file] : ckpt.where) {
    if (expected.count(name) == 0 && !ignorable(name, config))
      throw CheckpointError("tensor '" + name + "' in '" + file->path() + "' is not a parameter of the " +
                            config.architecture() +
                            " that config.json describes; the checkpoint and its "
                            "config.json do not match");
  }
}

// The scalar type the loaded model gets.
torch::ScalarType resolve_dtype(const LoadOptions& options, const ModelConfig& config) {
  if (options.dtype_) {
    const auto t = *options.dtype_;
    if (t != torch::kFloat32 && t != torch::kBFloat16 && t != torch::kFloat16)
      throw UsageError("accel::llm::from_pretrained: dtype must be float32, bfloat16 or float16");
    return t;
  }
  if (config.dtype == "bfloat16") return torch::kBFloat16;
  if (config.dtype == "float16") return torch::kFloat16;
  return torch::kFloat32;
}

// Builds the model with its parameters created directly in `dtype` (no float32 copy of a bf16 model);
// `on_block` runs on each block as soon as it is built.
CausalLM build(const ModelConfig& config, torch::ScalarType dtype,
               const std::function<void(torch::nn::Module&)>& on_block = {}) {
  const auto previous = c10::get_default_dtype();
  c10::set_default_dtype(caffe2::TypeMeta::fromScalarType(dtype));
  try {
    CausalLM model(config, on_block);
    c10::set_default_dtype(previous);
    return model;
  } catch (...) {
    c10::set_default_dtype(previous);
    throw;
  }
}

// config.json, the checkpoint (opened and mapped, nothing read) and the dtype of a load.
struct Opened {
  ModelConfig config;
  Checkpoint ckpt;
  torch::ScalarType dtype;
};

Opened open_model_dir(const std::string& dir, const LoadOptions& options) {
  const fs::path root(dir);
  if (!fs::is_directory(root))
    throw CheckpointError("model directory '" + dir + "' does not exist or is not a directory");
  ModelConfig config = ModelConfig::from_file((root / "config.json").string());
  Checkpoint ckpt = open_checkpoint(root);
  const auto dtype = resolve_dtype(options, config);
  return Opened{std::move(config), std::move(ckpt), dtype};
}

}  // namespace

namespace detail {

bool is_empty_parameter(const torch::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return false;
  auto* storage = t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  return storage != nullptr && storage->_mutable_data_ptr_no_checks().get() == nullptr;
}

// Gives every parameter of `module` not emptied yet a storage of its size without memory (a null data
// pointer: the sharding engines' test for "fill me from load_model") on `device`, which throws on data
// access.
void empty_parameters(torch::nn::Module& module, torch::Device device) {
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    auto p = item.value();
    auto* storage = p.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
    if (storage->_mutable_data_ptr_no_checks().get() == nullptr) continue;  // emptied with its block
    if (p.device() != device) {
      // The same parameter (its impl, which the modules hold) on `device`; the memory goes again below.
      p.set_data(torch::empty(p.sizes(), p.options().device(device)));
      storage = p.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
    }
    storage->set_data_ptr_noswap(c10::DataPtr(nullptr, device));
    storage->set_nbytes(static_cast<std::size_t>(p.numel()) * p.element_size());
    storage->release_data_and_set_meta_custom_data_ptr_error_msg_(
        "accel::llm: parameter '" + item.key() +
        "' was built empty (from_pretrained_empty) and holds no memory yet: prepare the model with a "
        "backend that shards parameters (ZeRO stage 3, FSDP FULL_SHARD) and its optimizer, then fill it with "
        "accelerator.load_model(model, dir) (split by apply_tensor_parallel: "
        "accel::llm::load_pretrained_slices); "
        "elsewhere load it with from_pretrained");
  }
}

void read_checkpoint_parts(const std::string& dir, std::vector<CheckpointPart>& parts,
                           const ModelConfig& model_config) {
  const fs::path root(dir);
  if (!fs::is_directory(root))
    throw CheckpointError("model directory '" + dir + "' does not exist or is not a directory");
  const Checkpoint ckpt = open_checkpoint(root);
  std::vector<std::pair<std::string, torch::Tensor>>
      list;  // the full shapes, checked as from_pretrained does
  for (const auto& part : parts)
    list.emplace_back(part.name, torch::empty(part.full_shape, torch::TensorOptions().device(torch::kMeta)));
  check_tensors(ckpt, list, model_config);
  torch::NoGradGuard no_grad;
  for (auto& part : parts) {
    const st::File* file = ckpt.where.at(part.name);
    const auto& info = file->info(part.name);
    // The mapped bytes viewed in place; a part reads only its own rows / columns as it is copied.
    auto source = torch::from_blob(const_cast<std::uint8_t*>(file->data(part.name)), info.shape,
                                   torch::TensorOptions().dtype(*torch_type(info.dtype)));
    if (part.dim >= 0) source = source.narrow(part.dim, part.first, part.length);
    if (is_empty_parameter(part.into))
      part.into.set_data(torch::empty(part.into.sizes(), part.into.options()));
    part.into.copy_(source);
  }
}

}  // namespace detail

CausalLM from_pretrained_empty(const std::string& dir, const LoadOptions& options) {
  if (options.load_in_4bit_) {
    throw UsageError("accel::llm::from_pretrained_empty('" + dir +
                     "'): load_in_4bit is not available with empty weights: 4-bit weights are buffers that "
                     "ZeRO-3 / FULL_SHARD do not shard (nor does DeepSpeed); load a 4-bit model with "
                     "from_pretrained on one device");
  }
  const Opened opened = open_model_dir(dir, options);
  const torch::Device device = options.device_;
  // Each block emptied as soon as it is built: building never holds more than the embedding and one block.
  CausalLM model = build(opened.config, opened.dtype,
                         [&](torch::nn::Module& block) { detail::empty_parameters(block, device); });
  detail::empty_parameters(*model, device);
#ifdef __GLIBC__
  // The blocks' memory went back to the allocator, but glibc keeps freed heap pages resident (its mmap
  // threshold rises to the block tensors' size, and small allocations in between pin the heap): give them
  // back, or a rank would stay at more than half the model's size with nothing live (measured: 365 MB of a
  // 608 MB model before this call).
  malloc_trim(0);
#endif
  std::vector<std::pair<std::string, torch::Tensor>> list;
  for (const auto& item : model->named_parameters(/*recurse=*/true))
    list.emplace_back(item.key(), item.value());
  check_tensors(opened.ckpt, list, opened.config);
  return model;
}

CausalLM from_pretrained(const std::string& dir, const LoadOptions& options) {
  const fs::path root(dir);
  if (!fs::is_directory(root))
    throw CheckpointError("model directory '" + dir + "' does not exist or is not a directory");
  const ModelConfig config = ModelConfig::from_file((root / "config.json").string());
  const Checkpoint ckpt = open_checkpoint(root);
  const auto dtype = resolve_dtype(options, config);
  // load_in_4bit: each block's projections are quantised as soon as the block is built, and each of their
  // weights is read, quantised into its layer and freed, as transformers' load_in_4bit does: the
  // full-precision projections never exist together (the embedding, the norms and lm_head stay in dtype).
  std::function<void(torch::nn::Module&)> quantize_block;
  if (options.load_in_4bit_) {
    quantize_block = [&](torch::nn::Module& block) {
      quant::quantize_linears(block, *options.load_in_4bit_);
    };
  }
  CausalLM model = build(config, dtype, quantize_block);
  std::vector<std::pair<std::string, torch::Tensor>> list;
  for (const auto& item : model->named_parameters(/*recurse=*/true))
    list.emplace_back(item.key(), item.value());
  // A quantised projection's weight is no parameter: a shape-only stand-in lets check_tensors check it.
  std::map<std::string, quant::Linear4bitImpl*> quantized;
  for (const auto& item : model->named_modules()) {
    if (auto* q = dynamic_cast<quant::Linear4bitImpl*>(item.value().get())) {
      const std::string name = item.key() + ".weight";
      quantized[name] = q;
      list.emplace_back(name, torch::empty({q->out_features(), q->in_features()},
                                           torch::TensorOptions().dtype(dtype).device(torch::kMeta)));
    }
  }
  check_tensors(ckpt, list, config);
  torch::NoGradGuard no_grad;
  for (auto& [name, param] : list) {
    const st::File* file = ckpt.where.at(name);
    const auto& info = file->info(name);
    // The mapped bytes, viewed in place and converted as they are copied (one tensor's pages at a time).
    const auto source = torch::from_blob(const_cast<std::uint8_t*>(file->data(name)), info.shape,
                                         torch::TensorOptions().dtype(*torch_type(info.dtype)));
    if (const auto q = quantized.find(name); q != quantized.end()) {
      q->second->load_weight(source.to(dtype));  // as the weight loaded in dtype would be quantised
    } else {
      param.copy_(source);
    }
  }
#ifdef __GLIBC__
  // Building initialised every block's weights in dtype, projection-sized tensors freed once load_in_4bit
  // quantised them; glibc keeps such freed heap pages resident (its mmap threshold rises to their size). The
  // loaded values add no such temporaries: each is the mapped tensor (or one converted copy when its dtype
  // differs), quantised a slice at a time (quant::quantize_4bit). Give the pages back, as
  // from_pretrained_empty does: under QLoRA on Qwen2.5-0.5B's width with 2 layers a rank's RssAnon fell from
  // 0.88 to 0.75 GB here, of which the live model and runtime are ~0.75 (issue 51).
  malloc_trim(0);
#endif
  if (options.device_ != torch::kCPU) model->to(options.device_);
  return model;
}

void save_pretrained(const CausalLM& model, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw CheckpointError("cannot create '" + dir + "': " + ec.message());
  std::vector<torch::Tensor> keep;  // contiguous CPU copies, alive until written
  std::vector<st::TensorView> views;
  std::string dtype_name;
  for (const auto& item : model->named_parameters(/*recurse=*/true)) {
    auto t = item.value().detach().to(torch::kCPU).contiguous();
    st::DType dtype = st::DType::F32;
    if (t.scalar_type() == torch::kBFloat16) {
      dtype = st::DType::BF16;
      dtype_name = "bfloat16";
    } else if (t.scalar_type() == torch::kFloat16) {
      dtype = st::DType::F16;
      dtype_name = "float16";
    } else if (t.scalar_type() != torch::kFloat32) {
      throw UsageError("accel::llm::save_pretrained: parameter '" + item.key() + "' is " +
                       std::string(c10::toString(t.scalar_type())) +
                       "; save float32, bfloat16 or float16 models");
    } else if (dtype_name.empty()) {
      dtype_name = "float32";
    }
    keep.push_back(t);
    views.push_back({item.key(), dtype, t.sizes().vec(), t.data_ptr(), t.nbytes()});
  }
  st::write_file((fs::path(dir) / "model.safetensors").string(), views, {{"format", "pt"}});
  const std::string config_path = (fs::path(dir) / "config.json").string();
  std::ofstream out(config_path, std::ios::trunc);
  out << model->config().to_json(dtype_name);
  out.close();
  if (!out)
    throw CheckpointError("cannot write '" + config_path + "'; check free disk space and permissions");
}

}  // namespace accel::llm
