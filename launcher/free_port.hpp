#pragma once
/// \file free_port.hpp
/// TCP port helpers of accel-launch: pick a free port, and check that the rendezvous port is not taken before
/// any rank starts (a busy port otherwise shows up as a rendezvous timeout minutes later).

#include <string>

namespace accel::launcher {

/// A TCP port that is free on `host` right now (the kernel's choice for port 0). Another process may take it
/// before the ranks bind it; the window is short. `host` is an IPv4/IPv6 address or a name; throws
/// accel::LaunchError naming the host when it cannot be resolved or bound.
int pick_free_port(const std::string& host = "127.0.0.1");

/// True when a TCP listener could bind `port` on `host` now (TIME_WAIT leftovers of a finished run do not
/// count as busy). When `host` is not an address of this machine the check falls back to the wildcard
/// address. Throws accel::LaunchError when `host` cannot be resolved.
bool is_port_free(const std::string& host, int port);

}  // namespace accel::launcher
