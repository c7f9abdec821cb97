#pragma once
// A checkpoint's manifest (manifest.json): the list of every file save_state wrote, each with its size and
// XXH64, and a checkpoint id that accelerator_state.safetensors repeats. Written last, inside the temporary
// directory that the atomic rename then publishes, so a checkpoint directory either has a manifest that
// matches all its files or is no checkpoint. load_state verifies it before it touches any object: a
// corrupted, truncated, missing or foreign file (one from another checkpoint, another rank's file swapped in)
// is an error that names it. Torch-free.

#include "checkpoint/xxh64.hpp"

#include <map>
#include <string>
#include <vector>

namespace accel::detail {

struct ManifestEntry {
  std::string name;  ///< relative to the checkpoint directory, '/'-separated ("layers/layer_3.safetensors")
  FileDigest digest;
};

/// What a manifest describes: a save_state checkpoint (`manifest.json`) or a save_model export
/// (`model.safetensors.manifest.json`, beside Hugging Face's files, which transformers ignores).
enum class ManifestKind { Checkpoint, Export };

struct Manifest {
  static constexpr const char* kFile = "manifest.json";
  static constexpr const char* kExportFile = "model.safetensors.manifest.json";
  ManifestKind kind = ManifestKind::Checkpoint;
  std::string checkpoint_id;                 ///< 32 hex digits, unique per save
  std::map<std::string, std::string> facts;  ///< world_size, backend, step ...: shown in messages
  std::vector<ManifestEntry> files;          ///< sorted by name; never manifest.json itself
};

/// Whether `relative` names a file inside a directory: relative, no "..", "." or empty part ("a/b" is,
/// "/etc/passwd" and "../x" are not).
bool inside_directory(const std::string& relative);

/// A fresh random checkpoint id (128 bits, hex).
std::string new_checkpoint_id();

/// The manifest of the files under `dir` (recursively): digests from `known` (relative name -> digest, what
/// the writers computed while writing), the others (files a save hook wrote) read and hashed here.
Manifest build_manifest(const std::string& dir, std::string checkpoint_id,
                        std::map<std::string, std::string> facts,
                        const std::map<std::string, FileDigest>& known);

/// The manifest's file name for `kind`.
const char* manifest_file(ManifestKind kind);

/// Writes `manifest` to `<dir>/manifest.json` (an export's to its own name). Throws CheckpointError naming
/// the file.
void write_manifest(const std::string& dir, const Manifest& manifest);

/// Reads `<dir>/manifest.json`; throws CheckpointError naming the file and the problem (too large, not
/// JSON, a missing field, a name that is absolute or leaves the directory).
Manifest read_manifest(const std::string& dir, ManifestKind kind = ManifestKind::Checkpoint);

/// Compares one listed file with what is on disk: empty when it matches, else the problem (missing, another
/// size, another checksum), naming the file and the checkpoint.
std::string verify_entry(const std::string& dir, const Manifest& manifest, const ManifestEntry& entry);

}  // namespace accel::detail
