#include "nvme_tier.hpp"

#include "param_trigger.hpp"
#include "storage_guard.hpp"

#include <accel/errors.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <fmt/format.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

namespace accel::backends::detail {
namespace fs = std::filesystem;

namespace {

constexpr std::int64_t kAlign = 4096;  // O_DIRECT: offsets, sizes and addresses on the block size

std::int64_t aligned(std::int64_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "host";
  std::string out = name;
  for (auto& c : out) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') c = '-';
  }
  return out;
}

std::string human(std::uint64_t bytes) {
  return bytes >= (1ull << 30) ? fmt::format("{:.2f} GiB", bytes / double(1ull << 30))
                               : fmt::format("{:.1f} MiB", bytes / double(1ull << 20));
}

bool alive(long pid) {
  return pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
}

int open_file(const std::string& path, int flags, bool direct, const std::string& who) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC | (direct ? O_DIRECT : 0), 0600);
  if (fd < 0) {
    throw std::runtime_error(
        fmt::format("{}: NVMe offload cannot open '{}': {}", who, path, std::strerror(errno)));
  }
  return fd;
}

// The whole of [data, data + n) to or from the file at offset 0; a short transfer is an error naming the
// file.
void write_file(const std::string& path, const std::uint8_t* data, std::int64_t n, bool direct,
                const char* what, const std::string& who) {
  const int fd = open_file(path, O_WRONLY | O_CREAT, direct, who);
  std::int64_t done = 0;
  while (done < n) {
    const auto w = ::pwrite(fd, data + done, static_cast<std::size_t>(n - done), done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int error = w < 0 ? errno : ENOSPC;
      ::close(fd);
      throw std::runtime_error(fmt::format(
          "{}: NVMe offload: writing {} bytes of {} to '{}' failed after {} bytes: {}; free space "
          "there or choose another nvme_path",
          who, n, what, path, done, std::strerror(error)));
    }
    done += w;
  }
  ::close(fd);
}

void read_file(const std::string& path, std::uint8_t* data, std::int64_t n, bool direct, const char* what,
               const std::string& who) {
  const int fd = open_file(path, O_RDONLY, direct, who);
  std::int64_t done = 0;
  while (done < n) {
    const auto r = ::pread(fd, data + done, static_cast<std::size_t>(n - done), done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const std::string why =
          r < 0 ? std::strerror(errno) : "the file is shorter (was it truncated or removed?)";
      ::close(fd);
      throw std::runtime_error(
          fmt::format("{}: NVMe offload: reading {} bytes of {} from '{}' failed after {} bytes: {}", who, n,
                      what, path, done, why));
    }
    done += r;
  }
  ::close(fd);
}

}  // namespace

std::vector<torch::Tensor> optimizer_state_tensors(const torch::optim::OptimizerParamState& s) {
  namespace o = torch::optim;
  std::vector<torch::Tensor> out;
  auto add = [&out](const torch::Tensor& t) {
    if (t.defined()) out.push_back(t);
  };
  if (const auto* a = dynamic_cast<const o::AdamWParamState*>(&s)) {
    add(a->exp_avg()), add(a->exp_avg_sq()), add(a->max_exp_avg_sq());
  } else if (const auto* b = dynamic_cast<const o::AdamParamState*>(&s)) {
    add(b->exp_avg()), add(b->exp_avg_sq()), add(b->max_exp_avg_sq());
  } else if (const auto* m = dynamic_cast<const o::SGDParamState*>(&s)) {
    add(m->momentum_buffer());
  } else if (const auto* r = dynamic_cast<const o::RMSpropParamState*>(&s)) {
    add(r->square_avg()), add(r->momentum_buffer()), add(r->grad_avg());
  } else if (const auto* g = dynamic_cast<const o::AdagradParamState*>(&s)) {
    add(g->sum());
  }
  return out;
}

bool nvme_swappable(const torch::optim::Optimizer& optimizer) {
  namespace o = torch::optim;
  return dynamic_cast<const o::Adam*>(&optimizer) != nullptr ||
         dynamic_cast<const o::AdamW*>(&optimizer) != nullptr ||
         dynamic_cast<const o::SGD*>(&optimizer) != nullptr ||
         dynamic_cast<const o::RMSprop*>(&optimizer) != nullptr ||
         dynamic_cast<const o::Adagrad*>(&optimizer) != nullptr;
}

/// An aligned buffer holding one sub-group's state; the state tensors point into it while it is loaded.
struct NvmeTier::Slab {
  Slab(std::int64_t n, std::shared_ptr<NvmeTier::Stats> s) : bytes(n), stats(std::move(s)) {
    void* p = nullptr;
    if (::posix_memalign(&p, kAlign, static_cast<std::size_t>(bytes)) != 0 || p == nullptr)
      throw std::bad_alloc();
    data = static_cast<std::uint8_t*>(p);
    const auto live = stats->live += static_cast<std::uint64_t>(bytes);
    auto peak = stats->peak.load();
    while (live > peak && !stats->peak.compare_exchange_weak(peak, live)) {
    }
  }
  ~Slab() {
    std::free(data);
    stats->live -= static_cast<std::uint64_t>(bytes);
  }
  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;
  std::int64_t bytes;
  std::uint8_t* data = nullptr;
  std::shared_ptr<NvmeTier::Stats> stats;
};

NvmeTier::NvmeTier(NvmeOptions options, std::string who)
    : options_(std::move(options)), who_(std::move(who)) {
  if (options_.buffer_count < 2) options_.buffer_count = 2;
  std::error_code ec;
  const fs::path root = options_.path;
  fs::create_directories(root, ec);
  if (ec || !fs::is_directory(root)) {
    throw ConfigError(fmt::format(
        "{}: cannot use nvme_path '{}' for NVMe offload: {}; give a directory on a local disk this "
        "process can write ({}_nvme_path, or {}.nvme_path in a DeepSpeed JSON file)",
        who_, options_.path, ec ? ec.message() : "not a directory",
        options_.parameters ? "offload_param" : "offload_optimizer",
        options_.parameters ? "offload_param" : "offload_optimizer"));
  }
  // Directories of processes of this host that no longer run: a killed run's swap files, never read again.
  const std::string host = host_name();
  const std::string prefix = "accel_nvme_" + host + "_";
  std::uint64_t stale_bytes = 0;
  int stale = 0;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string pid = name.substr(prefix.size());
    if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) continue;
    if (alive(std::stol(pid))) continue;
    std::error_code size_ec;
    for (fs::recursive_directory_iterator f(it->path(), size_ec), fend; !size_ec && f != fend;
         f.increment(size_ec)) {
      if (f->is_regular_file(size_ec)) stale_bytes += f->file_size(size_ec);
    }
    std::error_code rm_ec;
    fs::remove_all(it->path(), rm_ec);
    ++stale;
  }
  if (stale > 0) {
    notice_ = fmt::format("NVMe offload: removed {} swap director{} of killed runs under '{}' ({})", stale,
                          stale == 1 ? "y" : "ies", options_.path, human(stale_bytes));
  }
  // This process's directory, and in it one per tier (a GAN's two engines each have one).
  static std::atomic<int> serial{0};
  process_dir_ = (root / (prefix + std::to_string(::getpid()))).string();
  dir_ = (fs::path(process_dir_) / ("engine_" + std::to_string(serial++))).string();
  fs::create_directories(dir_, ec);
  if (ec) {
    throw ConfigError(
        fmt::format("{}: cannot create the NVMe swap directory '{}': {}", who_, dir_, ec.message()));
  }
  // O_DIRECT (no page cache: the point of offloading is that this memory is not used) is a property of the
  // filesystem; tmpfs refuses it, and then the files go through the page cache.
  const std::string probe = (fs::path(dir_) / "probe").string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_DIRECT, 0600);
  direct_ = fd >= 0;
  if (fd >= 0) ::close(fd);
  fs::remove(probe, ec);
  io_ = std::thread([this] { run(); });
}

NvmeTier::~NvmeTier() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (io_.joinable()) io_.join();  // runs what was queued first
  std::error_code ec;
  fs::remove_all(dir_, ec);
  fs::remove(process_dir_, ec);  // when this was the process's last tier (else not empty: stays)
}

std::string NvmeTier::file_of(std::size_t group) const {
  return (fs::path(dir_) / fmt::format("group_{}.swp", group)).string();
}

std::shared_ptr<NvmeTier::Slab> NvmeTier::make_slab(std::int64_t bytes) {
  return std::make_shared<Slab>(bytes, stats_);
}

std::uint64_t NvmeTier::submit(std::function<void()> work) {
  std::lock_guard lock(mu_);
  const auto id = next_job_++;
  queue_.emplace_back(id, std::move(work));
  cv_.notify_all();
  return id;
}

void NvmeTier::run() {
  for (;;) {
    std::pair<std::uint64_t, std::function<void()>> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string error;
    try {
      job.second();
    } catch (const std::exception& e) {
      error = e.what();
    }
    {
      std::lock_guard lock(mu_);
      if (!error.empty()) failed_[job.first] = error;
      done_upto_ = job.first;
    }
    cv_.notify_all();
  }
}

void NvmeTier::wait(std::uint64_t job) {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return done_upto_ >= job; });
  const auto it = failed_.begin();  // a failed job up to this one (failures are kept until reported)
  if (it != failed_.end() && it->first <= job) {
    const std::string error = it->second;
    failed_.erase(it);
    throw CheckpointError(error);
  }
}

void NvmeTier::drain() {
  std::uint64_t last = 0;
  {
    std::lock_guard lock(mu_);
    last = next_job_ - 1;
  }
  if (last > 0) wait(last);
  for (const auto index : writing_)
    groups_.at(index).in_flight.reset();  // written: the file has it, the memory goes
  writing_.clear();
}

void NvmeTier::check_space(const Group& g, std::size_t group) {
  std::error_code ec;
  if (fs::exists(file_of(group), ec)) return;  // written before: the same size again
  struct statvfs st {};
  if (::statvfs(dir_.c_str(), &st) != 0) return;
  const std::uint64_t free = static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
  std::uint64_t pending = 0;  // groups not written yet: each will need its file
  for (const auto& [index, other] : groups_) {
    if (index != group && !other.on_disk && !fs::exists(file_of(index), ec)) pending += other.bytes;
  }
  if (free < static_cast<std::uint64_t>(g.bytes)) {
    throw CheckpointError(
        fmt::format("{}: NVMe offload needs {} more bytes ({}) under '{}' for the {} of sub-group {}, but "
                    "only {} bytes are free there; free space or choose another nvme_path",
                    who_, g.bytes + pending, human(g.bytes + pending), options_.path,
                    options_.parameters ? "parameter shard" : "optimizer state", group, free));
  }
}

void NvmeTier::keep_slabs_under_budget() {
  // The slab being stepped and one read ahead, the rest written behind: wait for the oldest writes.
  const std::size_t budget = static_cast<std::size_t>(std::max(1, options_.buffer_count - 2));
  while (writing_.size() > budget) {
    const auto oldest = writing_.front();
    writing_.pop_front();
    auto& g = groups_.at(oldest);
    if (g.in_flight) {
      wait(g.job);
      g.in_flight.reset();
    }
  }
}

void NvmeTier::evict(std::size_t group, const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> live;
  for (const auto& t : tensors) {
    if (t.defined() && !storage_poisoned(t) && t.numel() > 0) live.push_back(t);
  }
  if (live.empty()) return;
  auto& g = groups_[group];
  // Where each tensor goes in the slab and the file (registered again at every evict: a load_state replaces
  // the optimizer's state objects).
  std::vector<std::int64_t> offsets;
  std::int64_t bytes = 0;
  for (const auto& t : live) {
    if (!t.is_cpu() || !t.is_contiguous()) {
      throw UnsupportedOperation(
          fmt::format("{}: NVMe offload swaps contiguous CPU tensors; a {} tensor is {} {}", who_,
                      options_.parameters ? "parameter shard" : "optimizer state", t.device().str(),
                      t.is_contiguous() ? "memory" : "and not contiguous"));
    }
    offsets.push_back(bytes);
    bytes += aligned(static_cast<std::int64_t>(t.nbytes()));
  }
  g.tensors = live;
  g.offsets = offsets;
  g.bytes = std::max<std::int64_t>(bytes, kAlign);
  check_space(g, group);
  // The slab the tensors point into already (loaded before), or a new one they are copied into.
  std::shared_ptr<Slab> slab = g.in_flight;
  g.in_flight.reset();
  bool in_place = slab && slab->bytes == g.bytes;
  for (std::size_t i = 0; in_place && i < live.size(); ++i)
    in_place = live[i].data_ptr() == slab->data + offsets[i];
  if (!in_place) {
    slab = make_slab(g.bytes);
    for (std::size_t i = 0; i < live.size(); ++i)
      std::memcpy(slab->data + offsets[i], live[i].data_ptr(), live[i].nbytes());
  }
  release_all(g);
  g.on_disk = true;
  g.file_current = true;  // once the write below ends; a load waits for it
  g.in_flight = slab;     // a load before the write ends takes the slab back without reading
  // A failed write leaves the file stale: drop() must then write again rather than trust it (the error itself
  // reaches whoever waits next, which may be another group's wait).
  g.write_failed = std::make_shared<std::atomic<bool>>(false);
  g.job =
      submit([slab, path = file_of(group), direct = direct_, stats = stats_, who = who_,
              what = options_.parameters ? "parameter shard" : "optimizer state", failed = g.write_failed]() {
        try {
          write_file(path, slab->data, slab->bytes, direct, what, who);
        } catch (...) {
          *failed = true;
          throw;
        }
        stats->written += static_cast<std::uint64_t>(slab->bytes);
      });
  writing_.push_back(group);
  if (!options_.write_behind) {
    wait(g.job);
    g.in_flight.reset();
    writing_.pop_back();
  }
  keep_slabs_under_budget();
}

void NvmeTier::point_into(Group& g, const std::shared_ptr<Slab>& slab) {
  // A uint8 tensor over the slab whose deleter keeps the slab alive: each state tensor's storage points into
  // it (point_storage_into keeps the buffer tensor alive in turn).
  auto keep = new std::shared_ptr<Slab>(slab);
  const auto buffer = torch::from_blob(
      slab->data, {slab->bytes}, [keep](void*) { delete keep; }, torch::TensorOptions().dtype(torch::kUInt8));
  for (std::size_t i = 0; i < g.tensors.size(); ++i) {
    const auto& t = g.tensors[i];
    point_storage_into(t, buffer, g.offsets[i] / static_cast<std::int64_t>(t.element_size()));
  }
}

void NvmeTier::prefetch(std::size_t group) {
  if (!options_.read_ahead) return;
  const auto it = groups_.find(group);
  if (it == groups_.end() || !it->second.on_disk || it->second.in_flight) return;
  auto& g = it->second;
  auto slab = make_slab(g.bytes);
  g.in_flight = slab;
  g.job = submit([slab, path = file_of(group), direct = direct_, stats = stats_, who = who_,
                  what = options_.parameters ? "parameter shard" : "optimizer state"]() {
    read_file(path, slab->data, slab->bytes, direct, what, who);
    stats->read += static_cast<std::uint64_t>(slab->bytes);
  });
}

void NvmeTier::load(std::size_t group) {
  const auto it = groups_.find(group);
  if (it == groups_.end() || !it->second.on_disk) return;
  auto& g = it->second;
  const bool writing = std::find(writing_.begin(), writing_.end(), group) != writing_.end();
  if (!g.in_flight) {
    const bool ahead = options_.read_ahead;
    options_.read_ahead = true;
    prefetch(group);  // read now
    options_.read_ahead = ahead;
  }
  // A read ahead (or now): wait for it. A write still in flight: its slab holds the values; wait for the
  // write to end before the optimizer changes them (the file must hold the state it was written with).
  wait(g.job);
  if (writing) writing_.erase(std::find(writing_.begin(), writing_.end(), group));
  point_into(g, g.in_flight);
  // Keep the slab as in_flight: the next evict writes from it without a copy.
  g.on_disk = false;
}

void NvmeTier::release_all(const Group& g) const {
  for (const auto& t : g.tensors) {
    release_storage(
        t,
        options_.parameters
            ? fmt::format("accelerate-cpp: this parameter shard lives on NVMe between uses "
                          "(offload_param_device: nvme, under '{}'); the engine reads it back for each "
                          "gather and for the optimizer's step, and accelerator.get_state_dict(model) or "
                          "save_state gives the whole model",
                          options_.path)
            : fmt::format("accelerate-cpp: this optimizer state lives on NVMe between steps "
                          "(offload_optimizer_device: nvme, under '{}'); the optimizer's own step reads it "
                          "back, and accelerator.save_state(dir) saves it whole; torch::save of the "
                          "optimizer while the accelerator runs cannot",
                          options_.path));
  }
}

void NvmeTier::drop(std::size_t group) {
  const auto it = groups_.find(group);
  if (it == groups_.end() || it->second.on_disk) return;
  auto& g = it->second;
  if (!g.file_current || (g.write_failed && g.write_failed->load())) {
    const auto tensors = g.tensors;
    evict(group, tensors);
    return;
  }
  // The file has these values: free the memory (the slab the tensors point into) without writing.
  release_all(g);
  g.in_flight.reset();
  g.on_disk = true;
}

void NvmeTier::mark_changed(std::size_t group) {
  const auto it = groups_.find(group);
  if (it != groups_.end()) it->second.file_current = false;
}

bool NvmeTier::evicted(std::size_t group) const {
  const auto it = groups_.find(group);
  return it != groups_.end() && it->second.on_disk;
}

// ---------------------------------------------------------------------------------------------------------------

OptimizerStateOffload::OptimizerStateOffload(NvmeOptions options, std::string who, ParameterTrigger& trigger,
                                             std::size_t tag_base)
    : trigger_(trigger),
      tag_base_(tag_base),
      tier_(std::make_unique<NvmeTier>(std::move(options), std::move(who))) {}

OptimizerStateOffload::~OptimizerStateOffload() {
  for (auto& tensors : watched_) {
    for (const auto& t : tensors)
      trigger_.unwatch_live(t);
  }
}

void OptimizerStateOffload::add_group(std::size_t group, torch::Tensor master,
                                      torch::optim::Optimizer* optimizer) {
  if (masters_.size() <= group) {
    masters_.resize(group + 1);
    optimizers_.resize(group + 1, nullptr);
    watched_.resize(group + 1);
  }
  masters_[group] = std::move(master);
  optimizers_[group] = optimizer;
}

std::vector<torch::Tensor> OptimizerStateOffload::state_of(std::size_t group) const {
  const auto* optimizer = optimizers_[group];
  if (optimizer == nullptr) return {};
  const auto& state = optimizer->state();
  const auto it = state.find(masters_[group].unsafeGetTensorImpl());
  if (it == state.end()) return {};
  return optimizer_state_tensors(*it->second);
}

void OptimizerStateOffload::evict(std::size_t group) {
  auto tensors = state_of(group);
  if (tensors.empty()) return;  // not stepped yet: no state
  // Watch the tensors the optimizer holds now (a load_state replaces them): an operator on them brings the
  // group back before it reads them.
  auto& watched = watched_[group];
  const bool same = watched.size() == tensors.size() &&
                    std::equal(watched.begin(), watched.end(), tensors.begin(),
                               [](const torch::Tensor& a, const torch::Tensor& b) { return a.is_same(b); });
  if (!same) {
    for (const auto& t : watched)
      trigger_.unwatch_live(t);
    for (const auto& t : tensors)
      trigger_.watch_live(t, tag(group));
    watched = tensors;
  }
  tier_->evict(group, tensors);
}

bool OptimizerStateOffload::on_operator(const std::vector<std::size_t>& tags) {
  // While held (save_state, load_state read and replace the state) nothing moves, and operators on it are no
  // optimizer step: not reported as ours.
  if (holding_ || ending_) return false;
  std::vector<std::size_t> groups;
  for (const auto t : tags) {
    if (t >= tag_base_ && t - tag_base_ < masters_.size()) groups.push_back(t - tag_base_);
  }
  if (groups.empty()) return false;
  std::sort(groups.begin(), groups.end());
  groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
  if (groups == resident_) return true;
  if (groups.size() == 1 && std::find(resident_.begin(), resident_.end(), groups[0]) != resident_.end())
    return true;
  // An operator over several sub-groups at once (accel::optim's fused step: one call for every tensor) needs
  // them all in memory together.
  if (groups.size() > 1 && !warned_multi_) {
    warned_multi_ = true;
    std::cerr
        << fmt::format(
               "[accelerate-cpp] {}: the optimizer updates {} sub-groups in one call (a fused multi-tensor "
               "step), so with NVMe offload their whole state is in memory during optimizer.step(); "
               "LibTorch's torch::optim::AdamW/Adam step one tensor at a time and keep one sub-group in "
               "memory",
               tier_->who(), groups.size())
        << std::endl;
  }
  for (const auto r : resident_) {
    if (!std::binary_search(groups.begin(), groups.end(), r)) evict(r);
  }
  for (const auto g : groups)
    tier_->load(g);
  resident_ = groups;
  if (groups.back() + 1 < masters_.size()) tier_->prefetch(groups.back() + 1);
  return true;
}

void OptimizerStateOffload::prefetch_first() {
  for (std::size_t g = 0; g < optimizers_.size(); ++g) {
    if (optimizers_[g] != nullptr) {
      tier_->prefetch(g);
      return;
    }
  }
}

void OptimizerStateOffload::end_step() {
  if (holding_ || ending_ || resident_.empty()) return;
  for (const auto r : resident_)
    evict(r);
  resident_.clear();
  prefetch_first();
}

void OptimizerStateOffload::hold(bool hold) {
  if (hold == holding_) return;
  if (hold) {
    end_step();
    for (std::size_t g = 0; g < masters_.size(); ++g)
      tier_->load(g);
    holding_ = true;
    return;
  }
  holding_ = false;
  for (std::size_t g = 0; g < masters_.size(); ++g)
    evict(g);
  tier_->drain();
  prefetch_first();
}

void OptimizerStateOffload::restore_all() {
  ending_ = true;
  resident_.clear();
  for (std::size_t g = 0; g < masters_.size(); ++g) {
    // Only for an optimizer that still holds the tensors (it outlives the engine; the optimizer itself may be
    // gone, so it is not asked): held here and by the tier, a third holder is the optimizer.
    if (!watched_[g].empty() && watched_[g].front().use_count() > 2 && tier_->evicted(g)) tier_->load(g);
  }
}

void make_optimizer_offload_check(const torch::optim::Optimizer& optimizer, const std::string& backend) {
  if (nvme_swappable(optimizer)) return;
  throw UnsupportedOperation(fmt::format(
      "{}: offload_optimizer_device: nvme swaps the state of LibTorch's Adam, AdamW, SGD, RMSprop and "
      "Adagrad (accel::optim's fused ones included); this optimizer keeps state of another kind: use "
      "one of those, or offload_optimizer_device: cpu",
      backend));
}

std::unique_ptr<OptimizerStateOffload> make_optimizer_offload(const NvmeOptions& options,
                                                              const std::string& backend, int rank,
                                                              const torch::optim::Optimizer& optimizer,
                                                              ParameterTrigger& trigger,
                                                              std::size_t tag_base) {
  make_optimizer_offload_check(optimizer, backend);
  auto offload = std::make_unique<OptimizerStateOffload>(options, fmt::format("{} rank {}", backend, rank),
                                                         trigger, tag_base);
  if (!offload->tier().notice().empty() && rank == 0)
    std::cerr << "[accelerate-cpp] " << offload->tier().notice() << std::endl;
  return offload;
}

}  // namespace accel::backends::detail
