// LoRA adapters on unmodified LibTorch models: the adapters are children of the adapted Linear layers, and an
// ATen operator observer adds their term to the output of the operator that applies an adapted weight.
#include <accel/errors.hpp>
#include <accel/nn/lora.hpp>
#include <accel/nn/quant4bit.hpp>
#include <accel/parallel/tensor_parallel.hpp>

#include <ATen/record_function.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "checkpoint/tensor_io.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <shared_mutex>
#include <thread>

#include <unistd.h>

namespace accel::peft {

// One adapted Linear: its module (weakly: the model owns it), the adapters and the scale.
struct LoraModel::Layer {
  std::weak_ptr<torch::nn::Module> module;
  torch::nn::LinearImpl* linear = nullptr;  // a full-precision base (the observer adds the term)
  quant::Linear4bitImpl* base4 = nullptr;   // or a 4-bit base (QLoRA: its output_hook adds the term)
  // Or a tensor-parallel base (the observer adds the term, split as PEFT's LoraParallelLinear):
  tp::ColumnParallelLinearImpl* column = nullptr;  // B split by output rows as the weight, A whole
  tp::RowParallelLinearImpl* row = nullptr;        // A split by input columns as the weight, B whole
  torch::nn::Module* base() const {
    if (linear != nullptr) return linear;
    if (column != nullptr) return column;
    if (row != nullptr) return row;
    return base4;
  }
  // The full-precision weight the observer watches and merge changes (undefined for a 4-bit base).
  torch::Tensor& weight() const {
    static torch::Tensor none;
    if (linear != nullptr) return linear->weight;
    if (column != nullptr) return column->weight;
    if (row != nullptr) return row->weight;
    return none;
  }
  torch::Tensor& bias() const {
    if (linear != nullptr) return linear->bias;
    if (column != nullptr) return column->bias;
    if (row != nullptr) return row->bias;
    return base4->bias;
  }
  // The tensor-parallel group of a split base; null otherwise.
  std::shared_ptr<Communicator> tp_comm() const {
    if (column != nullptr) return column->communicator();
    if (row != nullptr) return row->communicator();
    return nullptr;
  }
  std::string path;
  torch::nn::Linear lora_A{nullptr};
  torch::nn::Linear lora_B{nullptr};
  double scale = 1;
  double dropout = 0;
  std::atomic<bool> merged{false};
};

namespace {

namespace fs = std::filesystem;
using Layer = LoraModel::Layer;
using Json = nlohmann::json;

thread_local bool tl_inside = false;  // our own operators
thread_local int tl_active = 0;       // inside an operator we adapt: its inner operators are not ours

// The adapted layers of every live model, held strongly: the adapters belong to the model, so they keep
// applying when the handle get_peft_model returned is dropped (its own comment promises it), until the
// layer's module is gone (purged at the next add / remove) or merge_and_unload removes them.
struct Registry {
  std::shared_mutex mu;
  std::vector<std::shared_ptr<Layer>> layers;
  at::CallbackHandle handle = 0;
  bool started = false;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: callbacks may run during static destruction
  return *r;
}

const c10::StorageImpl* storage_of(const c10::IValue& v) {
  if (!v.isTensor()) return nullptr;
  const auto& t = v.toTensor();
  if (!t.defined() || !t.has_storage()) return nullptr;
  return t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
}

struct Pending final : at::ObserverContext {
  torch::Tensor x;
  std::shared_ptr<Layer> layer;
};

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (tl_inside || tl_active > 0) return nullptr;
  const std::string_view name = fn.name();
  // Where the input and the weight are: aten::linear(x, W, b); F::linear's aten::addmm(b, x, W.t()) and
  // aten::matmul(x, W.t()).
  std::size_t x_at = 0, w_at = 1;
  bool transposed = true;
  if (name == "aten::linear") {
    transposed = false;
  } else if (name == "aten::addmm") {
    x_at = 1;
    w_at = 2;
  } else if (name != "aten::matmul") {
    return nullptr;
  }
  const auto inputs = fn.inputs();
  if (inputs.size() <= w_at) return nullptr;
  const auto* storage = storage_of(inputs[w_at]);
  if (storage == nullptr) return nullptr;
  std::shared_ptr<Layer> match;
  {
    auto& r = registry();
    std::shared_lock lock(r.mu);
    for (const auto& layer : r.layers) {
      if (layer->module.expired() || layer->merged.load() || layer->base4 != nullptr) continue;
      const auto& w = layer->weight();
      if (!w.defined() || !w.has_storage() ||
          w.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl() != storage)
        continue;
      const auto& arg = inputs[w_at].toTensor();
      if (arg.dim() != 2) continue;
      const bool shape_ok = transposed ? (arg.size(0) == w.size(1) && arg.size(1) == w.size(0))
                                       : (arg.size(0) == w.size(0) && arg.size(1) == w.size(1));
      if (!shape_ok) continue;
      match = std::move(layer);
      break;
    }
  }
  if (!match || !inputs[x_at].isTensor()) return nullptr;
  auto pending = std::make_unique<Pending>();
  pending->x = inputs[x_at].toTensor();
  pending->layer = std::move(match);
  ++tl_active;
  return pending;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (ctx == nullptr) return;
  --tl_active;
  auto* pending = static_cast<Pending*>(ctx);
  const auto outputs = fn.outputs();
  Layer& l = *pending->layer;
  tl_inside = true;
  try {
    if (outputs.empty() || !outputs[0].isTensor())
      throw std::runtime_error("the operator returned no tensor");
    auto y = outputs[0].toTensor();
    // PEFT's Linear.forward: x cast to the adapters' dtype (_cast_input_dtype), `result + B A x * scaling` in
    // the wider dtype, then `.to(result's dtype)`: float32 adapters on a bf16 base round once, in the add.
    auto x = pending->x.to(l.lora_A->weight.scalar_type());
    if (l.dropout > 0 && l.base()->is_training()) x = torch::dropout(x, l.dropout, /*train=*/true);
    torch::Tensor delta;
    if (l.column != nullptr) {
      // x is the layer's input after Megatron's f, y this rank's rows of the output: B's rows are this
      // rank's, A is whole, and its gradient (this rank's part) is summed over the group by f on A (PEFT's
      // LoraParallelLinear: lora_B a ColumnParallelLinear). x's gradient stays partial, as the base's is, for
      // the layer's f to sum.
      namespace F = torch::nn::functional;
      delta = F::linear(F::linear(x, tp::copy_to_tensor_parallel(l.lora_A->weight, l.column->communicator())),
                        l.lora_B->weight);
    } else if (l.row != nullptr) {
      // x is this rank's columns of the input, y this rank's partial product before the sum over the group:
      // A's columns are this rank's, B is whole and its gradient (this rank's part) is summed by f on B
      // (PEFT: lora_A a RowParallelLinear). The group's sum then adds B A x once.
      namespace F = torch::nn::functional;
      delta = F::linear(F::linear(x, l.lora_A->weight),
                        tp::copy_to_tensor_parallel(l.lora_B->weight, l.row->communicator()));
    } else {
      delta = l.lora_B(l.lora_A(x));
    }
    // The in-place add computes in the two dtypes' promotion and rounds once into y's dtype: PEFT's
    // `(result + term).to(result.dtype)` (a float32 term on a bf16 output: one rounding, not two).
    y.add_(delta * l.scale);
  } catch (const std::exception& e) {
    // An exception here would be swallowed by ATen and the layer would silently lack its adapter: stop.
    std::cerr << "accelerate-cpp LoRA: could not apply the adapter of '" << l.path << "': " << e.what()
              << std::endl;
    std::abort();
  }
  tl_inside = false;
}

void add_layers(const std::vector<std::shared_ptr<Layer>>& layers) {
  auto& r = registry();
  std::unique_lock lock(r.mu);
  r.layers.erase(std::remove_if(r.layers.begin(), r.layers.end(),
                                [](const std::shared_ptr<Layer>& l) { return l->module.expired(); }),
                 r.layers.end());
  for (const auto& l : layers)
    r.layers.push_back(l);
  if (!r.started) {
    r.handle = at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                         .needsInputs(true)
                                         .needsOutputs(true)
                                         .scopes({at::RecordScope::FUNCTION}));
    r.started = true;
  }
}

void remove_layers(const std::vector<std::shared_ptr<Layer>>& layers) {
  auto& r = registry();
  std::unique_lock lock(r.mu);
  r.layers.erase(std::remove_if(r.layers.begin(), r.layers.end(),
                                [&](const std::shared_ptr<Layer>& l) {
                                  return l->module.expired() ||
                                         std::find(layers.begin(), layers.end(), l) != layers.end();
                                }),
                 r.layers.end());
  if (r.layers.empty() && r.started) {
    at::removeCallback(r.handle);
    r.started = false;
  }
}

bool name_matches(const std::string& path, const std::string& name) {
  return path == name ||
         (path.size() > name.size() && path.compare(path.size() - name.size(), name.size(), name) == 0 &&
          path[path.size() - name.size() - 1] == '.');
}

std::string with_commas(std::int64_t n) {
  std::string s = std::to_string(n), out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

const std::string kPrefix = "base_model.model.";

}  // namespace

LoraModel::LoraModel(std::shared_ptr<torch::nn::Module> model, LoraConfig config,
                     std::vector<std::shared_ptr<Layer>> layers, bool tied_saved)
    : model_(std::move(model)),
      config_(std::move(config)),
      layers_(std::move(layers)),
      tied_saved_(tied_saved) {}

LoraModel::~LoraModel() = default;

std::vector<std::string> LoraModel::adapted_modules() const {
  std::vector<std::string> out;
  for (const auto& l : layers_)
    out.push_back(l->path);
  return out;
}

std::pair<std::int64_t, std::int64_t> LoraModel::trainable_parameters() const {
  std::int64_t trainable = 0, all = 0;
  for (const auto& p : model_->parameters()) {
    all += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  // A 4-bit base weight is buffers here; PEFT counts its elements (Params4bit x 2), and so do we.
  for (const auto& m : model_->modules(/*include_self=*/true))
    if (const auto* q = dynamic_cast<const quant::Linear4bitImpl*>(m.get()))
      all += q->in_features() * q->out_features();
  return {trainable, all};
}

std::string LoraModel::print_trainable_parameters() const {
  const auto [trainable, all] = trainable_parameters();
  const std::string line = fmt::format(
      "trainable params: {} || all params: {} || trainable%: {:.4f}", with_commas(trainable),
      with_commas(all), all > 0 ? 100.0 * static_cast<double>(trainable) / static_cast<double>(all) : 0.0);
  std::cout << line << std::endl;
  return line;
}

namespace {
// PEFT's Linear.get_delta_weight (peft/tuners/lora/layer.py): (B @ A) * scaling in the adapters' dtype, but
// bf16 / fp16 adapters on the CPU multiplied in float32 ("some CPUs have slow bf16/fp16 matmuls") and the
// delta rounded to their dtype.
torch::Tensor delta_weight(torch::Tensor a, torch::Tensor b, double scale) {
  const auto dtype = b.scalar_type();
  const bool cast = b.device().is_cpu() && (dtype == torch::kBFloat16 || dtype == torch::kFloat16);
  if (cast) {
    a = a.to(torch::kFloat32);
    b = b.to(torch::kFloat32);
  }
  auto delta = torch::matmul(b, a) * scale;
  return cast ? delta.to(dtype) : delta;
}

// PEFT's merge (safe_merge false: `base_layer.weight.data += delta_weight`): the sum in W's dtype, computed
// in the wider of the two (one rounding of W + delta); merge() and merged_state() both merge through here.
void add_delta(torch::Tensor& w, const torch::Tensor& a, const torch::Tensor& b, double scale) {
  w.add_(delta_weight(a.detach(), b.detach(), scale));
}

// PEFT's merge into a bitsandbytes 4-bit base: dequantise, add (or subtract) the adapters' product, quantise
// again, with PEFT's warning that the rounding changes the outputs.
void merge_4bit(Layer& l, double sign, const char* what) {
  auto w = l.base4->dequantized_weight(torch::kFloat32).cpu();
  w.add_(torch::matmul(l.lora_B->weight, l.lora_A->weight).cpu().to(torch::kFloat32) * (sign * l.scale));
  l.base4->requantize(w);
  std::cerr
      << fmt::format(
             "accelerate-cpp LoRA: {}: '{}' is a 4-bit Linear4bit (QLoRA): its weight was dequantised, "
             "the adapters' product {} and the result quantised to 4 bits again, so its outputs differ "
             "from the adapted layer's by that rounding (as in PEFT); for exact merged weights, load the "
             "full-precision model, load_adapter onto it and merge there",
             what, l.path, sign > 0 ? "added" : "subtracted")
      << std::endl;
}
}  // namespace

void LoraModel::merge() {
  torch::NoGradGuard no_grad;
  for (auto& l : layers_) {
    if (l->merged.load()) continue;
    if (l->base4 != nullptr) {
      merge_4bit(*l, 1.0, "merge");
      l->merged = true;
      continue;
    }
    // Split bases: B's rows (column) or A's columns (row) are this rank's, as the weight's.
    add_delta(l->weight(), l->lora_A->weight, l->lora_B->weight, l->scale);
    l->merged = true;
  }
}

void LoraModel::unmerge() {
  torch::NoGradGuard no_grad;
  for (auto& l : layers_) {
    if (!l->merged.load()) continue;
    if (l->base4 != nullptr) {
      merge_4bit(*l, -1.0, "unmerge");
      l->merged = false;
      continue;
    }
    // PEFT's unmerge: `weight.data -= delta_weight.to(orig_dtype)`.
    auto& w = l->weight();
    w.sub_(
        delta_weight(l->lora_A->weight.detach(), l->lora_B->weight.detach(), l->scale).to(w.scalar_type()));
    l->merged = false;
  }
}

void LoraModel::merge_and_unload() {
  merge();
  remove_layers(layers_);
  for (auto& l : layers_) {
    l->base()->unregister_module("lora_A");
    l->base()->unregister_module("lora_B");
    if (l->base4 != nullptr) l->base4->output_hook = nullptr;
  }
  layers_.clear();
}

std::vector<std::pair<std::string, torch::Tensor>> LoraModel::merged_state(
    std::vector<std::pair<std::string, torch::Tensor>> state) const {
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < state.size(); ++i)
    index.emplace(state[i].first, i);
  std::set<std::size_t> dropped;
  torch::NoGradGuard no_grad;
  for (const auto& l : layers_) {
    const auto w = index.find(l->path + ".weight"), a = index.find(l->path + ".lora_A.weight"),
               b = index.find(l->path + ".lora_B.weight");
    if (w == index.end() || a == index.end() || b == index.end() || l->base4 != nullptr)
      throw UsageError(fmt::format(
          "merged_state: the state lacks '{}.weight' or its adapters{}: pass the adapted model's whole state "
          "(accelerator.get_state_dict(model)); a 4-bit base merges unsharded "
          "(accel::llm::merge_and_dequantize), or merge the saved adapter files with PEFT",
          l->path, l->base4 != nullptr ? " (a 4-bit Linear4bit base has no float weight)" : ""));
    auto& weight = state[w->second].second;
    const auto& A = state[a->second].second;
    const auto& B = state[b->second].second;
    if (weight.dim() != 2 || A.dim() != 2 || B.dim() != 2 || B.size(0) != weight.size(0) ||
        A.size(1) != weight.size(1) || B.size(1) != A.size(0))
      throw UsageError(fmt::format(
          "merged_state: '{}': weight {}, lora_A {}, lora_B {} are not one whole layer's (pass the whole "
          "state, as accelerator.get_state_dict(model) gathers it)",
          l->path, fmt::join(weight.sizes().vec(), "x"), fmt::join(A.sizes().vec(), "x"),
          fmt::join(B.sizes().vec(), "x")));
    // A copy merged by merge()'s arithmetic; the entry then holds it (the caller's tensor is not changed,
    // and a state moved in frees each original as its copy replaces it: one extra weight at a time).
    auto merged = weight.detach().clone();
    add_delta(merged, A, B, l->scale);
    weight = std::move(merged);
    dropped.insert(a->second);
    dropped.insert(b->second);
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  out.reserve(state.size() - dropped.size());
  for (std::size_t i = 0; i < state.size(); ++i)
    if (dropped.count(i) == 0) out.push_back(std::move(state[i]));
  return out;
}

namespace {

// PEFT's adapter_config.json for `config` (peft's LoraConfig fields as PEFT writes them).
Json adapter_config_json(const LoraConfig& config_, const Json& modules_to_save) {
  Json targets = Json::array();
  for (const auto& t : config_.target_modules)
    targets.push_back(t);
  return {
      {"peft_type", "LORA"},
      {"task_type", config_.task_type.empty() ? Json(nullptr) : Json(config_.task_type)},
      {"base_model_name_or_path", nullptr},
      {"revision", nullptr},
      {"inference_mode", true},
      {"r", config_.r},
      {"lora_alpha", config_.lora_alpha},
      {"lora_dropout", config_.lora_dropout},
      {"target_modules", config_.target_modules_regex.empty() ? targets : Json(config_.target_modules_regex)},
      {"bias", config_.bias},
      {"fan_in_fan_out", false},
      {"init_lora_weights", true},
      {"modules_to_save", modules_to_save},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", Json::object()},
      {"alpha_pattern", Json::object()},
      {"use_rslora", config_.use_rslora},
      {"use_dora", false},
      {"ensure_weight_tying", config_.ensure_weight_tying}};
}

// Writes the adapter's two files into `dir`. Safe when every rank of a job calls it at once with the same
// adapter (README's snippet does; so does a loop without a main-process guard): each process writes under
// temporary names of its own (process and thread) and renames them into place, so the files are always one
// writer's complete output, never a mix, and no process removes another's temporary file. Filesystem failures
// become CheckpointError naming the file.
void write_adapter_files(const std::string& dir,
                         const std::vector<std::pair<std::string, torch::Tensor>>& out, const Json& config) {
  const fs::path tensors = fs::path(dir) / "adapter_model.safetensors";
  const fs::path json = fs::path(dir) / "adapter_config.json";
  const std::string tag =
      fmt::format(".tmp.{}.{}", ::getpid(), std::hash<std::thread::id>()(std::this_thread::get_id()));
  const std::string tensors_tmp = tensors.string() + tag;
  const std::string json_tmp = json.string() + tag;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    throw CheckpointError(
        fmt::format("save_adapter: could not create the directory '{}': {}; choose a "
                    "writable directory",
                    dir, ec.message()));
  }
  try {
    detail::write_tensors(tensors_tmp, out, {{"format", "pt"}});
    {
      std::ofstream f(json_tmp, std::ios::binary | std::ios::trunc);
      f << config.dump(2) << "\n";
      f.close();
      if (!f) throw CheckpointError(fmt::format("save_adapter: could not write '{}'", json_tmp));
    }
    for (const auto& [from, to] :
         {std::pair{tensors_tmp, tensors.string()}, std::pair{json_tmp, json.string()}}) {
      fs::rename(from, to, ec);
      if (ec) {
        throw CheckpointError(
            fmt::format("save_adapter: could not move '{}' to '{}': {}", from, to, ec.message()));
      }
    }
  } catch (...) {
    fs::remove(tensors_tmp, ec);
    fs::remove(json_tmp, ec);
    throw;
  }
}

// The (head, embedding) paths of a model whose head stays tied to an embedding named in modules_to_save
// (ensure_weight_tying); empty strings otherwise (untied by get_peft_model, or nothing tied or saved).
std::pair<std::string, std::string> tied_saved_embedding(torch::nn::Module& model, const LoraConfig& config) {
  const auto* tied = dynamic_cast<const TiedEmbeddings*>(&model);
  if (tied == nullptr || !config.ensure_weight_tying) return {};
  auto paths = tied->tied_embeddings();
  if (paths.second.empty() ||
      std::none_of(config.modules_to_save.begin(), config.modules_to_save.end(),
                   [&](const std::string& n) { return name_matches(paths.second, n); }))
    return {};
  return paths;
}

}  // namespace

void LoraModel::save_adapter(const std::string& dir,
                             const std::vector<std::pair<std::string, torch::Tensor>>& state) const {
  std::map<std::string, torch::Tensor> given(state.begin(), state.end());
  const auto own = model_->named_parameters();
  const auto split = tp::split_parameters(*model_);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::set<std::string> taken;
  auto take = [&](const std::string& name) {
    if (!taken.insert(name).second) return;  // a bias both trained ("all") and in a module to save
    torch::Tensor t;
    if (!state.empty()) {
      const auto it = given.find(name);
      if (it == given.end())
        throw UsageError(
            fmt::format("save_adapter: the state passed has no '{}' (pass "
                        "accelerator.get_state_dict(model) of the adapted model)",
                        name));
      t = it->second;
    } else {
      t = own[name];
    }
    const auto& mine = own[name];
    auto whole = mine.sizes().vec();
    if (const auto s = split.find(name); s != split.end() && s->second.comm->world_size() > 1) {
      if (state.empty()) {
        throw UsageError(fmt::format(
            "save_adapter: '{}' is split over the tensor-parallel group (this rank holds {} of its "
            "{} entries along dimension {}); pass accelerator.get_state_dict(model) as the state, "
            "which holds it whole",
            name, s->second.length, s->second.full, s->second.dim));
      }
      whole[static_cast<std::size_t>(s->second.dim)] = s->second.full;
    }
    if (!t.defined() || t.sizes() != torch::IntArrayRef(whole) ||
        (t.numel() > 0 && t.data_ptr() == nullptr)) {
      throw UsageError(fmt::format(
          "save_adapter: '{}' is not whole here (shape {}, the whole adapter's is {}: the model is "
          "prepared on a backend that shards it, or the state passed is not this model's); pass "
          "accelerator.get_state_dict(model) of this adapted model as the state",
          name, t.defined() ? fmt::format("{}", fmt::join(t.sizes().vec(), "x")) : "undefined",
          fmt::join(whole, "x")));
    }
    out.emplace_back(kPrefix + name, t.detach().cpu().contiguous());
  };
  for (const auto& l : layers_) {
    if (l->merged.load())
      throw UsageError("save_adapter: the adapters are merged into the weights; unmerge() first");
    take(l->path + ".lora_A.weight");
    take(l->path + ".lora_B.weight");
  }
  if (config_.bias == "all") {
    for (const auto& p : own)
      if (p.key() == "bias" || (p.key().size() > 5 && p.key().substr(p.key().size() - 5) == ".bias"))
        take(p.key());
  } else if (config_.bias == "lora_only") {
    for (const auto& l : layers_)
      if (l->bias().defined()) take(l->path + ".bias");
  }
  // modules_to_save: trained in full; PEFT's files hold them under their own names
  // ("base_model.model.head.weight"), which PeftModel.from_pretrained loads into its trained copy.
  Json to_save = nullptr;
  if (!config_.modules_to_save.empty()) {
    to_save = Json::array();
    for (const auto& n : config_.modules_to_save)
      to_save.push_back(n);
    for (const auto& item : model_->named_modules("", false)) {
      if (std::none_of(config_.modules_to_save.begin(), config_.modules_to_save.end(),
                       [&](const std::string& n) { return name_matches(item.key(), n); }))
        continue;
      if (!item.value()->named_buffers().is_empty()) {
        throw UnsupportedOperation(fmt::format(
            "save_adapter: module to save '{}' has buffers (e.g. BatchNorm statistics), which accelerate-cpp "
            "does not write to adapter files yet; save the whole model with Accelerator::save_model instead",
            item.key()));
      }
      for (const auto& p : item.value()->named_parameters())
        take(item.key() + "." + p.key());
    }
  }
  // ensure_weight_tying: the head tied to the trained embedding; PEFT's file holds it under the head's name
  // too (its ModulesToSaveWrapper of the head), the same values.
  if (const auto [head, embedding] = tied_saved_embedding(*model_, config_); !head.empty()) {
    const std::string from = kPrefix + embedding + ".weight";
    const auto it = std::find_if(out.begin(), out.end(), [&](const auto& e) { return e.first == from; });
    if (it != out.end()) out.emplace_back(kPrefix + head + ".weight", it->second);
  }
  write_adapter_files(dir, out, adapter_config_json(config_, to_save));
}

void LoraModel::load_adapter(const std::string& dir) {
  const std::string json_path = (fs::path(dir) / "adapter_config.json").string();
  std::ifstream in(json_path, std::ios::binary);
  if (!in) throw CheckpointError(fmt::format("load_adapter: cannot open '{}'", json_path));
  Json config;
  try {
    config = Json::parse(in);
  } catch (const Json::exception& e) {
    throw CheckpointError(fmt::format("load_adapter: '{}' is not valid JSON: {}", json_path, e.what()));
  }
  auto number = [&](const char* key) -> double {
    if (!config.contains(key) || !config.at(key).is_number())
      throw CheckpointError(fmt::format("load_adapter: '{}' has no number '{}'", json_path, key));
    return config.at(key).get<double>();
  };
  if (config.value("peft_type", std::string()) != "LORA")
    throw CheckpointError(fmt::format("load_adapter: '{}' is not a LoRA adapter (peft_type)", json_path));
  if (number("r") != config_.r || number("lora_alpha") != config_.lora_alpha) {
    throw CheckpointError(
        fmt::format("load_adapter: '{}' has r {} and lora_alpha {}, this model's LoraConfig r {} "
                    "and lora_alpha {}; adapt the model with the adapter's values",
                    json_path, number("r"), number("lora_alpha"), config_.r, config_.lora_alpha));
  }
  // A tied embedding among the modules to save trains differently with and without ensure_weight_tying (the
  // head tied to it, or frozen apart): where get_peft_model found the embeddings tied with one of them to
  // save, the file's value (absent: PEFT's default, false) must be this model's. On an untied model the key
  // changes nothing (PEFT warns that nothing is tied and loads the adapter).
  const bool file_ties =
      config.contains("ensure_weight_tying") && config.at("ensure_weight_tying").is_boolean()
          ? config.at("ensure_weight_tying").get<bool>()
          : false;
  if (tied_saved_ && file_ties != config_.ensure_weight_tying) {
    throw CheckpointError(fmt::format(
        "load_adapter: '{}' has ensure_weight_tying {}, this model's LoraConfig {} (with "
        "modules_to_save [{}]); adapt the model with the adapter's value (TRL model config key "
        "ensure_weight_tying, PEFT's LoraConfig name)",
        json_path, file_ties, config_.ensure_weight_tying, fmt::join(config_.modules_to_save, ", ")));
  }
  const auto [tied_head, tied_embedding] = tied_saved_embedding(*model_, config_);
  const std::string path = (fs::path(dir) / "adapter_model.safetensors").string();
  const auto tensors = detail::read_tensors(safetensors::File::open(path));
  auto params = model_->named_parameters();
  const auto split = tp::split_parameters(*model_);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;
  for (const auto& [key, t] : tensors) {
    if (key.rfind(kPrefix, 0) != 0)
      throw CheckpointError(
          fmt::format("load_adapter: '{}' holds '{}', not a PEFT key (base_model.model.<path>)", path, key));
    std::string name = key.substr(kPrefix.size());
    // PEFT in memory names the adapter ("lora_A.default.weight"); its files do not. Accept both.
    for (const char* part : {".lora_A.default.", ".lora_B.default."}) {
      const auto at = name.find(part);
      if (at != std::string::npos)
        name = name.substr(0, at) + std::string(part).substr(0, 7) + "." + name.substr(at + 16);
    }
    // ensure_weight_tying: PEFT's file holds the tied head's copy too, the embedding's values.
    if (!tied_head.empty() && name == tied_head + ".weight") name = tied_embedding + ".weight";
    auto* p = params.find(name);
    if (p == nullptr)
      throw CheckpointError(fmt::format(
          "load_adapter: '{}' holds '{}', which this adapted model has no parameter for", path, key));
    // A tensor-parallel layer's split adapter: the file holds it whole, this rank takes its slice.
    auto whole = p->sizes().vec();
    torch::Tensor src = t;
    const auto s = split.find(name);
    if (s != split.end()) whole[static_cast<std::size_t>(s->second.dim)] = s->second.full;
    if (torch::IntArrayRef(whole) != t.sizes())
      throw CheckpointError(fmt::format("load_adapter: '{}' in '{}' has shape {}, the model's is {}", key,
                                        path, fmt::join(t.sizes().vec(), "x"), fmt::join(whole, "x")));
    if (s != split.end()) src = t.narrow(s->second.dim, s->second.first, s->second.length);
    copies.emplace_back(*p, src);
  }
  for (const auto& l : layers_) {
    for (const std::string suffix : {".lora_A.weight", ".lora_B.weight"}) {
      if (tensors.count(kPrefix + l->path + suffix) == 0)
        throw CheckpointError(
            fmt::format("load_adapter: '{}' has no '{}'", path, kPrefix + l->path + suffix));
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& [dst, src] : copies)
    dst.copy_(src);
}

namespace {

bool is_lora_linear(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::LinearImpl*>(&m) != nullptr ||
         dynamic_cast<const quant::Linear4bitImpl*>(&m) != nullptr ||
         dynamic_cast<const tp::ColumnParallelLinearImpl*>(&m) != nullptr ||
         dynamic_cast<const tp::RowParallelLinearImpl*>(&m) != nullptr;
}

bool is_all_linear(const LoraConfig& c) {
  auto lower = [](std::string s) {
    for (auto& ch : s)
      ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return s;
  };
  return (c.target_modules.size() == 1 && lower(c.target_modules.front()) == "all-linear") ||
         lower(c.target_modules_regex) == "all-linear";
}

// PEFT's _maybe_include_all_linear_layers (peft/tuners/tuners_utils.py): every Linear's path, less the output
// head (a PreTrainedModel's get_output_embeddings(); here `output_head` when the model has such a module),
// or, without one under task_type SEQ_CLS, the first of SEQ_CLS_HEAD_NAMES among the model's attributes, and
// less the modules inside LoRA layers already there.
std::vector<std::string> all_linear_targets(torch::nn::Module& model, const LoraConfig& c) {
  std::set<std::string> exclude;
  const auto modules = model.named_modules("", /*include_self=*/false);
  if (!c.output_head.empty() && modules.contains(c.output_head)) {
    exclude.insert(c.output_head);
  } else if (c.task_type == "SEQ_CLS") {
    const auto children = model.named_children();
    for (const char* head : {"score", "classifier"}) {
      if (!children.contains(head)) continue;
      exclude.insert(head);
      break;
    }
  }
  std::vector<std::string> out;
  for (const auto& item : modules) {
    const std::string& path = item.key();
    if (!is_lora_linear(*item.value()) || exclude.count(path) > 0) continue;
    if (path.find(".lora_A") != std::string::npos || path.find(".lora_B") != std::string::npos) continue;
    out.push_back(path);
  }
  return out;
}

// PEFT's _check_tied_modules: a tied input embedding named in modules_to_save. Without ensure_weight_tying
// PEFT trains a copy for the lookup and leaves the head the original, frozen weight: here the head gets the
// copy (untie_word_embeddings; frozen below) and the embedding's own weight trains, the same values. With it,
// the head stays tied to the trained weight and, as PEFT's _add_modules_to_save_to_tie, modules_to_save
// also lists the embedding by its full path.
// The tied head named in modules_to_save (PEFT's EMBEDDING_LAYER_NAMES hold lm_head too) is the same case:
// without ensure_weight_tying the head trains a copy and the embedding keeps the original, frozen; with it,
// PEFT takes the head's name out of modules_to_save and ties the head to the trained embedding.
// Returns whether the model's embeddings were tied with one of them in modules_to_save.
bool untie_saved_embedding(torch::nn::Module& model, LoraConfig& config) {
  auto* tied = dynamic_cast<TiedEmbeddings*>(&model);
  if (tied == nullptr) return false;
  const auto [head, embedding] = tied->tied_embeddings();
  auto& names = config.modules_to_save;
  const auto named = [&](const std::string& path) {
    return !path.empty() && std::any_of(names.begin(), names.end(),
                                        [&](const std::string& n) { return name_matches(path, n); });
  };
  if (!named(embedding) && !named(head)) return false;
  if (!config.ensure_weight_tying) {
    tied->untie_word_embeddings();
    return true;
  }
  const auto head_entry =
      std::find_if(names.begin(), names.end(), [&](const std::string& n) { return name_matches(head, n); });
  if (head_entry != names.end()) names.erase(head_entry);
  if (std::find(names.begin(), names.end(), embedding) == names.end()) names.push_back(embedding);
  return true;
}

}  // namespace

std::shared_ptr<LoraModel> get_peft_model(const std::shared_ptr<torch::nn::Module>& model,
                                          const LoraConfig& requested) {
  if (!model) throw UsageError("get_peft_model: the model is empty");
  LoraConfig config = requested;
  if (is_all_linear(requested)) {
    config.target_modules = all_linear_targets(*model, requested);
    config.target_modules_regex.clear();
    if (config.target_modules.empty())
      throw UsageError(
          "get_peft_model: target_modules all-linear, but the model has no Linear layer besides "
          "its output head '" +
          requested.output_head + "'");
  }
  if (config.r < 1) throw UsageError(fmt::format("LoraConfig: r must be at least 1, got {}", config.r));
  if (!(config.lora_alpha > 0))
    throw UsageError(fmt::format("LoraConfig: lora_alpha must be positive, got {}", config.lora_alpha));
  if (config.lora_dropout < 0 || config.lora_dropout >= 1)
    throw UsageError(fmt::format("LoraConfig: lora_dropout must be in [0, 1), got {}", config.lora_dropout));
  if (config.bias != "none" && config.bias != "all" && config.bias != "lora_only")
    throw UsageError(fmt::format("LoraConfig: bias must be none, all or lora_only, got '{}'", config.bias));
  if (config.target_modules.empty() == config.target_modules_regex.empty())
    throw UsageError("LoraConfig: give target_modules (names) or target_modules_regex, one of them");
  std::optional<std::regex> pattern;
  if (!config.target_modules_regex.empty()) {
    try {
      pattern.emplace(config.target_modules_regex);
    } catch (const std::regex_error& e) {
      throw UsageError(fmt::format("LoraConfig: target_modules_regex '{}' is not a regular expression: {}",
                                   config.target_modules_regex, e.what()));
    }
  }
  auto targeted = [&](const std::string& path) {
    if (pattern) return std::regex_match(path, *pattern);
    for (const auto& n : config.target_modules)
      if (name_matches(path, n)) return true;
    return false;
  };
  std::vector<std::shared_ptr<Layer>> layers;
  std::vector<std::string> linears;
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    const std::string& path = item.key();
    auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get());
    auto* base4 = dynamic_cast<quant::Linear4bitImpl*>(item.value().get());
    auto* column = dynamic_cast<tp::ColumnParallelLinearImpl*>(item.value().get());
    auto* row = dynamic_cast<tp::RowParallelLinearImpl*>(item.value().get());
    if (linear != nullptr || base4 != nullptr || column != nullptr || row != nullptr) linears.push_back(path);
    if (path.find(".lora_A") != std::string::npos || path.find(".lora_B") != std::string::npos) continue;
    if (!targeted(path)) continue;
    if (linear == nullptr && base4 == nullptr && column == nullptr && row == nullptr) {
      throw UsageError(
          fmt::format("get_peft_model: target '{}' is a {}, not a torch::nn::Linear; LoRA adapts "
                      "Linear layers only (their 4-bit accel::quant::Linear4bit form, and the "
                      "tensor-parallel accel::tp::ColumnParallelLinear / RowParallelLinear)",
                      path, item.value()->name()));
    }
    if (item.value()->named_children().contains("lora_A"))
      throw UsageError(fmt::format("get_peft_model: '{}' already has LoRA adapters", path));
    auto layer = std::make_shared<Layer>();
    layer->module = item.value();
    layer->linear = linear;
    layer->base4 = base4;
    layer->column = column;
    layer->row = row;
    layer->path = path;
    // The adapters' shape, device and type: the base weight's (a 4-bit base: its compute-side fp32). A is
    // drawn whole (Kaiming-uniform over the full layer's inputs) on every rank, as one process draws it.
    std::int64_t in = 0, out = 0;
    if (base4 != nullptr) {
      in = base4->in_features();
      out = base4->out_features();
    } else if (column != nullptr) {
      in = column->options.in_features();
      out = column->options.out_features();
    } else if (row != nullptr) {
      in = row->options.in_features();
      out = row->options.out_features();
    } else {
      in = linear->weight.size(1);
      out = linear->weight.size(0);
    }
    const auto device = base4 == nullptr ? layer->weight().device() : base4->quantized().packed.device();
    // A bf16 / fp16 base with autocast_adapter_dtype: float32 adapters, made as PEFT makes them (drawn in
    // float32, moved to the base's dtype by _move_adapter_to_device_of_base_layer, widened by
    // cast_adapter_dtype: A's values are the base dtype's).
    const auto base_dtype = base4 == nullptr ? layer->weight().scalar_type() : torch::kFloat32;
    const bool widen =
        config.autocast_adapter_dtype && (base_dtype == torch::kBFloat16 || base_dtype == torch::kFloat16);
    layer->lora_A = torch::nn::Linear(torch::nn::LinearOptions(in, config.r).bias(false));
    layer->lora_B = torch::nn::Linear(torch::nn::LinearOptions(config.r, out).bias(false));
    {
      // A split base keeps this rank's part of the drawn adapter (no second draw: the random stream stays
      // the one process's): A's columns under a row split, B's rows under a column split.
      torch::NoGradGuard no_grad;
      if (row != nullptr) {
        auto& a = layer->lora_A->weight;
        a.set_data(a.narrow(1, row->first_column(), row->local_columns()).clone());
      }
      if (column != nullptr) {
        auto& b = layer->lora_B->weight;
        b.set_data(b.narrow(0, column->first_row(), column->local_rows()).clone());
      }
    }
    layer->lora_A->to(device, base_dtype);
    layer->lora_B->to(device, base_dtype);
    if (widen) {
      layer->lora_A->to(torch::kFloat32);
      layer->lora_B->to(torch::kFloat32);
    }
    {
      torch::NoGradGuard no_grad;
      layer->lora_B->weight.zero_();
    }
    // PEFT's LoraLayer.update_layer: lora_alpha / sqrt(r) with use_rslora, else lora_alpha / r.
    layer->scale = config.use_rslora ? config.lora_alpha / std::sqrt(static_cast<double>(config.r))
                                     : config.lora_alpha / config.r;
    layer->dropout = config.lora_dropout;
    layers.push_back(std::move(layer));
  }
  if (layers.empty()) {
    throw UsageError(
        fmt::format("get_peft_model: no Linear layer matches target_modules {}; the model's Linear "
                    "layers are: {}",
                    pattern ? "'" + config.target_modules_regex + "'"
                            : fmt::format("[{}]", fmt::join(config.target_modules, ", ")),
                    linears.empty() ? std::string("none") : fmt::format("{}", fmt::join(linears, ", "))));
  }
  const bool tied_saved = untie_saved_embedding(*model, config);
  // Freeze everything, then open the adapters, the biases the config names and the modules to save.
  for (auto& p : model->parameters())
    p.set_requires_grad(false);
  for (auto& l : layers) {
    l->base()->register_module("lora_A", l->lora_A);
    l->base()->register_module("lora_B", l->lora_B);
    if (config.bias == "lora_only" && l->bias().defined()) l->bias().set_requires_grad(true);
    if (l->base4 != nullptr) {
      // PEFT's bnb.Linear4bit.forward: result + lora_B(lora_A(dropout(x))) * scaling, in the result's type.
      std::weak_ptr<Layer> weak = l;
      l->base4->output_hook = [weak](const torch::Tensor& x, const torch::Tensor& y) {
        auto layer = weak.lock();
        if (!layer || layer->merged.load()) return y;
        auto in = x.to(layer->lora_A->weight.scalar_type());
        if (layer->dropout > 0 && layer->base4->is_training())
          in = torch::dropout(in, layer->dropout, /*train=*/true);
        return y + (layer->lora_B(layer->lora_A(in)) * layer->scale).to(y.scalar_type());
      };
    }
  }
  if (config.bias == "all") {
    for (auto& p : model->named_parameters())
      if (p.key() == "bias" || (p.key().size() > 5 && p.key().substr(p.key().size() - 5) == ".bias"))
        p.value().set_requires_grad(true);
  }
  for (const auto& item : model->named_modules("", false)) {
    for (const auto& n : config.modules_to_save)
      if (name_matches(item.key(), n))
        for (auto& p : item.value()->parameters())
          p.set_requires_grad(true);
  }
  add_layers(layers);
  return std::make_shared<LoraModel>(model, config, std::move(layers), tied_saved);
}

}  // namespace accel::peft
