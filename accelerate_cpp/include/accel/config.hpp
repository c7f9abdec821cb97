#pragma once
// Moved to <accel/config/config.hpp>; this forwarding header is kept for one release (0.2 removes it).
#include <accel/config/config.hpp>
