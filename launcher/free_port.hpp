#pragma once
/// \file free_port.hpp
/// TCP port helpers of accel-launch: pick a free port, and check that the rendezvous port is not taken before
/// any rank starts (a busy port otherwise shows up as a rendezvous timeout minutes later).

#include <string>
#include <utility>

namespace accel::launcher {

/// The lowest port pick_free_port picks (above the well-known ports and most registered services).
constexpr int kFirstPickedPort = 10000;

/// The kernel's range of local ports for outgoing connections (/proc/sys/net/ipv4/ip_local_port_range;
/// Linux's default 32768-60999 where it cannot be read).
std::pair<int, int> ephemeral_port_range();

/// A TCP port that is free on `host` right now: a random one from kFirstPickedPort up to just below the
/// ephemeral range, which no outgoing connection takes (the kernel's choice for port 0 where that range
/// leaves fewer than 1000 ports below it, or none of 64 tries is free). Another program that binds ports
/// itself may still take it before the ranks bind it. `host` is an IPv4/IPv6 address or a name; throws
/// accel::LaunchError naming the host when it cannot be resolved or bound.
int pick_free_port(const std::string& host = "127.0.0.1");

/// True when a TCP listener could bind `port` on `host` now (TIME_WAIT leftovers of a finished run do not
/// count as busy). When `host` is not an address of this machine the check falls back to the wildcard
/// address. Throws accel::LaunchError when `host` cannot be resolved.
bool is_port_free(const std::string& host, int port);

}  // namespace accel::launcher
