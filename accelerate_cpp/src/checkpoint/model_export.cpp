#include "checkpoint/model_export.hpp"

#include "checkpoint/tensor_io.hpp"

#include <accel/errors.hpp>
#include "checkpoint/atomic_dir.hpp"
#include "checkpoint/manifest.hpp"
#include "config/message_text.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <unordered_map>

namespace accel::detail {
namespace fs = std::filesystem;

namespace {

constexpr const char* kSingle = "model.safetensors";
constexpr const char* kIndex = "model.safetensors.index.json";
constexpr std::uintmax_t kMaxIndexBytes = 64ull << 20;

std::string shard_name(std::size_t k, std::size_t n) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", k, n);
}

bool is_export_weight(const std::string& name) {
  static const std::regex kShard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  return name == kSingle || name == kIndex || name == Manifest::kExportFile || std::regex_match(name, kShard);
}

}  // namespace

void in_model_order(NamedTensors& state, const torch::nn::Module& module) {
  std::unordered_map<std::string, std::size_t> position;
  for (const auto& p : module.named_parameters())
    position.emplace(p.key(), position.size());
  for (const auto& b : module.named_buffers())
    position.emplace(b.key(), position.size());
  // A pipeline stage cut from the model lists only its own layers: the stages' order is the model's there.
  for (const auto& entry : state)
    if (position.count(entry.first) == 0) return;
  std::stable_sort(state.begin(), state.end(),
                   [&](const auto& a, const auto& b) { return position.at(a.first) < position.at(b.first); });
}

std::uint64_t parse_shard_size(const std::string& text) {
  // As transformers' convert_file_size_to_int: decimal units for KB/MB/GB, binary ones for KiB/MiB/GiB.
  static const std::regex kForm(R"(\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*)", std::regex::icase);
  std::smatch m;
  if (!std::regex_match(text, m, kForm)) {
    throw UsageError(
        fmt::format("max_shard_size '{}' is not a size; write a number of bytes or a size such as "
                    "\"10GB\", \"500MB\" or \"2GiB\"",
                    text));
  }
  const double number = std::stod(m[1].str());
  std::string unit = m[2].str();
  for (auto& c : unit)
    c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 1;
  if (!unit.empty()) {
    const bool binary = unit.size() == 3;
    const double base = binary ? 1024.0 : 1000.0;
    const int power = std::string("KMGT").find(unit[0]) + 1;
    for (int i = 0; i < power; ++i)
      scale *= base;
  }
  const double bytes = number * scale;
  if (bytes < 1 || bytes > 1.8e19) {
    throw UsageError(fmt::format("max_shard_size '{}' must be at least one byte", text));
  }
  return static_cast<std::uint64_t>(bytes);
}

ShardedExportWriter::ShardedExportWriter(fs::path dir, std::uint64_t max_shard_bytes)
    : dir_(std::move(dir)), max_(max_shard_bytes) {
  std::error_code ec;
  // A save_state checkpoint keeps its own model.safetensors, listed in its manifest: an export there would
  // replace it, and the checkpoint would no longer load.
  if (fs::exists(dir_ / Manifest::kFile, ec)) {
    throw CheckpointError(fmt::format(
        "save_model: '{}' holds a save_state checkpoint ({}); an export there would replace the checkpoint's "
        "model.safetensors and it would no longer load: export to another directory (nothing was written)",
        dir_.string(), Manifest::kFile));
  }
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_)) {
    throw CheckpointError(fmt::format("save_model: cannot create the directory '{}': {}", dir_.string(),
                                      ec ? ec.message() : "a file of that name exists"));
  }
  // The export replaces the weights of an earlier save_model export (the files its manifest lists), never
  // weight files this library did not write (another tool's export, a user's own model.safetensors).
  std::set<std::string> ours;
  if (fs::exists(dir_ / Manifest::kExportFile, ec)) {
    try {
      for (const auto& entry : read_manifest(dir_.string(), ManifestKind::Export).files)
        ours.insert(entry.name);
    } catch (const CheckpointError&) {
      ours.clear();  // unreadable: nothing in the directory is known to be ours
    }
  }
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && is_export_weight(name) && name != Manifest::kExportFile &&
        !ours.count(name)) {
      const char* fix =
          "move it away or export to another directory (if an earlier save_model into it was interrupted, "
          "delete its model*.safetensors files)";
      throw CheckpointError(
          fmt::format("save_model: '{}' already holds {}, which no earlier save_model export "
                      "there lists (no readable {}); the export would replace it: {} "
                      "(nothing was written)",
                      dir_.string(), name, Manifest::kExportFile, fix));
    }
  }
}

ShardedExportWriter::~ShardedExportWriter() {
  if (finished_) return;
  std::error_code ec;  // an export that did not finish leaves the earlier one as it was
  for (const auto& file : temp_files_)
    fs::remove(file, ec);
}

void ShardedExportWriter::add(const std::string& name, const torch::Tensor& tensor) {
  if (!seen_.emplace(name, true).second) {
    throw CheckpointError(fmt::format("save_model: two tensors are named '{}'", name));
  }
  torch::Tensor cpu = tensor.detach().to(torch::kCPU).contiguous();
  if (cpu.data_ptr() == tensor.data_ptr()) cpu = cpu.clone();  // own the bytes: the caller may release them
  const std::uint64_t size = tensor_bytes(cpu);
  total_ += size;
  if (size > max_) {  // a tensor larger than a shard gets a shard of its own
    std::vector<std::pair<std::string, torch::Tensor>> alone{{name, std::move(cpu)}};
    flush(alone);
    return;
  }
  if (held_ + size > max_ && !current_.empty()) flush(current_);
  current_.emplace_back(name, std::move(cpu));
  held_ += size;
}

void ShardedExportWriter::flush(std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  const fs::path temp = dir_ / fmt::format(".model-export-{:05d}.safetensors.tmp", temp_files_.size() + 1);
  NamedTensors named(tensors.begin(), tensors.end());
  temp_files_.push_back(temp);  // first: the destructor removes it whatever happens while writing
  digests_.push_back(write_tensors(temp.string(), named, {{"format", "pt"}}));
  std::vector<std::string> names;
  for (const auto& [name, t] : tensors)
    names.push_back(name);
  shard_names_.push_back(std::move(names));
  if (&tensors == &current_) held_ = 0;
  tensors.clear();
}

ModelExport ShardedExportWriter::finish() {
  if (!current_.empty() || temp_files_.empty()) flush(current_);
  const std::size_t n = temp_files_.size();
  ModelExport out;
  out.total_bytes = total_;
  // Remove the weights of an earlier export (its manifest first: files without their manifest are read
  // unverified, never verified against another export's list), then move the new files into place, the
  // index and the manifest last.
  std::error_code ec;
  fs::remove(dir_ / Manifest::kExportFile, ec);
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    if (entry.is_regular_file() && is_export_weight(entry.path().filename().string())) {
      fs::remove(entry.path(), ec);
    }
  }
  Manifest manifest;
  manifest.kind = ManifestKind::Export;
  manifest.checkpoint_id = new_checkpoint_id();
  manifest.facts = {{"total_bytes", std::to_string(total_)}, {"tensors", std::to_string(seen_.size())}};
  // Within one directory a rename fails only on a broken filesystem: an accel:: error naming the file.
  auto move_into_place = [&](const fs::path& from, const std::string& to) {
    std::error_code move_ec;
    fs::rename(from, dir_ / to, move_ec);
    if (move_ec) {
      throw CheckpointError(fmt::format("save_model: moving '{}' to '{}' failed: {}", from.string(),
                                        (dir_ / to).string(), move_ec.message()));
    }
  };
  if (n == 1) {
    move_into_place(temp_files_[0], kSingle);
    out.files.push_back(kSingle);
    manifest.files.push_back({kSingle, digests_[0]});
  } else {
    nlohmann::ordered_json index;
    index["metadata"]["total_size"] = total_;
    nlohmann::json weight_map = nlohmann::json::object();  // sorted by name, as transformers writes it
    for (std::size_t k = 0; k < n; ++k) {
      const std::string file = shard_name(k + 1, n);
      move_into_place(temp_files_[k], file);
      out.files.push_back(file);
      manifest.files.push_back({file, digests_[k]});
      for (const auto& name : shard_names_[k])
        weight_map[name] = file;
    }
    index["weight_map"] = weight_map;
    const std::string text = index.dump(2) + "\n";
    write_file_atomic((dir_ / kIndex).string(), text);
    out.files.push_back(kIndex);
    Xxh64 hash;
    hash.update(text.data(), text.size());
    manifest.files.push_back({kIndex, {hash.size(), hash.digest()}});
  }
  std::sort(manifest.files.begin(), manifest.files.end(),
            [](const ManifestEntry& a, const ManifestEntry& b) { return a.name < b.name; });
  write_manifest(dir_.string(), manifest);
  finished_ = true;
  return out;
}

namespace {

// An export save_model wrote carries its manifest: every file it lists must be there, whole and unchanged,
// before anything is read. Exports without one (transformers', or ours from before manifests) are read as
// they are. Returns the names the manifest lists (empty without one).
std::vector<std::string> verify_export(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir / Manifest::kExportFile, ec)) return {};
  const Manifest manifest = read_manifest(dir.string(), ManifestKind::Export);
  std::vector<std::string> names;
  for (const ManifestEntry& entry : manifest.files) {
    const std::string problem = verify_entry(dir.string(), manifest, entry);
    if (!problem.empty()) {
      throw CheckpointError(
          fmt::format("load_model: {}; nothing was loaded: export the model again", problem));
    }
    names.push_back(entry.name);
  }
  return names;
}

// A file the export reads that its manifest does not list is from another export (or was added later).
void require_listed(const fs::path& dir, const std::vector<std::string>& listed, const std::string& file) {
  if (listed.empty() || std::find(listed.begin(), listed.end(), file) != listed.end()) return;
  throw CheckpointError(fmt::format(
      "load_model: {} is not listed in {}, which save_model wrote with this export: it belongs to another "
      "export; nothing was loaded: export the model again",
      (dir / file).string(), (dir / Manifest::kExportFile).string()));
}

}  // namespace

std::map<std::string, torch::Tensor> read_model_export_unbounded(const fs::path& dir, bool mapped);

std::map<std::string, torch::Tensor> read_model_export(const fs::path& dir) {
  try {
    return read_model_export_unbounded(dir, false);
  } catch (const CheckpointError& e) {
    // Names from a hostile index (a 100,000-character tensor name) are quoted short and printable.
    throw CheckpointError(bounded_message(e.what()));
  }
}

std::map<std::string, torch::Tensor> map_model_export(const fs::path& dir) {
  try {
    return read_model_export_unbounded(dir, true);
  } catch (const CheckpointError& e) {
    throw CheckpointError(bounded_message(e.what()));
  }
}

namespace {

// `names` of one safetensors file: copied into memory, or (mapped) views of the mapped file.
void take_tensors(const fs::path& path, const std::vector<std::string>& names, bool mapped,
                  std::map<std::string, torch::Tensor>& out) {
  if (!mapped) {
    const safetensors::File file = safetensors::File::open(path.string());
    for (const auto& name : names)
      out[name] = read_tensor(file, name);
    return;
  }
  const auto file = std::make_shared<const safetensors::File>(safetensors::File::map(path.string()));
  for (const auto& name : names)
    out[name] = mapped_tensor(file, name);
}

}  // namespace

std::map<std::string, torch::Tensor> read_model_export_unbounded(const fs::path& dir, bool mapped) {
  const fs::path index_path = dir / kIndex;
  std::map<std::string, torch::Tensor> out;
  const std::vector<std::string> listed = verify_export(dir);
  std::error_code exists_ec;
  if (!fs::exists(index_path, exists_ec)) {
    if (!fs::exists(dir / kSingle, exists_ec)) {
      throw CheckpointError(
          fmt::format("load_model: '{}' has neither {} nor {}; pass the directory that "
                      "accelerator.save_model(model, dir) wrote",
                      dir.string(), kSingle, kIndex));
    }
    require_listed(dir, listed, kSingle);
    if (!mapped) return read_tensors(safetensors::File::open((dir / kSingle).string()));
    const auto file =
        std::make_shared<const safetensors::File>(safetensors::File::map((dir / kSingle).string()));
    for (const auto& name : file->names())
      out[name] = mapped_tensor(file, name);
    return out;
  }
  require_listed(dir, listed, kIndex);
  std::error_code ec;
  const auto size = fs::is_regular_file(index_path, ec) ? fs::file_size(index_path, ec) : 0;
  if (ec || !fs::is_regular_file(index_path, ec) || size > kMaxIndexBytes) {
    throw CheckpointError(fmt::format(
        "load_model: {} is {}; an index save_model writes is a JSON file of at most {} bytes: re-export with "
        "save_model",
        index_path.string(),
        ec                      ? ec.message()
        : size > kMaxIndexBytes ? fmt::format("{} bytes", size)
                                : "not a file",
        kMaxIndexBytes));
  }
  std::ifstream in(index_path);
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json index;
  try {
    // An index is three levels deep; the bound keeps a hostile file from exhausting the stack.
    index = nlohmann::json::parse(text.str(), [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > 16) {
        throw CheckpointError(fmt::format("load_model: {} is nested deeper than an index is (> 16 levels)",
                                          index_path.string()));
      }
      return true;
    });
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("load_model: {} is not valid JSON: {}", index_path.string(), e.what()));
  }
  if (!index.contains("weight_map") || !index["weight_map"].is_object()) {
    throw CheckpointError(
        fmt::format("load_model: {} has no \"weight_map\" object; it is not a "
                    "safetensors index (re-export with save_model)",
                    index_path.string()));
  }
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string()) {
      throw CheckpointError(
          fmt::format("load_model: {}: the file of '{}' is not a string", index_path.string(), name));
    }
    if (!inside_directory(file.get<std::string>())) {
      throw CheckpointError(fmt::format(
          "load_model: {}: the file of '{}' is '{}', which is not a file inside the export directory (an "
          "absolute path or one with '..'); an index save_model writes names its shards only",
          index_path.string(), name, file.get<std::string>().substr(0, 200)));
    }
    by_file[file.get<std::string>()].push_back(name);
  }
  for (const auto& [file, names] : by_file) {
    require_listed(dir, listed, file);
    const fs::path path = dir / file;
    std::error_code ec;  // never the throwing overloads: a hostile index may name anything
    if (!fs::is_regular_file(path, ec)) {
      throw CheckpointError(
          fmt::format("load_model: {} lists {} (for '{}'), which is missing{}; copy the whole "
                      "export directory",
                      index_path.string(), file.substr(0, 200), names.front().substr(0, 200),
                      ec ? " (" + ec.message() + ")" : std::string()));
    }
    take_tensors(path, names, mapped, out);
  }
  return out;
}

}  // namespace accel::detail
