#pragma once
// Moved to <accel/accelerator/accelerator.hpp>; this forwarding header is kept for one release (0.2 removes
// it).
#include <accel/accelerator/accelerator.hpp>
