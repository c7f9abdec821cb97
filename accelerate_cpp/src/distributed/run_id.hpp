#pragma once
// Private: the job's identity in its rendezvous (torchrun's rdzv_id), read from the environment beside the
// rest of ProcessState (process_state.cpp) and checked by the Communicator when it joins rank 0's store.

#include <functional>
#include <string>

namespace accel::detail {

/// The run id every rank of one job shares: TORCHELASTIC_RUN_ID (accel-launch's random id per launch or its
/// --run_id; torchrun's --rdzv_id); without it under Slurm, "slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>" (one
/// srun step); otherwise "none", torchrun's default. `getenv` is injectable for tests.
std::string run_id_from_environment(const std::function<const char*(const char*)>& getenv = nullptr);

}  // namespace accel::detail
