#pragma once
// A TCP port on the loopback interface that is free now (another program may take it again before it is used;
// the window is short). Shared by the Catch2 tests that start a rendezvous store themselves.

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <utility>

namespace accel::test {

/// A socket bound to a free loopback port, listening when `listen`; returns {fd, port}. Close the fd.
inline std::pair<int, int> bound_loopback_socket(bool listen) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  if (listen) REQUIRE(::listen(fd, 1) == 0);
  socklen_t length = sizeof(address);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  return {fd, ntohs(address.sin_port)};
}

inline int free_port() {
  const auto [fd, port] = bound_loopback_socket(/*listen=*/false);
  ::close(fd);
  return port;
}

}  // namespace accel::test
