#pragma once
// Moved to <accel/distributed/env_contract.hpp>; this forwarding header is kept for one release (0.2 removes
// it).
#include <accel/distributed/env_contract.hpp>
