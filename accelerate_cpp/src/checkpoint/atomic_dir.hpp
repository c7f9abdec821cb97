#pragma once
/// \file atomic_dir.hpp
/// Crash-safe replacement of checkpoint directories and files (POSIX: rename + fsync).
///
/// Guarantee: if the process dies at any moment (crash, SIGKILL, power loss on a filesystem that honours
/// fsync), the final path holds either the previous complete checkpoint or the new complete one, after
/// `recover_interrupted` has run (the `AtomicDirectory` constructor runs it; loaders should too).
///
/// Not designed for concurrent writers of the same path: let one process (e.g. the main process) save a given
/// directory, and make the others wait (barrier) before reading it.

#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>

namespace accel::detail {

/// Builds a directory next to its final location and swaps it in on `commit()`.
///
/// Bytes a checkpoint directory's temporary sibling adds to its name: ".tmp-" + a pid (at most 7 digits,
/// Linux's pid_max is 4194304) + "-" + 8 hex digits.
inline constexpr std::size_t kSiblingSuffixBytes = 21;

/// The one rule for checkpoint paths, for save_state and load_state alike: `dir` normalised lexically
/// ("ckpt/" -> "ckpt", "odd/a/../b" -> "odd/b", whether or not "odd/a" exists). Throws CheckpointError when
/// it names no replaceable directory ("", ".", "/") or when its last name leaves no room for the temporary
/// sibling on this file system (naming both lengths and the limit).
std::filesystem::path normalize_checkpoint_dir(const std::string& dir);

/// Example:
///   AtomicDirectory out("ckpt/step_100");
///   safetensors::write_file((out.path() / "model.safetensors").string(), tensors);
///   out.commit();  // "ckpt/step_100" now holds exactly the new files
class AtomicDirectory {
 public:
  /// Recovers an interrupted earlier commit of `dir` (see `recover_interrupted`), creates the parent
  /// directories if needed, then creates an empty temporary sibling `<dir>.tmp-<pid>-<random>`. Throws
  /// `CheckpointError` if the directories cannot be created.
  explicit AtomicDirectory(const std::string& dir);

  /// Without a successful `commit()`, removes the temporary directory (best effort; never throws).
  ~AtomicDirectory();

  AtomicDirectory(const AtomicDirectory&) = delete;
  AtomicDirectory& operator=(const AtomicDirectory&) = delete;
  AtomicDirectory(AtomicDirectory&&) = delete;
  AtomicDirectory& operator=(AtomicDirectory&&) = delete;

  /// The temporary directory to write the checkpoint files into.
  const std::filesystem::path& path() const noexcept { return temp_; }

  /// The final directory given to the constructor.
  const std::filesystem::path& final_path() const noexcept { return final_; }

  /// Whether `commit()` succeeded.
  bool committed() const noexcept { return committed_; }

  /// Makes the files durable (fsync of every file and directory under `path()`), then replaces the final
  /// directory: an existing one is renamed to `<dir>.old-<pid>`, the temporary one renamed to `<dir>`, the
  /// parent fsynced, the old one removed. Throws `CheckpointError` on failure, after putting the previous
  /// directory back; throws `UsageError` if called twice.
  void commit();

 private:
  std::filesystem::path final_;
  std::filesystem::path temp_;
  bool committed_ = false;
};

/// Repairs what an interrupted `AtomicDirectory::commit` of `dir` can leave behind:
/// - `dir` missing but one `<dir>.old-<pid>` present (crash between the two renames): renames it back to
/// `dir`;
///   several of them: throws `CheckpointError` listing them (pick one by hand);
/// - `dir` present and `<dir>.old-*` present (crash before the old one was removed): removes those;
/// - `<dir>.tmp-<pid>-*` of processes no longer running on this host: removes them (others are left alone),
///   and likewise any `<name>.tmp-<pid>-<8 hex>` directory beside `dir` (another checkpoint's, from a killed
///   run that never saved under that name again).
/// Does nothing when there is nothing to repair; throws `CheckpointError` if a rename or removal fails.
void recover_interrupted(const std::string& dir);

/// Replaces the file `path` with `bytes` atomically: writes `<path>.tmp-<pid>-<random>`, fsyncs it, renames
/// it over `path` and fsyncs the parent directory. Readers see the old or the new content, never a mix.
/// Throws `CheckpointError` naming the file on failure (the temporary file is removed).
void write_file_atomic(const std::string& path, std::string_view bytes);

}  // namespace accel::detail
