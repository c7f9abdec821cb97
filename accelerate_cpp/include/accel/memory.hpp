#pragma once
// Moved to <accel/monitor/memory.hpp>; this forwarding header is kept for one release (0.2 removes it).
#include <accel/monitor/memory.hpp>
