#pragma once
// Moved to <accel/checkpoint/objects_archive.hpp>; this forwarding header is kept for one release (0.2
// removes it).
#include <accel/checkpoint/objects_archive.hpp>
