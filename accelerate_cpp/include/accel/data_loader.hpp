#pragma once
// Moved to <accel/data/data_loader.hpp>; this forwarding header is kept for one release (0.2 removes it).
#include <accel/data/data_loader.hpp>
