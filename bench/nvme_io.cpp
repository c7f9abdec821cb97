// bench_nvme_io: which asynchronous I/O to use for NVMe offload (issue 28), measured on this machine's disk.
//
// NvmeTier (backends/common/nvme_tier.cpp) moves each sub-group's slab (one aligned buffer, one file) with
// one pwrite or pread on one I/O thread per rank, O_DIRECT. DeepSpeed's async_io uses libaio with a queue of
// requests; the issue asks for io_uring or libaio, chosen by measurement. This program moves the same slabs
// the three ways, O_DIRECT, 4 KiB-aligned buffers:
//   thread   one pwrite/pread per slab, one slab at a time (what NvmeTier does; the kernel splits a large
//            O_DIRECT request into many device requests itself)
//   io_uring the slabs cut into --chunk_kib requests, --depth of them in flight (liburing)
//   libaio   the same through io_submit / io_getevents (DeepSpeed's choice)
// and prints each one's write and read bandwidth (median of --repeats) and its ratio to `thread`. No
// LibTorch.
//
//   bench_nvme_io [--dir /var/tmp/accel-nvme-io] [--slab_mib 16] [--slabs 32] [--chunk_kib 1024]
//                 [--depths 1,4,16] [--repeats 3]
#include <fcntl.h>
#include <libaio.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr std::size_t kAlign = 4096;

struct Options {
  std::string dir = "/var/tmp/accel-nvme-io";
  std::size_t slab_mib = 16;
  int slabs = 32;
  std::size_t chunk_kib = 1024;
  std::vector<int> depths{1, 4, 16};
  int repeats = 3;
};

[[noreturn]] void die(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

// One file per slab, as NvmeTier writes them.
struct Files {
  std::vector<int> fds;
  Files(const Options& o, bool write) {
    for (int i = 0; i < o.slabs; ++i) {
      const std::string path = o.dir + "/slab" + std::to_string(i);
      const int fd = ::open(path.c_str(), (write ? O_WRONLY | O_CREAT | O_TRUNC : O_RDONLY) | O_DIRECT, 0600);
      if (fd < 0) die("open " + path + " with O_DIRECT");
      fds.push_back(fd);
    }
  }
  ~Files() {
    for (int fd : fds)
      ::close(fd);
  }
};

struct Buffers {
  std::vector<char*> slabs;
  Buffers(int n, std::size_t bytes) {
    for (int i = 0; i < n; ++i) {
      void* p = nullptr;
      if (::posix_memalign(&p, kAlign, bytes) != 0) die("posix_memalign");
      std::memset(p, i + 1, bytes);
      slabs.push_back(static_cast<char*>(p));
    }
  }
  ~Buffers() {
    for (char* p : slabs)
      std::free(p);
  }
};

// A request: slab, offset, length.
struct Request {
  int slab;
  std::size_t offset, length;
};

std::vector<Request> cut(const Options& o) {
  std::vector<Request> out;
  const std::size_t slab = o.slab_mib << 20, chunk = o.chunk_kib << 10;
  for (int s = 0; s < o.slabs; ++s) {
    for (std::size_t off = 0; off < slab; off += chunk)
      out.push_back({s, off, std::min(chunk, slab - off)});
  }
  return out;
}

// Seconds to move every slab, by `move(fds, buffers, write)`.
using Mover = std::function<void(const Files&, const Buffers&, bool)>;

void thread_mover(const Options& o, const Files& f, const Buffers& b, bool write) {
  const std::size_t bytes = o.slab_mib << 20;
  for (int s = 0; s < o.slabs; ++s) {
    std::size_t done = 0;
    while (done < bytes) {
      const auto n = write ? ::pwrite(f.fds[s], b.slabs[s] + done, bytes - done, static_cast<off_t>(done))
                           : ::pread(f.fds[s], b.slabs[s] + done, bytes - done, static_cast<off_t>(done));
      if (n <= 0) die(write ? "pwrite" : "pread");
      done += static_cast<std::size_t>(n);
    }
  }
}

void uring_mover(const Options& o, int depth, const Files& f, const Buffers& b, bool write) {
  io_uring ring;
  if (const int rc = io_uring_queue_init(static_cast<unsigned>(depth), &ring, 0); rc < 0) {
    errno = -rc;
    die("io_uring_queue_init");
  }
  const auto requests = cut(o);
  std::size_t next = 0, inflight = 0;
  while (next < requests.size() || inflight > 0) {
    while (next < requests.size() && inflight < static_cast<std::size_t>(depth)) {
      const Request& r = requests[next++];
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (write)
        io_uring_prep_write(sqe, f.fds[r.slab], b.slabs[r.slab] + r.offset, static_cast<unsigned>(r.length),
                            r.offset);
      else
        io_uring_prep_read(sqe, f.fds[r.slab], b.slabs[r.slab] + r.offset, static_cast<unsigned>(r.length),
                           r.offset);
      ++inflight;
    }
    io_uring_submit(&ring);
    io_uring_cqe* cqe = nullptr;
    if (const int rc = io_uring_wait_cqe(&ring, &cqe); rc < 0) {
      errno = -rc;
      die("io_uring_wait_cqe");
    }
    if (cqe->res < 0) {
      errno = -cqe->res;
      die(write ? "io_uring write" : "io_uring read");
    }
    io_uring_cqe_seen(&ring, cqe);
    --inflight;
  }
  io_uring_queue_exit(&ring);
}

void aio_mover(const Options& o, int depth, const Files& f, const Buffers& b, bool write) {
  io_context_t ctx = nullptr;
  if (const int rc = io_setup(depth, &ctx); rc < 0) {
    errno = -rc;
    die("io_setup");
  }
  const auto requests = cut(o);
  std::vector<iocb> blocks(static_cast<std::size_t>(depth));
  std::vector<iocb*> free_blocks;
  for (auto& blk : blocks)
    free_blocks.push_back(&blk);
  std::vector<io_event> events(static_cast<std::size_t>(depth));
  std::size_t next = 0, inflight = 0;
  while (next < requests.size() || inflight > 0) {
    std::vector<iocb*> batch;
    while (next < requests.size() && !free_blocks.empty()) {
      const Request& r = requests[next++];
      iocb* cb = free_blocks.back();
      free_blocks.pop_back();
      if (write)
        io_prep_pwrite(cb, f.fds[r.slab], b.slabs[r.slab] + r.offset, r.length,
                       static_cast<long long>(r.offset));
      else
        io_prep_pread(cb, f.fds[r.slab], b.slabs[r.slab] + r.offset, r.length,
                      static_cast<long long>(r.offset));
      batch.push_back(cb);
    }
    if (!batch.empty()) {
      if (const int rc = io_submit(ctx, static_cast<long>(batch.size()), batch.data());
          rc != static_cast<int>(batch.size())) {
        errno = rc < 0 ? -rc : EIO;
        die("io_submit");
      }
      inflight += batch.size();
    }
    const int got = io_getevents(ctx, 1, depth, events.data(), nullptr);
    if (got < 0) {
      errno = -got;
      die("io_getevents");
    }
    for (int i = 0; i < got; ++i) {
      if (static_cast<long>(events[static_cast<std::size_t>(i)].res) < 0) {
        errno = static_cast<int>(-static_cast<long>(events[static_cast<std::size_t>(i)].res));
        die(write ? "libaio write" : "libaio read");
      }
      free_blocks.push_back(events[static_cast<std::size_t>(i)].obj);
    }
    inflight -= static_cast<std::size_t>(got);
  }
  io_destroy(ctx);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ','))
    out.push_back(std::stoi(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--dir")
      o.dir = value;
    else if (flag == "--slab_mib")
      o.slab_mib = std::stoul(value);
    else if (flag == "--slabs")
      o.slabs = std::stoi(value);
    else if (flag == "--chunk_kib")
      o.chunk_kib = std::stoul(value);
    else if (flag == "--depths")
      o.depths = parse_list(value);
    else if (flag == "--repeats")
      o.repeats = std::stoi(value);
    else {
      std::fprintf(stderr, "bench_nvme_io: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (o.slab_mib == 0 || o.slabs < 1 || o.chunk_kib < 4 || o.chunk_kib % 4 != 0 || o.repeats < 1) {
    std::fprintf(
        stderr,
        "bench_nvme_io: --slab_mib, --slabs, --repeats must be positive, --chunk_kib a multiple of 4\n");
    return 2;
  }
  try {
    std::filesystem::create_directories(o.dir);
    Buffers buffers(o.slabs, o.slab_mib << 20);
    const double mb = static_cast<double>(o.slab_mib << 20) * o.slabs / 1e6;
    struct Engine {
      std::string name;
      Mover move;
    };
    std::vector<Engine> engines{
        {"thread pwrite/pread, one slab per call",
         [&](const Files& f, const Buffers& b, bool w) { thread_mover(o, f, b, w); }}};
    for (int d : o.depths) {
      engines.push_back(
          {"io_uring, depth " + std::to_string(d) + " x " + std::to_string(o.chunk_kib) + " KiB",
           [&o, d](const Files& f, const Buffers& b, bool w) { uring_mover(o, d, f, b, w); }});
      engines.push_back({"libaio, depth " + std::to_string(d) + " x " + std::to_string(o.chunk_kib) + " KiB",
                         [&o, d](const Files& f, const Buffers& b, bool w) { aio_mover(o, d, f, b, w); }});
    }
    std::printf("%d slabs of %zu MiB (%.0f MB) under %s, O_DIRECT, median of %d\n", o.slabs, o.slab_mib, mb,
                o.dir.c_str(), o.repeats);
    std::printf("%-44s %12s %12s %8s %8s\n", "engine", "write MB/s", "read MB/s", "w ratio", "r ratio");
    // Repeats interleave the engines, so that a drift of the disk's speed touches them alike.
    std::vector<std::vector<double>> w(engines.size()), r(engines.size());
    for (int rep = 0; rep < o.repeats; ++rep) {
      for (std::size_t k = 0; k < engines.size(); ++k) {
        {
          Files files(o, true);
          const auto t0 = std::chrono::steady_clock::now();
          engines[k].move(files, buffers, true);
          w[k].push_back(mb / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        {
          Files files(o, false);
          const auto t0 = std::chrono::steady_clock::now();
          engines[k].move(files, buffers, false);
          r[k].push_back(mb / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
      }
    }
    const double base_w = median(w[0]), base_r = median(r[0]);
    for (std::size_t k = 0; k < engines.size(); ++k) {
      const double mw = median(w[k]), mr = median(r[k]);
      std::printf("%-44s %12.0f %12.0f %8.2f %8.2f\n", engines[k].name.c_str(), mw, mr, mw / base_w,
                  mr / base_r);
    }
    std::filesystem::remove_all(o.dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_nvme_io: %s\n", e.what());
    std::filesystem::remove_all(o.dir);
    return 1;
  }
  return 0;
}
