// Real keys of Accelerate's and DeepSpeed's files (of some version) that accelerate-cpp does not support: one
// table of data. The core owns the top-level YAML keys below; each backend part adds the keys of its section
// and of the files it reads (BackendPart::unsupported). Reading consults the table before "unknown key ...
// did you mean", so a real key is never reported as a typo; `accel-launch config keys` prints it as the
// "Not supported" section of docs/config_keys.md.
//
// A row is refused (an error) unless ignoring the key cannot change what the ranks compute (launcher-side,
// logging), or its job is done here another way (a DeepSpeed JSON's optimizer block: the loop's optimizer);
// then it is a notice, and its `instead` says why. Values that ask for nothing (an empty section, ...) are
// accepted without a word.
#include "config/config_detail.hpp"

namespace accel {
namespace config_detail {
namespace {

// Sources: Accelerate's commands/config/config_args.py (ClusterConfig) and cluster.py (what `accelerate
// config` writes), at the versions named in each row.
std::vector<UnsupportedKey> core_rows() {
  std::vector<UnsupportedKey> rows;
  auto refused = [&rows](const char* path, AsksNothingWhen when, const char* what, const char* instead) {
    rows.push_back({kAccelerateYaml, path, true, when, "", what, instead});
  };
  auto noticed = [&rows](const char* path, AsksNothingWhen when, const char* what, const char* instead) {
    rows.push_back({kAccelerateYaml, path, false, when, "", what, instead});
  };
  refused(
      "ipex_config", AsksNothingWhen::AllFalse,
      "Intel Extension for PyTorch (Accelerate 0.19 to 1.12; removed in 1.13): ipex: true runs "
      "ipex.optimize on the model and optimizer (bf16 weights with mixed_precision: bf16), use_xpu: true "
      "trains on Intel GPUs",
      "remove it (or set its values to false): LibTorch has no IPEX, CPU runs use LibTorch's own kernels");
  // Launcher-side: how the processes are started does not change what they compute (num_processes and
  // num_machines still decide the layout).
  noticed("mpirun_config", AsksNothingWhen::Empty,
          "Accelerate 0.28+ starts MULTI_CPU ranks with mpirun and a hostfile (mpirun_hostfile)",
          "ignored: accel-launch starts the ranks itself (to use mpirun, run the program under mpirun: "
          "accelerate-cpp reads Open MPI's environment); how ranks are started does not change what they "
          "compute");
  return rows;
}

bool is_false(const YAML::Node& node) {
  if (!node.IsScalar()) return false;
  const std::string text = lower(node.Scalar());
  return text == "false" || text == "no" || text == "off" || text == "n" || text == "0";
}

bool is_empty(const YAML::Node& node) {
  return !node.IsDefined() || node.IsNull() || ((node.IsMap() || node.IsSequence()) && node.size() == 0) ||
         (node.IsScalar() && node.Scalar().empty());
}

bool ends_with(const std::string& text, const std::string& tail) {
  return text.size() >= tail.size() && text.compare(text.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

const std::vector<UnsupportedKey>& unsupported_keys() {
  static const std::vector<UnsupportedKey> kRows = [] {
    std::vector<UnsupportedKey> rows = core_rows();
    for (const BackendPart& part : backend_parts())
      rows.insert(rows.end(), part.unsupported.begin(), part.unsupported.end());
    return rows;
  }();
  return kRows;
}

const UnsupportedKey* find_unsupported(const std::string& file, const std::string& path) {
  for (const UnsupportedKey& key : unsupported_keys()) {
    if (key.file == file && key.path == path) return &key;
  }
  return nullptr;
}

bool asks_nothing(const UnsupportedKey& key, const YAML::Node& value) {
  switch (key.asks_nothing) {
    case AsksNothingWhen::Never:
      return false;
    case AsksNothingWhen::Null:
      return !value.IsDefined() || value.IsNull();
    case AsksNothingWhen::Empty:
      return is_empty(value);
    case AsksNothingWhen::AllFalse:
      if (is_empty(value)) return true;
      if (!value.IsMap()) return false;
      for (const auto& item : value) {
        if (!is_false(item.second)) return false;
      }
      return true;
    case AsksNothingWhen::Disabled:
      if (is_empty(value)) return true;
      if (!value.IsMap()) return false;
      // DeepSpeed's blocks (amp, elasticity, quantize_training, ...) are off unless `enabled` says true. A
      // missing key is looked up without yaml-cpp's throwing accessors.
      for (const auto& item : value) {
        if (item.first.IsScalar() && item.first.Scalar() == "enabled") return is_false(item.second);
      }
      return true;
    case AsksNothingWhen::SizesAtMostOne:
      if (is_empty(value)) return true;
      if (!value.IsMap()) return false;
      for (const auto& item : value) {
        const std::string name = item.first.IsScalar() ? item.first.Scalar() : std::string();
        if (!ends_with(name, "size") && !ends_with(name, "degree")) continue;
        int64_t size = 0;
        if (!item.second.IsScalar() || !parse_int64(item.second.Scalar(), size) || size > 1) return false;
      }
      return true;
    case AsksNothingWhen::Value:
      return value.IsScalar() && lower(value.Scalar()) == lower(key.neutral_value);
  }
  return false;
}

std::string unsupported_message(const UnsupportedKey& key) {
  return fmt::format("{} is not supported by accelerate-cpp: {}; {}", key.path, key.what, key.instead);
}

}  // namespace config_detail

std::vector<UnsupportedKeyInfo> unsupported_config_keys() {
  std::vector<UnsupportedKeyInfo> out;
  for (const config_detail::UnsupportedKey& key : config_detail::unsupported_keys()) {
    std::string when;
    switch (key.asks_nothing) {
      case config_detail::AsksNothingWhen::Never:
        break;
      case config_detail::AsksNothingWhen::Null:
        when = "null";
        break;
      case config_detail::AsksNothingWhen::Empty:
        when = "empty";
        break;
      case config_detail::AsksNothingWhen::AllFalse:
        when = "empty, or every value false";
        break;
      case config_detail::AsksNothingWhen::Disabled:
        when = "empty, or enabled false or absent";
        break;
      case config_detail::AsksNothingWhen::SizesAtMostOne:
        when = "empty, or every *_size 0 or 1";
        break;
      case config_detail::AsksNothingWhen::Value:
        when = key.neutral_value;
        break;
    }
    out.push_back({key.file, key.path, key.refused, when, key.what, key.instead});
  }
  return out;
}

}  // namespace accel
