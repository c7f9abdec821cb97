#pragma once
// Moved to <accel/monitor/tracking.hpp>; this forwarding header is kept for one release (0.2 removes it).
#include <accel/monitor/tracking.hpp>
