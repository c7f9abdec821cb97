#pragma once
/// \file checkpointing.hpp
/// Former name of <accel/nn/activation_checkpoint.hpp> (activation checkpointing), kept so that existing
/// includes build; checkpoints of training state are save_state / load_state on the Accelerator.
#include <accel/nn/activation_checkpoint.hpp>
