#pragma once
// Moved to <accel/distributed/process_state.hpp>; this forwarding header is kept for one release (0.2 removes
// it).
#include <accel/distributed/process_state.hpp>
