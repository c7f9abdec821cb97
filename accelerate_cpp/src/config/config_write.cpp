// Writing accel::Config (to_yaml, save_file), its equality and the enum spellings; all derived from the
// schema's rows.
#include "config/config_detail.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace accel {
namespace config_detail {

// Writes `text` as a YAML scalar that reads back as the same string (never as a bool, number or null).
std::string yaml_string(const std::string& text) {
  static const std::vector<std::string> kKeywords = {"true", "false", "yes",  "no",   "on", "off",
                                                     "y",    "n",     "null", "none", "~"};
  bool plain = !text.empty() &&
               (std::isalpha(static_cast<unsigned char>(text[0])) || text[0] == '_' || text[0] == '/');
  for (char c : text) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.' && c != '/') {
      plain = false;
    }
  }
  if (plain && std::find(kKeywords.begin(), kKeywords.end(), lower(text)) == kKeywords.end()) return text;
  bool control = false;
  for (char c : text)
    control = control || static_cast<unsigned char>(c) < 0x20;
  if (!control) {
    std::string out = "'";
    for (char c : text)
      out += c == '\'' ? std::string("''") : std::string(1, c);
    return out + "'";
  }
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace config_detail

using namespace config_detail;

std::string to_string(MixedPrecision mode) {
  return canonical_text(mixed_precision_choices(), mode);
}

std::string to_string(CommHook hook) {
  return canonical_text(comm_hook_choices(), hook);
}

std::string parse_backend(const std::string& text) {
  const std::optional<std::string> name = match_choice(backend_choices(), text);
  if (!name) throw ConfigError(bad_choice_message("backend", backend_choices(), text), "", 0, "backend");
  return *name;
}

const std::vector<BackendInfo>& config_backends() {
  static const std::vector<BackendInfo> kInfos = [] {
    std::vector<BackendInfo> out;
    for (const BackendPart& part : backend_parts())
      out.push_back(part.info);
    return out;
  }();
  return kInfos;
}

const BackendInfo* find_backend(const std::string& name) {
  const BackendPart* part = find_part(name);
  return part == nullptr ? nullptr : &part->info;
}

std::string backend_for_processes(const std::string& backend, int num_processes) {
  const BackendInfo* info = find_backend(backend);
  if (num_processes > 1 && info != nullptr && !info->multi_process_replacement.empty()) {
    return backend_for_processes(info->multi_process_replacement, num_processes);
  }
  return backend;
}

MixedPrecision parse_mixed_precision(const std::string& text) {
  const std::optional<MixedPrecision> mode = match_choice(mixed_precision_choices(), text);
  if (!mode) {
    throw ConfigError(bad_choice_message("mixed_precision", mixed_precision_choices(), text), "", 0,
                      "mixed_precision");
  }
  return *mode;
}

namespace config_detail {

bool agree(const Config& a, const Config& b, const std::optional<Section>& section) {
  for (const auto& row : schema()) {
    if (row.equal && (!section || row.section == *section) && !row.equal(a, b)) return false;
  }
  return true;
}

}  // namespace config_detail

bool operator==(const Config& a, const Config& b) {
  return agree(a, b, std::nullopt);
}

std::string Config::to_yaml() const {
  std::string out =
      "# accelerate-cpp configuration (Hugging Face Accelerate keys plus accelerate-cpp's own).\n";
  for (const KeyRow* row : rows_of(kTop)) {
    if (row->opens) {
      if (!section_in_use(*this, *row->opens)) {
        out += row->name + ": {}\n";
        continue;
      }
      out += row->name + ":\n";
      for (const KeyRow* item : rows_of(*row->opens)) {
        if (item->write) out += "  " + item->name + ": " + item->write(*this) + "\n";
      }
      continue;
    }
    if (!row->write) continue;
    const std::string value = row->write(*this);
    if (value.empty()) continue;  // a section written only when in use (parallelism_config)
    if (!row->comment.empty()) out += row->comment + "\n";
    out += row->name + (value.front() == '\n' ? ":" : ": ") + value + "\n";
  }
  return out;
}

std::vector<ConfigKeyInfo> config_keys() {
  std::vector<ConfigKeyInfo> out;
  const Config defaults;
  for (const auto& row : schema()) {
    const std::string& section = row.section;
    ConfigKeyInfo info;
    info.path = section.empty() ? row.name : section + "." + row.name;
    info.default_value = row.write && !row.opens ? row.write(defaults) : std::string();
    info.doc = row.doc;
    info.example = row.example;
    info.setting = static_cast<bool>(row.equal);
    out.push_back(std::move(info));
  }
  return out;
}

void Config::save_file(const std::string& path) const {
  const std::string text = to_yaml();
  const std::filesystem::path file(path);
  std::error_code ec;
  if (file.has_parent_path()) {
    std::filesystem::create_directories(file.parent_path(), ec);
    if (ec) {
      throw ConfigError(fmt::format("cannot create directory '{}' for config file '{}': {}",
                                    file.parent_path().string(), path, ec.message()),
                        path);
    }
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    throw ConfigError(fmt::format("cannot write config file '{}': {}", path, std::strerror(errno)), path);
  }
  out << text;
  out.flush();
  if (!out) {
    throw ConfigError(fmt::format("cannot write config file '{}': {}", path, std::strerror(errno)), path);
  }
}

}  // namespace accel
