// The accumulation clock alone (accel/accelerator/gradient_state.hpp, torch-free): which backward calls form
// one micro-step, when gradients sync, what is counted, and what a checkpoint saves and restores.
#include <accel/accelerator/gradient_state.hpp>
#include <accel/errors.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <vector>

using accel::GradientCounters;
using accel::GradientState;

namespace {

// One backward per call, no loader, no scope: returns whether each call synced.
std::vector<bool> plain_backwards(GradientState& clock, int calls) {
  std::vector<bool> synced;
  for (int i = 0; i < calls; ++i) {
    REQUIRE(clock.begin_backward(false, 1));
    synced.push_back(clock.sync_gradients());
  }
  return synced;
}

// A prepared loader yields a batch: it advances the shared clock.
void next_batch(GradientState& clock) {
  ++*clock.batch_clock();
}

}  // namespace

TEST_CASE("gradient state: without a loader or scope every backward is a micro-step, syncing every N") {
  GradientState clock(3);
  CHECK(clock.sync_gradients());  // before any backward: a step taken by hand syncs
  CHECK(plain_backwards(clock, 7) == std::vector<bool>{false, false, true, false, false, true, false});
  CHECK(clock.micro_steps() == 7);
  GradientState one(1);
  CHECK(plain_backwards(one, 3) == std::vector<bool>{true, true, true});
}

TEST_CASE("gradient state: every backward of one loader batch is one micro-step (a GAN's two losses)") {
  GradientState clock(2);
  std::vector<bool> synced;
  for (int batch = 0; batch < 4; ++batch) {
    next_batch(clock);
    CHECK(clock.begin_backward(false, 2));        // the discriminator's loss starts the micro-step
    CHECK_FALSE(clock.begin_backward(false, 2));  // the generator's loss belongs to it
    synced.push_back(clock.sync_gradients());
    clock.count_step();
    clock.count_step();  // counted once per micro-step however often it is asked
  }
  CHECK(synced == std::vector<bool>{false, true, false, true});
  CHECK(clock.micro_steps() == 4);
  CHECK(clock.completed_steps() == 4);  // the clock counts what the facade tells it: once per micro-step
}

TEST_CASE("gradient state: an accumulate() scope is one micro-step and wins over the loader") {
  GradientState clock(2);
  next_batch(clock);
  clock.open_scope();
  CHECK(clock.begin_backward(false, 1));
  next_batch(clock);  // a second loader yielding inside the scope does not cut it
  CHECK_FALSE(clock.begin_backward(false, 1));
  clock.close_scope();
  CHECK_FALSE(clock.sync_gradients());
  clock.open_scope();
  CHECK(clock.begin_backward(false, 1));
  CHECK(clock.sync_gradients());
  clock.close_scope();
  CHECK(clock.micro_steps() == 2);
}

TEST_CASE("gradient state: the last batch of the data syncs whatever the cycle position") {
  GradientState clock(4);
  next_batch(clock);
  CHECK(clock.begin_backward(false, 1));
  CHECK_FALSE(clock.sync_gradients());
  next_batch(clock);
  CHECK(clock.begin_backward(true, 1));
  CHECK(clock.sync_gradients());
  // The next epoch starts a new cycle: four more micro-steps before the next sync.
  std::vector<bool> synced;
  for (int i = 0; i < 4; ++i) {
    next_batch(clock);
    clock.begin_backward(false, 1);
    synced.push_back(clock.sync_gradients());
  }
  CHECK(synced == std::vector<bool>{false, false, false, true});
}

TEST_CASE("gradient state: accumulation with several optimizers and no batch boundary is a UsageError") {
  GradientState clock(2);
  try {
    clock.begin_backward(false, 2);
    FAIL("expected a UsageError");
  } catch (const accel::UsageError& e) {
    const std::string msg = e.what();
    CHECK(msg.find("gradient_accumulation_steps is 2 and 2 optimizers are prepared") != std::string::npos);
    CHECK(msg.find("accelerator.accumulate(model)") != std::string::npos);
  }
  GradientState no_accumulation(1);
  CHECK(no_accumulation.begin_backward(false, 2));  // each backward syncs: nothing to tell apart
  CHECK_THROWS_AS(GradientState(0), accel::UsageError);
}

TEST_CASE("gradient state: counters save a closed cycle as position 0 and restore mid-cycle") {
  GradientState clock(3);
  plain_backwards(clock, 3);  // one full cycle, just synced
  clock.count_step();
  GradientCounters saved = clock.counters();
  CHECK(saved.micro_steps == 3);
  CHECK(saved.cycle_position == 0);
  CHECK(saved.completed_steps == 1);
  plain_backwards(clock, 1);
  saved = clock.counters();
  CHECK(saved.cycle_position == 1);

  GradientState resumed(3);
  resumed.restore(saved);
  CHECK(resumed.micro_steps() == 4);
  CHECK(resumed.completed_steps() == 1);
  // Two more micro-steps complete the cycle that was open at the save.
  CHECK(plain_backwards(resumed, 2) == std::vector<bool>{false, true});
}

TEST_CASE("gradient state: a pipeline step is one whole synced cycle of its micro-batches") {
  GradientState clock(4);
  clock.pipeline_step(4, true);
  CHECK(clock.sync_gradients());
  CHECK(clock.micro_steps() == 4);
  CHECK(clock.completed_steps() == 1);
  clock.pipeline_step(4, false);  // skipped (fp16 overflow): not counted as an optimizer step
  CHECK(clock.completed_steps() == 1);
  CHECK(clock.micro_steps() == 8);
}
