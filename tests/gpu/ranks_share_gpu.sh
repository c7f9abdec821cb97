#!/usr/bin/env bash
# The backends on several ranks on CUDA (issue 27): `accel-launch test` (process layout, collectives, data
# sharding, 4 training steps against one process on the CPU) under DDP, ZeRO 1-3 (fp16 with DeepSpeed's
# scaler, CPU and NVMe offload), FSDP (FULL_SHARD, SHARD_GRAD_OP, parameter offload, HSDP on 4 ranks), each on
# GPU ranks. NCCL needs a GPU per rank; on a machine with fewer GPUs than ranks the CUDA collectives go
# through Gloo on host copies (ACCEL_CUDA_COLLECTIVES=gloo) and the ranks share the GPUs. Without one, the
# ranks are refused with an error naming that variable (checked first). Then the loops users port
# (conformance/real_loops.cpp: a GAN with and without accumulation, a frozen teacher, hand-written
# accumulation, no_sync, fp16, LoRA, SyncBatchNorm, BatchNorm buffers, clipping, fused AdamW) on GPU ranks of
# each backend row against one process on the CPU. Exits 77 (skipped) where LibTorch sees no CUDA device.
# Last, the tensor-parallel MLP on 2 GPU ranks.
#   ranks_share_gpu.sh ACCEL_LAUNCH ACCEL_GPU_TESTS DIST_WORKER TENSOR_PARALLEL_WORKER
set -u
launch=$1
gpus=$("$2" --cuda-devices) || { echo "ranks_share_gpu: SKIPPED: LibTorch sees no CUDA device"; exit 77; }
echo "ranks_share_gpu: $gpus CUDA device(s)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unset ACCEL_CONFIG_FILE
failed=0

# config NAME PROCESSES BACKEND_LINES...: a config for GPU ranks (use_cpu false).
config() {
  local name=$1 n=$2
  shift 2
  { printf 'config_version: 1\nuse_cpu: false\nnum_processes: %s\nmain_process_port: 0\n' "$n"; printf '%s\n' "$@"; } \
    >"$work/$name.yaml"
}

# Ranks beyond the GPUs without ACCEL_CUDA_COLLECTIVES: refused, naming the way out.
n_over=$((gpus + 1))
config over "$n_over" "backend: ddp"
out=$(env -u ACCEL_CUDA_COLLECTIVES "$launch" test --config_file "$work/over.yaml" 2>&1)
if [[ $out == *"ACCEL_CUDA_COLLECTIVES=gloo to let the ranks share"* ]]; then
  echo "ok   $n_over ranks on $gpus GPU(s) with NCCL: refused, naming ACCEL_CUDA_COLLECTIVES=gloo"
else
  echo "FAIL $n_over ranks on $gpus GPU(s) with NCCL were not refused as expected:"
  echo "$out" | tail -5
  failed=1
fi

config ddp 2 "backend: ddp" "mixed_precision: 'no'"
config ddp_bf16 2 "backend: ddp" "mixed_precision: bf16"
config ddp_fp16_accum2 2 "backend: ddp" "mixed_precision: fp16" "gradient_accumulation_steps: 2"
config zero1 2 "backend: zero" "deepspeed_config:" "  zero_stage: 1"
config zero2_fp16 2 "backend: zero" "mixed_precision: fp16" "deepspeed_config:" "  zero_stage: 2"
config zero2_offload 2 "backend: zero" "deepspeed_config:" "  zero_stage: 2" "  offload_optimizer_device: cpu"
config zero3 2 "backend: zero" "deepspeed_config:" "  zero_stage: 3"
config zero3_bf16_offload 2 "backend: zero" "mixed_precision: bf16" "deepspeed_config:" "  zero_stage: 3" \
  "  offload_param_device: cpu" "  offload_optimizer_device: cpu"
config zero3_nvme 2 "backend: zero" "deepspeed_config:" "  zero_stage: 3" "  offload_optimizer_device: nvme" \
  "  offload_optimizer_nvme_path: $work/nvme"
config fsdp_full 2 "distributed_type: FSDP" "fsdp_config:" "  fsdp_sharding_strategy: FULL_SHARD"
config fsdp_grad_op_bf16 2 "distributed_type: FSDP" "mixed_precision: bf16" "fsdp_config:" \
  "  fsdp_sharding_strategy: SHARD_GRAD_OP"
config fsdp_offload 2 "distributed_type: FSDP" "fsdp_config:" "  fsdp_sharding_strategy: FULL_SHARD" \
  "  fsdp_offload_params: true"
config hsdp_2x2 4 "distributed_type: FSDP" "fsdp_config:" "  fsdp_version: 2" "parallelism_config:" \
  "  parallelism_config_dp_replicate_size: 2" "  parallelism_config_dp_shard_size: 2"
mkdir -p "$work/nvme"
export ACCEL_CUDA_COLLECTIVES=gloo
for name in ddp ddp_bf16 ddp_fp16_accum2 zero1 zero2_fp16 zero2_offload zero3 zero3_bf16_offload zero3_nvme \
  fsdp_full fsdp_grad_op_bf16 fsdp_offload hsdp_2x2; do
  SECONDS=0
  out=$("$launch" test --config_file "$work/$name.yaml" 2>&1)
  rc=$?
  secs=$SECONDS
  if [[ $rc -eq 0 && $out == *", device cuda:"* && $out == *"accel-launch test: passed"* ]]; then
    echo "ok   $name ($(echo "$out" | grep -o 'max difference [^)]*' | head -1), ${secs} s)"
  else
    echo "FAIL $name (rc $rc):"
    echo "$out" | grep -v "^ *frame #" | tail -12
    failed=1
  fi
done

# worker NAME SCENARIOS PROGRAM ARGS...: PROGRAM's scenarios on 2 GPU ranks (ACCEL_TEST_DEVICE=cuda: the
# workers put their ranks' layers and rows on the GPU); passes when rank 0 ran all SCENARIOS.
worker() {
  local name=$1 want=$2
  shift 2
  SECONDS=0
  out=$(ACCEL_TEST_DEVICE=cuda "$launch" launch --num_processes 2 --main_process_port 0 "$@" 2>&1)
  rc=$?
  if [[ $rc -eq 0 && $out == *"[rank 0] scenario(s) passed: $want"* ]]; then
    echo "ok   $name: $want scenario(s) on 2 GPU ranks match one process ($SECONDS s)"
  else
    echo "FAIL $name (rc $rc):"
    echo "$out" | grep -v "frame #" | grep -E "FAILED|--|error|passed|failed" | head -20
    failed=1
  fi
}

# The real loops on GPU ranks of each row, against one process on the CPU.
loops=two_models,gan_accumulation,frozen_teacher,hand_accumulation,lora,no_sync,fp16_hand_accumulation
loops+=,two_backward_accumulation,own_batches,fused_adamw,buffers,sync_batchnorm,libtorch_clip
n_loops=$(($(tr ',' '\n' <<<"$loops" | wc -l)))
for row in ddp zero1 zero2 zero3 fsdp_full_shard fsdp_grad_op; do
  worker "real loops on $row" "$n_loops" "$3" "$loops" "$row"
done
# Tensor parallelism: Column -> GELU -> Row against the unsplit MLP (outputs, gradients, SGD steps).
worker "tensor parallel MLP" 1 "$4" mlp
[[ $failed -eq 0 ]] && echo "ranks_share_gpu: all passed"
exit $failed
