#pragma once
// Moved to <accel/config/questions.hpp>; this forwarding header is kept for one release (0.2 removes it).
#include <accel/config/questions.hpp>
