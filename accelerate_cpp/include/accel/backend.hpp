#pragma once
// Moved to <accel/backend/backend.hpp>; this forwarding header is kept for one release (0.2 removes it).
#include <accel/backend/backend.hpp>
