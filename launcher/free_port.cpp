/// \file free_port.cpp
/// bind()-based port probing: the only reliable way to ask the kernel whether a listener could use a port.

#include "free_port.hpp"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <utility>

#include "accel/errors.hpp"

namespace accel::launcher {
namespace {

struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { freeaddrinfo(info); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// Numeric or named host -> addresses (port 0), for binding.
AddrInfoPtr resolve(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), "0", &hints, &result);
  if (rc != 0) {
    throw LaunchError("cannot resolve main_process_ip '" + host + "': " + gai_strerror(rc) +
                      "; pass an IP address or a host name of machine 0 with --main_process_ip");
  }
  return AddrInfoPtr(result);
}

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

void set_port(sockaddr_storage& address, int port) {
  if (address.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&address)->sin6_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in*>(&address)->sin_port = htons(static_cast<uint16_t>(port));
  }
}

int get_port(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&address)->sin6_port);
  }
  return ntohs(reinterpret_cast<const sockaddr_in*>(&address)->sin_port);
}

// Binds a fresh TCP socket to `info` with `port`; returns 0 or errno. On success `bound` gets the address.
int try_bind(const addrinfo& info, int port, sockaddr_storage* bound) {
  Socket socket(::socket(info.ai_family, info.ai_socktype | SOCK_CLOEXEC, info.ai_protocol));
  if (socket.get() < 0) return errno;
  // A listener may reuse a port whose connections sit in TIME_WAIT, so the probe must too; Linux still
  // refuses the bind while another socket listens on the port.
  const int one = 1;
  setsockopt(socket.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_storage address{};
  std::memcpy(&address, info.ai_addr, info.ai_addrlen);
  set_port(address, port);
  if (::bind(socket.get(), reinterpret_cast<const sockaddr*>(&address), info.ai_addrlen) != 0) return errno;
  if (bound != nullptr) {
    socklen_t length = sizeof(*bound);
    if (getsockname(socket.get(), reinterpret_cast<sockaddr*>(bound), &length) != 0) return errno;
  }
  return 0;
}

}  // namespace

std::pair<int, int> ephemeral_port_range() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  if (in >> low >> high && 0 < low && low <= high && high < 65536) return {low, high};
  return {32768, 60999};  // Linux's default
}

int pick_free_port(const std::string& host) {
  // Below the kernel's range for the local ports of outgoing connections: a port picked inside it (the
  // kernel's choice for port 0) can be taken by any connection another program opens before rank 0 listens
  // (seen with several launches at once, each rank connecting to its store and to its peers), while no
  // connection takes a port below it unless a program binds that port itself.
  const int first = kFirstPickedPort;
  const int last = ephemeral_port_range().first - 1;
  if (last - first >= 1000) {
    std::mt19937 random(std::random_device{}() ^ static_cast<unsigned>(::getpid()));
    std::uniform_int_distribution<int> port_in(first, last);
    for (int attempt = 0; attempt < 64; ++attempt) {
      const int port = port_in(random);
      if (is_port_free(host, port)) return port;
    }
  }
  const AddrInfoPtr infos = resolve(host);
  int last_error = 0;
  for (const addrinfo* info = infos.get(); info != nullptr; info = info->ai_next) {
    sockaddr_storage bound{};
    last_error = try_bind(*info, 0, &bound);
    if (last_error == 0) return get_port(bound);
  }
  throw LaunchError("cannot pick a free port on '" + host + "': " + std::strerror(last_error) +
                    "; pass an explicit --main_process_port");
}

bool is_port_free(const std::string& host, int port) {
  const AddrInfoPtr infos = resolve(host);
  bool address_foreign = true;
  for (const addrinfo* info = infos.get(); info != nullptr; info = info->ai_next) {
    const int error = try_bind(*info, port, nullptr);
    if (error == EADDRINUSE) return false;
    if (error == EACCES) {
      throw LaunchError("port " + std::to_string(port) + " on " + host +
                        " needs root privileges; choose a port above 1023 with --main_process_port");
    }
    if (error != EADDRNOTAVAIL) address_foreign = false;
  }
  if (!address_foreign) return true;
  // The name does not belong to this machine (NAT, container): the ranks listen on the wildcard address
  // anyway.
  const AddrInfoPtr any = resolve("");
  for (const addrinfo* info = any.get(); info != nullptr; info = info->ai_next) {
    const int error = try_bind(*info, port, nullptr);
    if (error == EADDRINUSE || error == EACCES) return false;
  }
  return true;
}

}  // namespace accel::launcher
