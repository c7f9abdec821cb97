// The ddp backend's side of the config (torch-free; compiled into accel_config). Its settings (ddp_*) are
// top-level keys shared with every backend (bucket sizes, unused parameters, buffer broadcast), so it owns
// no section.
#include "config/config_detail.hpp"

namespace accel::config_detail {

BackendPart ddp_config_part() {
  BackendPart part;
  part.info.name = "ddp";
  part.info.summary = "data parallel (DDP) over several CPU processes or GPUs";
  part.info.distributed_types = {"MULTI_CPU", "MULTI_GPU"};
  part.distributed_type = [](const Config& c) { return std::string(c.use_cpu ? "MULTI_CPU" : "MULTI_GPU"); };
  return part;
}

}  // namespace accel::config_detail
