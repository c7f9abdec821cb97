#pragma once
// The NVMe tier of the ZeRO engines (DeepSpeed's ZeRO-Infinity `offload_optimizer: {device: nvme}`): where
// the optimizer state of each sub-group lives between the optimizer's visits. The engine steps the user's own
// optimizer; the parameter trigger tells it which sub-group the optimizer is about to touch, and it asks the
// tier to `load` that group's state (and to `prefetch` the next one) and to `evict` the one before, whose
// state is then written to a file under `nvme_path` and its memory freed. A sub-group's state lives in one
// "slab", an aligned buffer the state tensors point into, so that reads and writes go straight between the
// file and the tensors' memory (O_DIRECT where the filesystem has it; page-cache I/O where it has not, such
// as tmpfs). One I/O thread per tier runs the reads and writes in order; at most `buffer_count` slabs exist
// at once (the one being stepped, one read ahead, the rest written behind), which bounds the tier's memory.
//
// The files are scratch space, not a checkpoint: each process writes under its own directory
// `<nvme_path>/accel_nvme_<host>_<pid>` (one sub-directory per engine), removed when the tiers end; one left
// by a killed process on this host is removed when the next tier starts there.

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace accel::backends::detail {

/// The tier's settings (DeepSpeed's `offload_optimizer` keys).
struct NvmeOptions {
  std::string path;          ///< nvme_path: the directory the state files go under
  int buffer_count = 4;      ///< buffer_count: slabs alive at once (>= 2)
  bool read_ahead = true;    ///< pipeline_read: read the next sub-group while one is stepped
  bool write_behind = true;  ///< pipeline_write: write a sub-group while the next is stepped
  /// What the files hold, for messages: the optimizer state (offload_optimizer), or the parameter shards
  /// (offload_param: then `parameters` is true).
  bool parameters = false;
};

/// The state tensors of one parameter's optimizer state (LibTorch's Adam, AdamW, SGD, RMSprop, Adagrad), in a
/// fixed order; empty for a state of another kind.
std::vector<torch::Tensor> optimizer_state_tensors(const torch::optim::OptimizerParamState& state);
/// Whether the tier can swap this optimizer's state (its per-parameter state is one of the kinds above).
bool nvme_swappable(const torch::optim::Optimizer& optimizer);

class NvmeTier {
 public:
  /// Creates this process's directory under `options.path` (and removes those of dead processes of this
  /// host). `who` names the engine in messages ("zero rank 1").
  NvmeTier(NvmeOptions options, std::string who);
  /// Waits for the I/O in flight and removes this tier's files.
  ~NvmeTier();
  NvmeTier(const NvmeTier&) = delete;
  NvmeTier& operator=(const NvmeTier&) = delete;

  /// Writes sub-group `group`'s state tensors (as the optimizer holds them now) to its file, behind when
  /// write_behind, and frees their memory: reading them without `load` throws. Tensors without memory
  /// (already evicted) are skipped.
  void evict(std::size_t group, const std::vector<torch::Tensor>& tensors);
  /// Gives `group`'s evicted tensors their values again (from a read-ahead, a write still in flight, or a
  /// read now). Nothing to do for a group that is not evicted.
  void load(std::size_t group);
  /// Frees `group`'s memory again without writing, when its file holds its values (it was loaded from the
  /// file, or written, and not marked changed since); otherwise evicts it (writes). Nothing to do for a group
  /// that is evicted already.
  void drop(std::size_t group);
  /// `group`'s tensors were (or are about to be) changed in memory: its file is stale until the next evict.
  void mark_changed(std::size_t group);
  /// Starts reading `group` (when it is evicted and read_ahead is on).
  void prefetch(std::size_t group);
  /// Whether `group`'s state is on disk (its tensors hold no memory).
  bool evicted(std::size_t group) const;
  /// Waits until every write has reached the file (and so its memory is free).
  void drain();

  /// Bytes written to / read from the files so far, and the bytes of the slabs alive now and at most.
  std::uint64_t bytes_written() const { return stats_->written; }
  std::uint64_t bytes_read() const { return stats_->read; }
  std::uint64_t slab_bytes_peak() const { return stats_->peak; }
  const std::string& directory() const { return dir_; }
  const std::string& who() const { return who_; }
  /// A notice about what the constructor cleaned up (stale files of a killed run), or empty.
  const std::string& notice() const { return notice_; }

 private:
  struct Slab;
  struct Group {
    std::vector<torch::Tensor> tensors;  // as registered at the last evict
    std::vector<std::int64_t> offsets;   // byte offset of each in the slab and the file
    std::int64_t bytes = 0;              // aligned size of slab and file
    bool on_disk = false;                // tensors hold no memory; the file (or a pending write) has them
    bool file_current = false;           // the file (or a pending write) holds the tensors' values
    std::shared_ptr<std::atomic<bool>> write_failed;  // the last write's failure (its file is then stale)
    std::shared_ptr<Slab> in_flight;                  // a read ahead or a write behind of this group
    std::uint64_t job = 0;                            // the I/O job of `in_flight`
  };

  std::shared_ptr<Slab> make_slab(std::int64_t bytes);
  std::uint64_t submit(std::function<void()> work);
  void wait(std::uint64_t job);
  void run();
  void point_into(Group& g, const std::shared_ptr<Slab>& slab);
  void release_all(const Group& g) const;
  void check_space(const Group& g, std::size_t group);
  std::string file_of(std::size_t group) const;
  void keep_slabs_under_budget();

  NvmeOptions options_;
  std::string who_;
  std::string process_dir_;  // <nvme_path>/accel_nvme_<host>_<pid>
  std::string dir_;          // process_dir_/engine_<n>: this tier's files
  std::string notice_;
  bool direct_ = true;  // O_DIRECT works on this filesystem (decided at the first file)
  std::map<std::size_t, Group> groups_;
  std::deque<std::size_t> writing_;  // groups with a write in flight, oldest first

  // The I/O thread: jobs run in submission order; a job's exception is kept for whoever waits for it.
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::uint64_t, std::function<void()>>> queue_;
  std::map<std::uint64_t, std::string> failed_;
  std::uint64_t next_job_ = 1, done_upto_ = 0;
  bool stop_ = false;
  std::thread io_;

  // Shared with the slabs, which the optimizer's tensors may keep after the tier ends.
  struct Stats {
    std::atomic<std::uint64_t> written{0}, read{0}, live{0}, peak{0};
  };
  std::shared_ptr<Stats> stats_ = std::make_shared<Stats>();
};

class ParameterTrigger;

/// What a ZeRO engine adds to use the tier: its sub-groups (each one master tensor of one optimizer), the
/// trigger tags that say which one the optimizer is about to touch, and the switching. Tags from `tag_base()`
/// up are this object's: the engine watches each master with `tag(group)` and hands every operator's tags to
/// `on_operator`; the state tensors the optimizer creates are watched as they are first evicted.
class OptimizerStateOffload {
 public:
  OptimizerStateOffload(NvmeOptions options, std::string who, ParameterTrigger& trigger,
                        std::size_t tag_base);
  ~OptimizerStateOffload();

  /// Sub-group `group` (numbered in the optimizer's stepping order) is the optimizer state of `master`.
  void add_group(std::size_t group, torch::Tensor master, torch::optim::Optimizer* optimizer);
  std::size_t tag(std::size_t group) const { return tag_base_ + group; }
  /// The group an operator touches (its first tag of ours), if any; switches to it: the group stepped before
  /// goes out, this one comes in, the next one is read ahead. True when the operator touched one of ours
  /// (false while held: then nothing moves and such operators are no optimizer step).
  bool on_operator(const std::vector<std::size_t>& tags);
  /// The optimizer step is over (the engine's next step boundary): the last group stepped goes out and the
  /// first is read ahead for the next step.
  void end_step();
  /// See Backend::hold_optimizer_state.
  void hold(bool hold);
  /// Called when the engine ends, first thing: the optimizer may be gone already (destroyed before the
  /// accelerator), so from now on nothing asks it for its state and nothing moves; then gives an optimizer
  /// that outlives the engine its state back in memory.
  void restore_all();
  NvmeTier& tier() { return *tier_; }

 private:
  void evict(std::size_t group);
  std::vector<torch::Tensor> state_of(std::size_t group) const;
  /// Reads ahead the first sub-group an optimizer steps (the lowest numbers may be none: ZeRO-3's frozen
  /// shards).
  void prefetch_first();

  ParameterTrigger& trigger_;
  std::size_t tag_base_;
  std::unique_ptr<NvmeTier> tier_;
  std::vector<torch::Tensor> masters_;
  std::vector<torch::optim::Optimizer*> optimizers_;
  std::vector<std::vector<torch::Tensor>> watched_;  // per group: the state tensors watched (kept alive)
  std::vector<std::size_t> resident_;                // the groups in memory for the step (sorted)
  bool holding_ = false;
  bool ending_ = false;  // restore_all ran: the optimizer is not asked again
  bool warned_multi_ = false;
};

/// Refuses (UnsupportedOperation naming `backend`) an optimizer whose state the tier cannot swap.
void make_optimizer_offload_check(const torch::optim::Optimizer& optimizer, const std::string& backend);
/// The offload of a ZeRO engine (`backend` on `rank`) for its first optimizer: checks it, makes the tier
/// (rank 0 prints what the tier cleaned up) and takes tags from `tag_base` up.
std::unique_ptr<OptimizerStateOffload> make_optimizer_offload(const NvmeOptions& options,
                                                              const std::string& backend, int rank,
                                                              const torch::optim::Optimizer& optimizer,
                                                              ParameterTrigger& trigger,
                                                              std::size_t tag_base);

}  // namespace accel::backends::detail
