#pragma once
// Moved to <accel/distributed/communicator.hpp>; this forwarding header is kept for one release (0.2 removes
// it).
#include <accel/distributed/communicator.hpp>
