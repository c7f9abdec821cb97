#pragma once
// safetensors::write_file that also reports the file's size and XXH64, computed while writing (for the
// checkpoint manifest, manifest.hpp).

#include <accel/checkpoint/safetensors.hpp>

#include "checkpoint/xxh64.hpp"

#include <map>
#include <string>
#include <vector>

namespace accel::detail {

FileDigest write_safetensors(const std::string& path, const std::vector<safetensors::TensorView>& tensors,
                             const std::map<std::string, std::string>& metadata = {});

}  // namespace accel::detail
