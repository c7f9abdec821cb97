#pragma once
// Moved to <accel/parallel/pipeline.hpp>; this forwarding header is kept for one release (0.2 removes it).
#include <accel/parallel/pipeline.hpp>
