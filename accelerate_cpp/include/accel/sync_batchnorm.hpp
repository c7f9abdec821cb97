#pragma once
// Moved to <accel/nn/sync_batchnorm.hpp>; this forwarding header is kept for one release (0.2 removes it).
#include <accel/nn/sync_batchnorm.hpp>
