#pragma once
// Moved to <accel/monitor/progress.hpp>; this forwarding header is kept for one release (0.2 removes it).
#include <accel/monitor/progress.hpp>
