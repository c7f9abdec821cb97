#pragma once
// Moved to <accel/nn/activation_checkpoint.hpp>; this forwarding header is kept for one release (0.2 removes
// it).
#include <accel/nn/activation_checkpoint.hpp>
