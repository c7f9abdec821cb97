// The local backend's side of the config (torch-free; compiled into accel_config): one process, no section.
#include "config/config_detail.hpp"

namespace accel::config_detail {

BackendPart local_config_part() {
  BackendPart part;
  part.info.name = "local";
  part.info.summary = "no distributed training: one process";
  part.info.distributed_types = {"NO"};
  part.info.max_processes = 1;
  part.info.multi_process_replacement = "ddp";
  return part;
}

}  // namespace accel::config_detail
