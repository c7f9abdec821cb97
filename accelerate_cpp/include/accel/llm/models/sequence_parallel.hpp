#pragma once
/// \file sequence_parallel.hpp
/// Long sequences over several ranks for the causal LMs of causal_lm.hpp: the positions of each sequence are
/// cut over the ranks of a group (Accelerator::sequence_parallel_group()), each rank computing its part of
/// every layer, and attention exchanges what it needs across the group.
///
/// - Sequence parallelism (DeepSpeed Ulysses, Accelerate's ALST, `parallelism_config_sp_size` with
///   `sp_backend: deepspeed`): each rank holds a contiguous part of the positions; around attention an
///   all-to-all trades positions for heads (each rank attends with num_heads / size heads over the whole
///   sequence) and a second one trades them back. Needs num_attention_heads and num_key_value_heads
///   divisible by the group's size.
/// - Context parallelism (`parallelism_config_cp_size`; PyTorch's context_parallel with causal load
///   balancing): the sequence cut into 2 x size chunks, rank r holding chunks r and 2 x size - 1 - r; keys
///   and values either all-gathered over the group (`cp_comm_strategy: allgather`, Accelerate's default;
///   PyTorch's `_RotateMethod.ALL_GATHER`), each rank attending its queries to all of them, or passed around
///   a ring (`alltoall`, PyTorch's `_RotateMethod.ALL_TO_ALL`: ring attention): each rank sends its block to
///   the next rank point to point while attending the block it holds, merges the partial outputs by their
///   log-sum-exp, skips the block pairs the causal mask hides, and in backward recomputes each block from the
///   saved log-sum-exp while the key/value gradients travel the ring back to their owner. A rank then holds
///   two blocks of keys and values at a time instead of the whole sequence's.
///
///   accel::llm::enable_sequence_parallel(*model, accelerator.sequence_parallel_group());
///   auto part = accel::llm::shard_sequence(batch, *model);   // sequence_shard.hpp: this rank's positions
///   auto loss = accel::llm::sequence_parallel_sft_loss(*model, batch, 1);  // the whole sequence's sum
///
/// The model's gradients on each rank are those of its positions: the Accelerator's engines reduce over
/// every rank under sp/cp (see Accelerator::sequence_parallel_group()). No KV cache (generation) while
/// enabled. Collective: the forward and backward of an enabled model run on every rank of the group.

#include <accel/llm/models/causal_lm.hpp>

#include <memory>
#include <string>

namespace accel::llm {

/// Splits `model`'s attention over `group` (Ulysses). A group of one disables the split. UsageError naming
/// the numbers when num_attention_heads or num_key_value_heads is not divisible by the group's size.
void enable_sequence_parallel(CausalLMImpl& model, std::shared_ptr<Communicator> group);

/// Splits `model`'s attention over `group` by context parallelism (load-balanced chunks), moving keys and
/// values by `comm_strategy` (Accelerate's `parallelism_config_cp_comm_strategy`): "allgather" (all-gathered)
/// or "alltoall" (ring attention). A group of one disables the split. UsageError naming the value and the
/// allowed ones for any other strategy.
void enable_context_parallel(CausalLMImpl& model, std::shared_ptr<Communicator> group,
                             const std::string& comm_strategy = "allgather");

/// The global positions (int64 [length / size]) rank `rank` of `size` holds of a sequence of `length`
/// (a multiple of size, or of 2 x size with `load_balanced`): contiguous, or chunks rank and
/// 2 x size - 1 - rank of 2 x size (context parallelism).
torch::Tensor sequence_shard_index(std::int64_t length, int rank, int size, bool load_balanced);

}  // namespace accel::llm
