#pragma once
// Moved to <accel/optim/grad_scaler.hpp>; this forwarding header is kept for one release (0.2 removes it).
#include <accel/optim/grad_scaler.hpp>
