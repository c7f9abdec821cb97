/// \file rendezvous_worker.cpp
/// A rank for two_jobs_one_port.sh: joins its job through the Communicator, prints its run id, then
/// all-reduces its rank until the file $STOP_FILE exists (at most 60 s), checking every sum against
/// 0 + 1 + ... + (world size - 1): a rank of another job that joined this one would change the sums or hang
/// them. Exits 1 with the library's message when the Communicator refuses it.

#include <torch/torch.h>
#include <accel/distributed/communicator.hpp>
#include <accel/distributed/env_contract.hpp>
#include <accel/distributed/process_state.hpp>
#include <accel/errors.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <thread>

int main() {
  try {
    const auto state = accel::ProcessState::from_environment();
    accel::CommunicatorOptions options;
    options.timeout = std::chrono::seconds(30);
    const auto comm = accel::Communicator::create(state, torch::kCPU, options);
    const char* run_id = std::getenv(accel::env::kRunId);
    std::cout << "joined run " << (run_id != nullptr ? run_id : "none") << " as rank " << state.rank << " of "
              << state.world_size << std::endl;
    const char* stop_file = std::getenv("STOP_FILE");
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    const double expected = state.world_size * (state.world_size - 1) / 2.0;
    for (long round = 1;; ++round) {
      // Every rank learns whether any rank saw the stop file in the same all-reduce, so all stop together.
      const bool stop = (stop_file != nullptr && std::filesystem::exists(stop_file)) ||
                        std::chrono::steady_clock::now() >= give_up;
      auto t = torch::tensor({static_cast<double>(state.rank), stop ? 1.0 : 0.0}, torch::kFloat64);
      comm->all_reduce(t, accel::ReduceOp::Sum);
      if (t[0].item<double>() != expected) {
        std::cerr << "rank " << state.rank << ": round " << round << " summed the ranks to "
                  << t[0].item<double>() << ", not " << expected << std::endl;
        return 1;
      }
      if (t[1].item<double>() > 0) {
        std::cout << "rank " << state.rank << ": " << round << " all-reduces, every sum " << expected
                  << std::endl;
        return 0;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}
