#include "checkpoint/manifest.hpp"

#include "config/message_text.hpp"

#include <accel/errors.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace accel::detail {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr std::uintmax_t kMaxManifestBytes = 64ull << 20;  // ~250,000 files

const char* kind_name(ManifestKind kind) {
  return kind == ManifestKind::Export ? "export" : "checkpoint";
}

std::string describe(const Manifest& m) {
  std::string out = std::string(kind_name(m.kind)) + " " + m.checkpoint_id.substr(0, 12);
  const auto step = m.facts.find("completed_steps");
  if (step != m.facts.end()) out += " (saved after " + step->second + " optimizer steps)";
  return out;
}

}  // namespace

bool inside_directory(const std::string& name) {
  if (name.empty() || name.front() == '/' || name.find('\0') != std::string::npos) return false;
  std::size_t start = 0;
  while (start <= name.size()) {
    const auto end = std::min(name.find('/', start), name.size());
    const auto part = name.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

std::string new_checkpoint_id() {
  std::random_device device;
  std::uint64_t a = (static_cast<std::uint64_t>(device()) << 32) ^ device();
  std::uint64_t b = (static_cast<std::uint64_t>(device()) << 32) ^ device();
  return hex(a) + hex(b);
}

Manifest build_manifest(const std::string& dir, std::string checkpoint_id,
                        std::map<std::string, std::string> facts,
                        const std::map<std::string, FileDigest>& known) {
  Manifest m;
  m.checkpoint_id = std::move(checkpoint_id);
  m.facts = std::move(facts);
  const fs::path root(dir);
  for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator(); ++it) {
    if (!it->is_regular_file()) continue;
    const std::string name = it->path().lexically_relative(root).generic_string();
    if (name == Manifest::kFile) continue;
    const auto found = known.find(name);
    m.files.push_back({name, found != known.end() ? found->second : digest_file(it->path().string())});
  }
  std::sort(m.files.begin(), m.files.end(),
            [](const ManifestEntry& a, const ManifestEntry& b) { return a.name < b.name; });
  return m;
}

void write_manifest(const std::string& dir, const Manifest& manifest) {
  Json files = Json::array();
  for (const auto& f : manifest.files)
    files.push_back({{"name", f.name}, {"bytes", f.digest.bytes}, {"xxh64", hex(f.digest.xxh64)}});
  const Json root = {{"format", "accelerate-cpp checkpoint manifest"},
                     {"version", 1},
                     {"checkpoint_id", manifest.checkpoint_id},
                     {"facts", manifest.facts},
                     {"files", files}};
  const std::string path = (fs::path(dir) / manifest_file(manifest.kind)).string();
  const std::string text = root.dump(1) + "\n";
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) throw CheckpointError(fmt::format("cannot create {}: {}", path, std::strerror(errno)));
  const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  const int error = errno;
  if (std::fclose(file) != 0 || !written) {
    std::remove(path.c_str());
    throw CheckpointError(fmt::format("writing {} ({} bytes) failed: {}; check free disk space", path,
                                      text.size(), std::strerror(written ? errno : error)));
  }
}

const char* manifest_file(ManifestKind kind) {
  return kind == ManifestKind::Export ? Manifest::kExportFile : Manifest::kFile;
}

Manifest read_manifest(const std::string& dir, ManifestKind kind) {
  const std::string path = (fs::path(dir) / manifest_file(kind)).string();
  const std::string what = kind_name(kind);
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) throw CheckpointError(fmt::format("cannot read the {} manifest {}: {}", what, path, ec.message()));
  if (size > kMaxManifestBytes) {
    throw CheckpointError(fmt::format(
        "the {} manifest {} is {} bytes, more than a manifest can be ({}); "
        "the file is not the one {} wrote",
        what, path, size, kMaxManifestBytes, kind == ManifestKind::Export ? "save_model" : "save_state"));
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  auto bad = [&](const std::string& why) {
    return CheckpointError(bounded_message(fmt::format(
        "the {0} manifest {1} is damaged ({2}); the {0} cannot be verified, so it is not loaded: {3}", what,
        path, why,
        kind == ManifestKind::Export ? "export the model again" : "resume from another checkpoint")));
  };
  Json root;
  try {
    // Depth is bounded by the callback: a manifest is three levels deep.
    root = Json::parse(text.str(), [&](int d, Json::parse_event_t, Json&) {
      if (d > 8) throw bad("nested deeper than a manifest is");
      return true;
    });
    Manifest m;
    m.kind = kind;
    m.checkpoint_id = root.at("checkpoint_id").get<std::string>();
    for (const auto& [k, v] : root.at("facts").items())
      m.facts[k] = v.get<std::string>();
    for (const auto& f : root.at("files")) {
      ManifestEntry e;
      e.name = f.at("name").get<std::string>();
      if (!inside_directory(e.name)) {
        throw bad(fmt::format("it lists '{}', which is not a file inside the {} directory",
                              e.name.substr(0, 200), what));
      }
      e.digest.bytes = f.at("bytes").get<std::uint64_t>();
      const auto h = f.at("xxh64").get<std::string>();
      std::size_t used = 0;
      if (h.size() != 16) throw bad("a checksum is not 16 hex digits");
      e.digest.xxh64 = std::stoull(h, &used, 16);
      if (used != 16) throw bad("a checksum is not 16 hex digits");
      m.files.push_back(std::move(e));
    }
    return m;
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw bad(e.what());
  }
}

std::string verify_entry(const std::string& dir, const Manifest& manifest, const ManifestEntry& entry) {
  const std::string path = (fs::path(dir) / entry.name).string();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    return fmt::format("{} is missing; {} lists it ({} bytes): the {} is incomplete", path,
                       describe(manifest), entry.digest.bytes, kind_name(manifest.kind));
  }
  const auto size = fs::file_size(path, ec);
  if (!ec && size != entry.digest.bytes) {
    return fmt::format("{} has {} bytes but {} wrote {}: the file was truncated, extended or replaced", path,
                       size, describe(manifest), entry.digest.bytes);
  }
  FileDigest d;
  try {
    d = digest_file(path);
  } catch (const std::exception& e) {
    return e.what();
  }
  if (d.xxh64 != entry.digest.xxh64) {
    return fmt::format(
        "{} does not hold what {} wrote (XXH64 {} instead of {}): the file is corrupted or was replaced by "
        "another checkpoint's or another rank's file",
        path, describe(manifest), hex(d.xxh64), hex(entry.digest.xxh64));
  }
  return {};
}

}  // namespace accel::detail
